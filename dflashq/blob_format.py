"""The blob format's identity: its name and the version each codec writes, without the codec (dflashq.blob, which
needs torch): the manifest records the version a run writes, and operator commands read manifests."""

from __future__ import annotations

FORMAT = "dflashq-blob"
CODEC_VERSIONS = {"bf16": 1, "fp8": 2}  # the format version each codec writes; a reader takes every one of them
FORMAT_VERSION = max(CODEC_VERSIONS.values())
