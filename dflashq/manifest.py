"""Run manifest: the facts every part of a run must agree on, written once (Redis + `<store>/<run>/run.json`).

A producer, worker or trainer whose config disagrees refuses to join, naming the field."""

from __future__ import annotations

import hashlib
import json
import os

import redis

from dflashq.blob_format import CODEC_VERSIONS
from dflashq.exceptions import ManifestMismatch
from dflashq.keys import Keys
from dflashq.layer_ids import CONVENTION
from dflashq.store import Store


def model_fingerprint(model_path: str) -> str:
    """Cheap identity of a target checkpoint: its config and the names and sizes of its weight files."""
    h = hashlib.sha256()
    if not os.path.isdir(model_path):
        return ""
    for name in sorted(os.listdir(model_path)):
        full = os.path.join(model_path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
        elif name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(full)}".encode())
    return h.hexdigest()[:16]


def expected(settings, layer_ids: list[int] | None = None, data_fingerprint: str | None = None) -> dict:
    """The manifest fields a command knows from its own config (None = this command does not know it)."""
    return {
        "run": settings.run,
        "model_path": os.path.abspath(settings.model.path) if settings.model.path else None,
        "model_fingerprint": model_fingerprint(settings.model.path) if settings.model.path else None,
        "layer_ids": list(layer_ids) if layer_ids is not None else None,
        "layer_id_convention": CONVENTION,
        "max_length": settings.data.max_length,
        "data_fingerprint": data_fingerprint,
        "codec": settings.store.codec,
        "blob_format_version": CODEC_VERSIONS[settings.store.codec],
    }


# Fields a joining command must match; model_path may differ between hosts as long as the fingerprint agrees.
# mask_token_id and architecture ("dflash" / "dflash2") are added by the trainer: the drafter's MASK token, chosen
# once per run, and the drafter it trains (producers and workers serve either).
CHECKED = ("model_fingerprint", "layer_ids", "max_length", "data_fingerprint", "codec", "blob_format_version",
           "mask_token_id", "architecture")
# What a manifest written before a field existed meant by it: runs started before codecs stored bf16.
LEGACY = {"codec": "bf16"}


def join(conn: redis.Redis, store: Store, mine: dict) -> dict:
    """Write the manifest if this is the run's first command, else check `mine` against it and fill gaps.

    Fields a command does not know (None) are not checked; a later command that knows them completes the manifest.
    """
    keys = Keys(mine["run"])
    run_json = store.path("run.json")
    # A Redis that lost its data (no persistence) must not let a mismatched command in: run.json remembers.
    on_disk = json.loads(store.read(run_json)) if store.exists(run_json) else {}
    while True:
        with conn.pipeline() as pipe:
            try:
                pipe.watch(keys.manifest)
                raw = pipe.get(keys.manifest)
                current = json.loads(raw) if raw else on_disk
                for field in CHECKED:
                    theirs, ours = current.get(field, LEGACY.get(field) if current else None), mine.get(field)
                    if theirs is not None and ours is not None and theirs != ours:
                        raise ManifestMismatch(
                            f"Run '{mine['run']}' was started with {field} = {theirs!r} but this command has {ours!r}: "
                            f"use the run's original {field} or choose another run name."
                        )
                merged = {**{k: v for k, v in mine.items() if v is not None}, **{k: v for k, v in current.items() if v is not None}}
                if merged != current:
                    pipe.multi()
                    pipe.set(keys.manifest, json.dumps(merged, sort_keys=True))
                    pipe.execute()
                break
            except redis.WatchError:
                continue
    if merged != on_disk:
        store.write_atomic(run_json, json.dumps(merged, indent=2, sort_keys=True).encode())
    return merged


def read(conn: redis.Redis, run: str) -> dict:
    raw = conn.get(Keys(run).manifest)
    return json.loads(raw) if raw else {}
