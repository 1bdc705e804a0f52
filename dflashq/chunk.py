"""Chunk: one RQ job = several tokenized, loss-masked samples packed up to a token budget (one GPU batch).

A chunk never carries raw text. Token ids travel as base64 little-endian int32 and loss masks as base64 uint8,
inside the JSON job arguments (RQ's JSON serializer), which is about 4x smaller and 10x faster than int lists.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from dflashq.exceptions import JobRefused


@dataclasses.dataclass
class Sample:
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8, 1 on tokens the drafter learns (assistant turns)
    index: int = -1  # position of the sample in the dataset, for reports

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def chunk_id(run: str, data_fingerprint: str, epoch: int, first: int, last: int) -> str:
    """Deterministic job id: the same data, epoch and sample range always name the same chunk (and blob)."""
    return f"{run}-e{epoch}-{data_fingerprint[:12]}-{first:09d}-{last:09d}"


def sample_range(chunk: str) -> tuple[int, int]:
    """The first and last sample index a chunk_id names."""
    first, last = chunk.rsplit("-", 2)[1:]
    return int(first), int(last)


@dataclasses.dataclass
class Chunk:
    id: str
    epoch: int
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "epoch": self.epoch,
            "samples": [
                {
                    "index": s.index,
                    "input_ids": base64.b64encode(np.ascontiguousarray(s.input_ids, dtype="<i4").tobytes()).decode(),
                    "loss_mask": base64.b64encode(np.ascontiguousarray(s.loss_mask, dtype=np.uint8).tobytes()).decode(),
                }
                for s in self.samples
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> "Chunk":
        try:
            samples = []
            for s in data["samples"]:
                ids = np.frombuffer(base64.b64decode(s["input_ids"]), dtype="<i4").astype(np.int32)
                mask = np.frombuffer(base64.b64decode(s["loss_mask"]), dtype=np.uint8).copy()
                if ids.shape != mask.shape:
                    raise ValueError("input_ids and loss_mask lengths differ")
                samples.append(Sample(ids, mask, int(s.get("index", -1))))
            return cls(str(data["id"]), int(data["epoch"]), samples)
        except (KeyError, TypeError, ValueError) as exc:
            raise JobRefused(f"malformed chunk payload: {exc}") from None


def pack(samples: Iterable[Sample], chunk_tokens: int, sort_window: int = 1) -> Iterator[list[Sample]]:
    """Greedy packing into groups of at most `chunk_tokens` tokens (deterministic). With sort_window > 1, each run
    of `sort_window` consecutive samples is first sorted by length, longest first, so a chunk holds samples of
    similar length and its right-padded micro-batches waste little compute on padding."""
    current: list[Sample] = []
    size = 0
    for window in _windows(samples, sort_window):
        for sample in sorted(window, key=len, reverse=True) if sort_window > 1 else window:
            if current and size + len(sample) > chunk_tokens:
                yield current
                current, size = [], 0
            current.append(sample)
            size += len(sample)
    if current:
        yield current


def _windows(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    window: list[Sample] = []
    for sample in samples:
        window.append(sample)
        if len(window) >= size:
            yield window
            window = []
    if window:
        yield window


def padding_fraction(groups: Iterable[list[Sample]], batch_tokens: int, pad_multiple: int = 1,
                     power_of_two_rows: bool = False) -> float:
    """Share of the computed (padded) tokens that are padding, for chunks batched by `micro_batches` (the workers
    batch with power_of_two_rows and pad_multiple 64: workers/capture.py)."""
    real = padded = 0
    for group in groups:
        lengths = [len(s) for s in group]
        for batch in micro_batches(lengths, batch_tokens, power_of_two_rows):
            padded += len(batch) * -(-lengths[batch[0]] // pad_multiple) * pad_multiple
            real += sum(lengths[i] for i in batch)
    return 1 - real / padded if padded else 0.0


def micro_batches(lengths: list[int], batch_tokens: int, power_of_two_rows: bool = False) -> list[list[int]]:
    """Sample indices, longest first, grouped so that rows x longest row <= batch_tokens (longer: a batch alone).

    `power_of_two_rows`: every batch has 1, 2, 4, ... rows (the most that fit, a chunk's tail split the binary way),
    so batch shapes repeat across chunks: fla's kernels autotune per row count, and a handful of row counts is tuned
    once per host (and persisted, dflashq.compile_cache) instead of again inside every chunk with a new count. It
    adds no padding rows: each smaller batch is padded to its own longest sample.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        longest = lengths[order[start]]
        rows = max(1, min(len(order) - start, batch_tokens // longest if longest else len(order)))
        if power_of_two_rows:
            rows = 1 << (rows.bit_length() - 1)  # the largest power of two <= rows
        batches.append(order[start:start + rows])
        start += rows
    return batches
