"""Extraction batches: a chunk's samples as length-sorted, right-padded micro-batches through the tapped target."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dflashq.capture import HiddenStateCapture
from dflashq.chunk import Sample, micro_batches

PAD_MULTIPLE = 64


def padded_batches(samples: list[Sample], batch_tokens: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The worker's micro-batches: (sample indices, input_ids [B, W] right-padded with 0), longest first."""
    lengths = [len(s) for s in samples]
    for batch in micro_batches(lengths, batch_tokens):
        # widths rounded up to a multiple of 64: far fewer distinct shapes, so kernels autotune a few times, not per length
        width = -(-lengths[batch[0]] // PAD_MULTIPLE) * PAD_MULTIPLE
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.from_numpy(samples[i].input_ids.astype("int64"))
        yield batch, ids


def extract_samples(
    model: torch.nn.Module, capture: HiddenStateCapture, samples: list[Sample], batch_tokens: int
) -> list[torch.Tensor]:
    """Per sample, in input order: hidden states [T_i, K, H] on the model's device.

    Length-sorted, right-padded micro-batches under a padded-token budget; sequences are never packed into one row
    (linear-attention state would leak across them). No attention mask: in a causal decoder a real token never sees
    the padding after it, and without a mask the full-attention layers take the fused causal kernel (SDPA/flash)
    and the linear-attention layers skip zeroing the padding.
    """
    device = next(model.parameters()).device
    results: list[torch.Tensor | None] = [None] * len(samples)
    for batch, ids in padded_batches(samples, batch_tokens):
        hidden = capture.capture(ids.to(device, non_blocking=True))  # [B, W, K, H]
        for row, i in enumerate(batch):
            results[i] = hidden[row, : len(samples[i])]
    return results
