"""Blob: one chunk's extracted hidden states, as one self-describing safetensors file.

Tensors: `hidden_zstd` (uint8, the byte-shuffled and zstd-compressed hidden states [N, K, H] of all samples
concatenated), `input_ids` int32 [N], `loss_mask` uint8 [N], `offsets` int64 [S + 1] and `sample_index` int64 [S].
String metadata: format, version, run, chunk id, epoch, layer ids (JSON, z-lab convention), dtype, shape, shuffle
scheme, compressor, codec, checksum (crc32 of the small tensors; the compressed hidden states carry zstd's own xxh64
content checksum, verified on decompression). Byte-shuffling puts byte i of every value into plane i; the high (sign/exponent)
planes of activations are far more repetitive than the mantissa planes, which is what zstd then exploits.

Codecs (the run's store.codec): `bf16` stores the target dtype's values losslessly (format version 1, as before the
field existed); `fp8` (version 2) stores float8 e4m3 values with one fp32 scale per token and layer (`scales`
[N, K], amax / 448, outside the compressed payload), and records the encoder's measured relative error per layer.
Readers accept both versions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import safetensors.numpy
import torch
import zstandard

from dflashq import defaults
from dflashq.blob_format import CODEC_VERSIONS, FORMAT
from dflashq.exceptions import BlobError
from dflashq.layer_ids import CONVENTION

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: a row's amax maps onto it
# the largest error of a stored value relative to its row's amax: half a unit in the last place of 3 mantissa bits
CODEC_RELATIVE_ERROR = {"bf16": 0.0, "fp8": 2.0 ** -4}
SHUFFLE = "byte-planes"  # plane i holds byte i (little-endian) of every value
COMPRESSOR = "zstd"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}
_REQUIRED = ("format", "version", "run", "chunk_id", "epoch", "layer_ids", "dtype", "shape", "checksum")


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K, H] -> (e4m3 values [N, K, H], fp32 scales [N, K], relative error per layer [K]), on hidden's device
    (the worker runs it on the GPU). A row of zeros keeps scale 1; a NaN stays NaN and an inf turns its row NaN, so
    verify and inspect still find them."""
    n, k, _ = hidden.shape
    values = torch.empty(hidden.shape, dtype=FP8, device=hidden.device)  # [N, K, H]
    scales = torch.empty((n, k), dtype=torch.float32, device=hidden.device)  # [N, K]
    relative = torch.empty(k, dtype=torch.float32, device=hidden.device)  # [K]
    for layer in range(k):  # one layer's fp32 copies at a time: a 16k-token 27B chunk's all at once are 5 GB
        x = hidden[:, layer].float()  # [N, H]
        amax = x.abs().amax(dim=-1)  # [N]
        scales[:, layer] = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [N]
        values[:, layer] = (x / scales[:, layer, None]).to(FP8)  # [N, H]
        error = values[:, layer].float() * scales[:, layer, None] - x  # [N, H]
        norm = x.square().sum().sqrt().clamp_min(torch.finfo(torch.float32).tiny)  # []
        relative[layer] = error.square().sum().sqrt() / norm  # ||error|| / ||x|| over the layer's states
    return values, scales, relative


def stored_bytes_per_token(codec: str, layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Hidden-state bytes of one token before compression: K x H values (1 byte each for fp8, plus K scales)."""
    if codec == "fp8":
        return layers * (hidden_size + 4)
    return layers * hidden_size * torch.empty(0, dtype=dtype).element_size()


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [N, K, H] and scales [N, K] -> `dtype` [N, K, H], on the tensors' device."""
    return (values.float() * scales.float()[..., None]).to(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"blobs hold bfloat16, float16 or float32 hidden states, not {dtype}")


def shuffle_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 [itemsize, *t.shape] byte planes of `t`, on t's device (run it on the GPU before the copy to host)."""
    t = t.contiguous()
    size = t.element_size()
    planes = t.view(torch.uint8).reshape(*t.shape, size)
    return planes.permute(t.dim(), *range(t.dim())).contiguous()


def unshuffle_bytes(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of shuffle_bytes, on planes' device (the trainer's GPU: a transpose there takes microseconds, on a CPU
    core longer than zstd): uint8 [itemsize, *shape] -> `dtype` [*shape]."""
    if planes.shape[0] == 1:  # 1-byte values: nothing to interleave
        return planes[0].view(dtype)
    return planes.permute(*range(1, planes.dim()), 0).contiguous().view(dtype).reshape(planes.shape[1:])


def _as_array(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=dtype)


def _checksum(arrays: list[np.ndarray]) -> str:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(a, crc)
    return f"crc32:{crc:08x}"


def encode_blob(
    hidden: torch.Tensor | np.ndarray,
    input_ids,
    loss_mask,
    offsets,
    meta: dict,
    level: int = defaults.COMPRESS_LEVEL,
    threads: int = 0,
    *,
    sample_index=None,
    dtype: torch.dtype | None = None,
    codec: str = "bf16",
    scales=None,
    relative_error: list[float] | None = None,
) -> list[bytes | memoryview]:
    """Serialize one chunk; returns buffers for Store.write_atomic.

    `hidden` is either float [N, K, H] or, already shuffled (e.g. on the GPU), shuffle_bytes' uint8
    [itemsize, N, K, H] output together with its original `dtype`. With codec fp8 a float `hidden` is quantized
    here; already quantized, it is quantize_fp8's values as byte planes [1, N, K, H] with their `scales` [N, K],
    `relative_error` and the target `dtype`. `meta` needs run, chunk_id, epoch, layer_ids.
    `threads` is zstd's worker count (0: compress in the calling thread).
    """
    if codec not in CODEC_VERSIONS:
        raise ValueError(f"codec must be one of {sorted(CODEC_VERSIONS)}, not {codec!r}")
    if isinstance(hidden, np.ndarray):
        hidden = torch.from_numpy(hidden)
    if dtype is None:
        dtype = hidden.dtype
        if codec == "fp8":
            hidden, scales, error = quantize_fp8(hidden.detach())
            relative_error = error.tolist()
        planes = shuffle_bytes(hidden.detach().cpu())
    else:
        planes = hidden.detach().cpu().contiguous()
    shape = list(planes.shape[1:])
    itemsize = 1 if codec == "fp8" else torch.empty(0, dtype=dtype).element_size()
    if len(shape) != 3 or planes.dtype != torch.uint8 or planes.shape[0] != itemsize:
        raise ValueError(f"hidden must be [N, K, H] (or its byte planes); got {tuple(hidden.shape)} {hidden.dtype}")
    if (codec == "fp8") != (scales is not None):
        raise ValueError("fp8 blobs need their scales [N, K]; bf16 blobs have none")
    planes = planes.numpy()
    ids = _as_array(input_ids, np.int32)
    mask = _as_array(loss_mask, np.uint8)
    offs = _as_array(offsets, np.int64)
    index = _as_array(sample_index if sample_index is not None else [-1] * (len(offs) - 1), np.int64)
    if ids.shape != (shape[0],) or mask.shape != ids.shape or offs[0] != 0 or offs[-1] != shape[0]:
        raise ValueError("input_ids, loss_mask and offsets must describe the same tokens as hidden")
    if index.shape != (len(offs) - 1,):
        raise ValueError("sample_index needs one entry per sample")
    small = [ids, mask, offs, index]
    if scales is not None:
        scales = _as_array(scales, np.float32)
        if scales.shape != tuple(shape[:2]):
            raise ValueError(f"scales must be [N, K] = {shape[:2]}, not {list(scales.shape)}")
        small.append(scales)
    # zstd's own xxh64 content checksum covers the hidden states, computed in its worker threads (a separate
    # single-threaded crc over ~1 GB per chunk would stall the writer); crc32 covers the small tensors.
    compressed = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True).compress(planes)
    metadata = {
        "format": FORMAT,
        "version": str(CODEC_VERSIONS[codec]),
        "codec": codec,
        "run": str(meta["run"]),
        "chunk_id": str(meta["chunk_id"]),
        "epoch": str(int(meta["epoch"])),
        "layer_ids": json.dumps([int(i) for i in meta["layer_ids"]]),
        "layer_convention": CONVENTION,
        "dtype": dtype_name(dtype),
        "shape": json.dumps(shape),
        "shuffle": SHUFFLE,
        "compressor": f"{COMPRESSOR}:{level}",
        "checksum": _checksum(small),
    }
    if relative_error is not None:
        metadata["relative_error"] = json.dumps([round(float(e), 6) for e in relative_error])
    tensors = {
        "offsets": offs,
        "sample_index": index,
        **({"scales": scales} if scales is not None else {}),
        "input_ids": ids,
        "loss_mask": mask,
        "hidden_zstd": np.frombuffer(compressed, dtype=np.uint8),
    }
    return _safetensors_buffers(tensors, metadata)


def _safetensors_buffers(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> list:
    """The safetensors file as [header, tensor buffers...], so the compressed payload is written without a copy
    (safetensors' own save() concatenates everything into one new bytes object)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, array in tensors.items():  # largest items first, so every tensor stays aligned to its item size
        end = offset + array.nbytes
        header[name] = {"dtype": _ST_DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors' writer does
    return [struct.pack("<Q", len(encoded)) + encoded, *(memoryview(a).cast("B") for a in tensors.values())]


@dataclasses.dataclass
class Blob:
    planes: torch.Tensor  # [itemsize, N, K, H] uint8: byte planes of the stored values (on the CPU)
    input_ids: torch.Tensor  # [N] int32
    loss_mask: torch.Tensor  # [N] uint8
    offsets: torch.Tensor  # [S + 1] int64
    sample_index: torch.Tensor  # [S] int64
    metadata: dict[str, str]
    scales: torch.Tensor | None = None  # [N, K] fp32 per token and layer (codec fp8)

    @property
    def codec(self) -> str:
        return self.metadata.get("codec", "bf16")  # blobs written before the field existed are lossless

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.metadata["dtype"]]

    @property
    def relative_error(self) -> list[float] | None:
        """fp8: ||stored - original|| / ||original|| per tapped layer, measured by the encoder."""
        raw = self.metadata.get("relative_error")
        return json.loads(raw) if raw else None

    @property
    def stored_dtype(self) -> torch.dtype:
        return FP8 if self.codec == "fp8" else self.dtype

    @functools.cached_property
    def values(self) -> torch.Tensor:
        """[N, K, H] as stored: the target dtype (codec bf16) or float8 e4m3 (codec fp8), on the CPU."""
        return unshuffle_bytes(self.planes, self.stored_dtype)

    def hidden_on(self, device: torch.device | str) -> torch.Tensor:
        """[N, K, H] in the target dtype on `device`: the byte planes travel as they are stored and are unshuffled
        (and an fp8 blob dequantized) there."""
        values = unshuffle_bytes(self.planes.to(device, non_blocking=self.planes.is_pinned()), self.stored_dtype)
        if self.scales is None:
            return values
        return dequantize_fp8(values, self.scales.to(device), self.dtype)

    @functools.cached_property
    def hidden(self) -> torch.Tensor:
        """[N, K, H] in the target dtype, on the CPU."""
        return self.hidden_on("cpu")

    @property
    def layer_ids(self) -> list[int]:
        return json.loads(self.metadata["layer_ids"])

    @property
    def chunk_id(self) -> str:
        return self.metadata["chunk_id"]

    @property
    def epoch(self) -> int:
        return int(self.metadata["epoch"])

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def samples(self, device: torch.device | str | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sample: (hidden [T, K, H], input_ids [T], loss_mask [T]); hidden on `device` (default: the CPU), as
        views into one [N, K, H] tensor."""
        hidden = self.hidden if device is None else self.hidden_on(device)
        bounds = self.offsets.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            yield hidden[start:end], self.input_ids[start:end], self.loss_mask[start:end]


def read_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The blob's string metadata, checked for format and version, without decompressing anything."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise BlobError("the blob is truncated (no safetensors header); re-extract its chunk.")
    (size,) = struct.unpack("<Q", view[:8])
    if size > len(view) - 8:
        raise BlobError("the blob is truncated (header runs past the end); re-extract its chunk.")
    try:
        metadata = json.loads(bytes(view[8 : 8 + size]))["__metadata__"]
    except (ValueError, KeyError, TypeError):
        raise BlobError("the blob header is corrupt (not safetensors with metadata); re-extract its chunk.") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BlobError(f"the file is not a {FORMAT} (format {metadata.get('format')!r}); point dflashq at its blobs.")
    readable = sorted(set(CODEC_VERSIONS.values()))
    if metadata.get("version") not in map(str, readable):
        raise BlobError(
            f"blob format version {metadata.get('version')!r} is not supported by this dflashq (reads "
            f"{', '.join(map(str, readable))}); use the dflashq version that wrote the run."
        )
    missing = [key for key in _REQUIRED if key not in metadata]
    if missing:
        raise BlobError(f"the blob metadata lacks {', '.join(missing)}; re-extract its chunk.")
    codec = metadata.get("codec", "bf16")
    if CODEC_VERSIONS.get(codec) != int(metadata["version"]):
        raise BlobError(f"the blob's codec {codec!r} does not belong to format version {metadata['version']}; re-extract its chunk.")
    return metadata


def _decompress(compressed: np.ndarray, shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """zstd straight into a new uint8 tensor of `shape` (no copy of the output); reading past its end makes zstd
    check the frame's content checksum, and finds a frame longer than the shape."""
    out = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
    view, got = memoryview(out.numpy()).cast("B"), 0
    with zstandard.ZstdDecompressor().stream_reader(compressed) as reader:
        while got < len(view):
            n = reader.readinto(view[got:])
            if not n:
                raise ValueError(f"hidden states end after {got} of {len(view)} bytes")
            got += n
        if reader.read(1):
            raise ValueError(f"hidden states run past {len(view)} bytes")
    return out


def decode_blob(data: bytes, pinned: bool = False) -> Blob:
    """Parse, decompress and checksum-verify a blob (its values are unshuffled where they are used: hidden_on); any
    damage raises BlobError. `pinned` (CUDA only): the byte planes in page-locked memory, so that their copy to the
    GPU is faster and leaves the host free to launch the step meanwhile (the trainer's read-ahead)."""
    metadata = read_metadata(data)
    chunk = metadata["chunk_id"]
    fp8 = metadata.get("codec") == "fp8"
    try:
        tensors = safetensors.numpy.load(bytes(data))
        stored = FP8 if fp8 else _DTYPES[metadata["dtype"]]
        planes_shape = (torch.empty(0, dtype=stored).element_size(), *json.loads(metadata["shape"]))
        planes = _decompress(tensors["hidden_zstd"], planes_shape, pinned)
        others = [tensors[name] for name in ("input_ids", "loss_mask", "offsets", "sample_index")]
        scales = tensors["scales"] if fp8 else None
    except Exception as exc:
        raise BlobError(f"blob of chunk {chunk} is corrupt ({type(exc).__name__}); re-extract the chunk.") from None
    if _checksum(others + ([scales] if fp8 else [])) != metadata["checksum"]:
        raise BlobError(f"blob of chunk {chunk} fails its checksum; re-extract the chunk.")
    return Blob(planes, *(torch.from_numpy(a) for a in others), metadata,
                torch.from_numpy(scales) if fp8 else None)


def blob_stats(blob: Blob) -> dict[int, dict[str, float]]:
    """Per tapped layer id: mean, std, min, max, abs_max, zero_fraction, non_finite, and for fp8 blobs the
    encoder's relative_error (for `dflashq inspect`)."""
    stats = {}
    errors = blob.relative_error
    for k, layer in enumerate(blob.layer_ids):
        x = blob.hidden[:, k].float()
        finite = x[torch.isfinite(x)]
        stats[layer] = {
            "mean": finite.mean().item() if finite.numel() else float("nan"),
            "std": finite.std().item() if finite.numel() > 1 else float("nan"),
            "min": finite.min().item() if finite.numel() else float("nan"),
            "max": finite.max().item() if finite.numel() else float("nan"),
            "abs_max": finite.abs().max().item() if finite.numel() else float("nan"),
            "zero_fraction": (x == 0).float().mean().item() if x.numel() else float("nan"),
            "non_finite": int(x.numel() - finite.numel()),
            **({"relative_error": errors[k]} if errors else {}),
        }
    return stats
