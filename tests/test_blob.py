"""Blob format: lossless round trip, per-sample views, corruption and version detection, statistics."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch

from dflashq.blob import (
    FORMAT_VERSION,
    blob_stats,
    decode_blob,
    encode_blob,
    read_metadata,
    shuffle_bytes,
    unshuffle_bytes,
)
from dflashq.exceptions import BlobError

META = {"run": "r1", "chunk_id": "r1-e0-abc-000000000-000000002", "epoch": 0, "layer_ids": [1, 5, 9]}
LENGTHS = [5, 64, 131]


def _chunk(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    hidden = (torch.randn(n, 3, 32, generator=g) * 3).to(dtype)
    hidden[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -65504.0]).to(dtype)  # signed zero, tiny, large
    ids = torch.randint(0, 151936, (n,), generator=g).numpy().astype(np.int32)
    mask = (torch.rand(n, generator=g) > 0.5).numpy().astype(np.uint8)
    offsets = np.cumsum([0, *LENGTHS])
    return hidden, ids, mask, offsets


def _encode(dtype=torch.bfloat16, **kwargs) -> bytes:
    hidden, ids, mask, offsets = _chunk(dtype)
    return b"".join(encode_blob(hidden, ids, mask, offsets, META, sample_index=[7, 8, 9], **kwargs))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("threads", [0, 2])
def test_round_trip_is_bit_exact(dtype, threads):
    hidden, ids, mask, offsets = _chunk(dtype)
    blob = decode_blob(_encode(dtype, level=5, threads=threads))
    assert blob.hidden.dtype == dtype and torch.equal(_bits(blob.hidden), _bits(hidden))
    assert np.array_equal(blob.input_ids.numpy(), ids) and np.array_equal(blob.loss_mask.numpy(), mask)
    assert blob.offsets.tolist() == offsets.tolist() and blob.sample_index.tolist() == [7, 8, 9]
    assert (blob.chunk_id, blob.epoch, blob.layer_ids) == (META["chunk_id"], 0, [1, 5, 9])
    pieces = list(blob.samples())
    assert [p[0].shape for p in pieces] == [(n, 3, 32) for n in LENGTHS]
    assert torch.equal(_bits(pieces[2][0]), _bits(hidden[69:]))
    assert np.array_equal(pieces[1][1].numpy(), ids[5:69])


def test_metadata_is_self_describing():
    meta = read_metadata(_encode())
    assert meta["format"] == "dflashq-blob" and meta["version"] == str(FORMAT_VERSION)
    assert meta["dtype"] == "bfloat16" and json.loads(meta["shape"]) == [200, 3, 32]
    assert json.loads(meta["layer_ids"]) == [1, 5, 9] and "z-lab" in meta["layer_convention"]
    assert meta["shuffle"] == "byte-planes" and meta["compressor"].startswith("zstd")
    assert meta["checksum"].startswith("crc32:")


def test_blob_is_a_standard_safetensors_file():
    tensors = safetensors.numpy.load(_encode())  # written by hand (no copy of the payload); the library must agree
    assert {k: (str(v.dtype), v.shape[0]) for k, v in tensors.items() if k != "hidden_zstd"} == {
        "input_ids": ("int32", 200), "loss_mask": ("uint8", 200), "offsets": ("int64", 4), "sample_index": ("int64", 3)
    }
    assert tensors["hidden_zstd"].dtype == np.uint8 and tensors["sample_index"].tolist() == [7, 8, 9]


def test_gpu_style_pre_shuffled_input_matches():
    hidden, ids, mask, offsets = _chunk(torch.bfloat16)
    planes = shuffle_bytes(hidden)
    assert planes.shape == (2, 200, 3, 32) and planes.dtype == torch.uint8
    assert torch.equal(_bits(unshuffle_bytes(planes.numpy(), torch.bfloat16)), _bits(hidden))
    data = b"".join(encode_blob(planes, ids, mask, offsets, META, dtype=torch.bfloat16))
    assert torch.equal(_bits(decode_blob(data).hidden), _bits(hidden))


def test_shuffle_helps_compression_of_activation_like_data():
    # Values of similar magnitude share their high byte; shuffling lines those bytes up for zstd.
    hidden = (torch.randn(4096, 2, 64, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    blob = encode_blob(hidden, np.zeros(4096), np.zeros(4096), [0, 4096], META)[0]
    assert len(blob) < hidden.numel() * 2 * 0.8


@pytest.mark.parametrize("where", [0.5, 0.9, 0.999])
def test_flipped_byte_in_payload_is_detected(where):
    data = bytearray(_encode())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    position = header + int((len(data) - header) * where)
    data[position] ^= 0x10
    with pytest.raises(BlobError):
        decode_blob(bytes(data))


@pytest.mark.parametrize("keep", [0, 5, 100, -1])
def test_truncated_blob_is_detected(keep):
    data = _encode()
    with pytest.raises(BlobError):
        decode_blob(data[: keep if keep >= 0 else len(data) - 1])


def _with_metadata(data: bytes, **changes) -> bytes:
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"].update(changes)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + size :]


def test_unknown_version_and_foreign_files_are_refused():
    data = _encode()
    assert decode_blob(_with_metadata(data, run="r1")).metadata["run"] == "r1"  # the rewrite itself is sound
    with pytest.raises(BlobError, match="version '2'"):
        decode_blob(_with_metadata(data, version="2"))
    with pytest.raises(BlobError, match="not a dflashq-blob"):
        read_metadata(_with_metadata(data, format="something-else"))
    with pytest.raises(BlobError, match="checksum"):
        decode_blob(_with_metadata(data, checksum="crc32:00000000"))


def test_blob_stats_per_layer():
    hidden, ids, mask, offsets = _chunk(torch.float32)
    hidden[:, 1] = 0
    hidden[3, 2, 0] = float("nan")
    blob = decode_blob(b"".join(encode_blob(hidden, ids, mask, offsets, META)))
    stats = blob_stats(blob)
    assert list(stats) == [1, 5, 9]
    assert stats[5]["zero_fraction"] == 1.0 and stats[5]["abs_max"] == 0.0
    assert stats[9]["non_finite"] == 1 and 2.5 < stats[9]["std"] < 3.5  # NaN left out of the moments
    assert stats[1]["non_finite"] == 0 and stats[1]["min"] == -65504.0 and stats[1]["abs_max"] == 65504.0
