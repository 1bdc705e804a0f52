"""Extraction batches: a chunk's samples as length-sorted, right-padded micro-batches through the tapped target; and
the warm-up that meets every batch shape's kernels before the first chunk."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dflashq.capture import HiddenStateCapture
from dflashq.chunk import Sample, micro_batches

PAD_MULTIPLE = 64
WARMUP_TOKEN_STEP = 512


def extraction_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """How the worker groups a chunk's samples: power-of-two row counts, so batch shapes repeat (dflashq.chunk)."""
    return micro_batches(lengths, batch_tokens, power_of_two_rows=True)


def padded_batches(samples: list[Sample], batch_tokens: int, batching=extraction_batches
                   ) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The worker's micro-batches: (sample indices, input_ids [B, W] right-padded with 0), longest first.
    `batching`: how samples are grouped (benchmarks compare the worker's with others)."""
    lengths = [len(s) for s in samples]
    for batch in batching(lengths, batch_tokens):
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


def warmup_shapes(batch_tokens: int) -> list[tuple[int, int]]:
    """(rows, width) of the batches whose forwards meet every autotuning key the worker's batches can: each power-of-two
    row count (fla's cumsum tunes per row count) and a token total in every 512-token step up to the budget (fla's
    norms tune per block of 2048 or 65,536 rows, where a row is a token, or a token's head: 48 heads on Qwen3.6-27B
    make a block 1,365 tokens)."""
    rows = [1 << k for k in range(max(1, batch_tokens // PAD_MULTIPLE).bit_length())]
    totals = range(WARMUP_TOKEN_STEP, batch_tokens + 1, WARMUP_TOKEN_STEP)
    return [(r, PAD_MULTIPLE) for r in rows] + [(1, t) for t in totals]


def warm_up(model: torch.nn.Module, batch_tokens: int) -> int:
    """Runs `warmup_shapes` through the first decoder layer of each kind (linear and full attention), so kernels compile
    and autotune, or load both from the persisted cache (dflashq.compile_cache), before the first chunk and never
    inside one. Returns the number of shapes run."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"]
    capture = HiddenStateCapture(model, [max(types.index(kind) for kind in set(types))])
    device = next(model.parameters()).device
    shapes = warmup_shapes(batch_tokens)
    try:
        for rows, width in shapes:
            capture.capture(torch.zeros(rows, width, dtype=torch.long, device=device))
    finally:
        capture.close()
    return len(shapes)
