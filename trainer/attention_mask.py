"""The DFlash training attention rule, defined once and used twice: as a flex_attention `mask_mod` and, evaluated
on index grids, as the boolean masks of the SDPA path's groups of blocks.

Layout of one sequence's attention: queries are the N*B block slots (block j, offset k = q // B, q % B); keys are
the T context positions followed by the same N*B block slots. Query (j, k) sits at position a_j + k and sees
  - context position c iff c < a_j (strictly: at inference the target has not processed the anchor yet),
  - block slots of its own block only (blocks are blind to each other),
and in sliding layers additionally only keys at positions p with p <= a_j + k and a_j + k - p < window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def dflash_mask_mod(anchors: Tensor, block_size: int, context_len: int, window: int | None) -> MaskMod:
    """The rule for anchors [batch, N] (long) over T = context_len context keys; window None = full attention."""

    last_block = anchors.shape[1] - 1

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Compiled flex_attention evaluates the rule over whole 128-row tiles: with N*B not a multiple of 128,
        # q_idx runs past the last slot, and an unclamped read goes past `anchors` (pytorch issue 137801).
        # Those rows are discarded; the clamp only keeps the read in bounds.
        block = (q_idx // block_size).clamp(max=last_block)
        anchor = anchors[b, block]
        q_pos = anchor + q_idx % block_size
        is_context = kv_idx < context_len
        kv_slot = kv_idx - context_len  # block slot of a block key; meaningless for context keys
        sees_context = is_context & (kv_idx < anchor)
        sees_own_block = ~is_context & (kv_slot // block_size == block)
        allowed = sees_context | sees_own_block
        if window is not None:
            kv_pos = torch.where(is_context, kv_idx, anchor + kv_slot % block_size)
            allowed = allowed & (kv_pos <= q_pos) & (q_pos - kv_pos < window)
        return allowed

    return mask_mod


@dataclasses.dataclass
class DenseGroup:
    """Consecutive blocks attended by one SDPA call: their query slots, the context prefix [0, context) that holds
    every context key any of them may see (their largest anchor), and, after it, their own block slots' keys."""
    queries: slice
    context: int
    mask: Tensor  # [batch, 1, Qg, context + Qg] True = may attend


def dense_groups(mask_mod: MaskMod, anchors: Tensor, block_size: int, context_len: int,
                 group_blocks: int) -> list[DenseGroup]:
    """The rule over groups of `group_blocks` consecutive blocks. One dense mask over all N*B queries and T + N*B keys
    would compute N*B x N*B block-to-block scores of which only B x B per block are ever seen, and every context key
    for blocks anchored early; grouping leaves both out (about 4x fewer scores at 512 anchors of 16 over 4096
    tokens) with the same result, since every key a query may see stays in its group."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    largest = anchors.amax(0).tolist()  # [N] one device sync for all groups
    b = torch.arange(batch, device=device)[:, None, None]  # [batch, 1, 1]
    h = torch.zeros((), dtype=torch.long, device=device)  # []
    groups = []
    for first in range(0, num_blocks, group_blocks):
        last = min(first + group_blocks, num_blocks)
        context = max(largest[first:last])  # anchors are sorted: keys at or past every anchor are never seen
        queries = slice(first * block_size, last * block_size)
        q = torch.arange(queries.start, queries.stop, device=device)  # [Qg]
        kv = torch.cat([torch.arange(context, device=device), context_len + q])  # [context + Qg]
        mask = mask_mod(b, h, q[None, :, None], kv[None, None, :])  # [batch, Qg, context + Qg]
        groups.append(DenseGroup(queries, context, mask.expand(batch, len(q), len(kv))[:, None]))
    return groups
