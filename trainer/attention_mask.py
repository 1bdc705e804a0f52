"""The DFlash training attention rule, defined once and used three times: as a flex_attention `mask_mod`, as the
tile map of flex's BlockMask (each query's keys are two intervals), and, evaluated on index grids, as the boolean
masks of the SDPA path's groups of blocks.

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
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def dflash_mask_mod(anchors: Tensor, block_size: int, context_len: int, window: int | None) -> MaskMod:
    """The rule for anchors [batch, N] (long) over T = context_len context keys; window None = full attention."""

    # The lengths that change with every batch are read from a tensor: a Python int here would be a constant of
    # the compiled flex kernel, and every new context length a new compilation.
    context_len, last_block = torch.tensor([context_len, anchors.shape[1] - 1], device=anchors.device)  # [] x2

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Compiled flex_attention evaluates the rule over whole 128-row tiles: with N*B not a multiple of 128,
        # q_idx runs past the last slot, and an unclamped read goes past `anchors` (pytorch issue 137801).
        # Those rows are discarded; the clamp only keeps the read in bounds.
        block = torch.minimum(q_idx // block_size, last_block)
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


def flex_block_mask(mask_mod: MaskMod, anchors: Tensor, block_size: int, context_len: int, window: int | None,
                    tile: int = 128) -> BlockMask:
    """flex_attention's BlockMask of the rule, built from the rule's shape instead of a dense Q x (T+Q) evaluation:
    query slot (j, k) may see exactly two key intervals, the context [lo, a_j) (lo = 0, or a_j + k - window + 1 in
    sliding layers) and its own block's slots [k - window + 1 or 0, k or B-1] past T. A tile is full when every row
    sees all of its keys, partial when some row sees some; tiles cut short by the lengths are never full, as in
    create_block_mask. Why: create_block_mask must be compiled to be fast, and each compilation took minutes over
    a run's changing shapes; this is a few eager tensor operations on [batch, Q, tiles]."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    q_len = num_blocks * block_size
    q_tiles, kv_tiles = -(-q_len // tile), -(-(context_len + q_len) // tile)
    slot = torch.arange(q_tiles * tile, device=device)  # [Qt] slots padded to whole tiles
    real = slot < q_len  # [Qt] padded rows see nothing
    block, offset = slot.clamp(max=q_len - 1) // block_size, slot % block_size  # [Qt] x2
    anchor = anchors[:, block]  # [batch, Qt]
    ctx_hi = anchor.clamp(max=context_len) - 1  # [batch, Qt] last context key seen
    own_lo = context_len + block * block_size  # [Qt] first key of the row's own block
    own_hi = own_lo + block_size - 1  # [Qt]
    ctx_lo = torch.zeros_like(anchor)  # [batch, Qt]
    if window is not None:
        ctx_lo = (anchor + offset - window + 1).clamp(min=0)  # [batch, Qt]
        own_lo, own_hi = own_lo + (offset - window + 1).clamp(min=0), own_lo + offset  # [Qt] x2
    ctx_hi = torch.where(real, ctx_hi, -1)  # [batch, Qt]
    own_hi = torch.where(real, own_hi, -1)  # [Qt]
    first = torch.arange(kv_tiles, device=device) * tile  # [Kt] first key of each key tile
    last = first + tile - 1  # [Kt]

    def overlap(lo: Tensor, hi: Tensor) -> Tensor:  # keys of each tile inside [lo, hi]: [..., Qt, Kt]
        return (torch.minimum(hi[..., None], last) - torch.maximum(lo[..., None], first) + 1).clamp(min=0)

    seen = (overlap(ctx_lo, ctx_hi) + overlap(own_lo, own_hi)).view(batch, q_tiles, tile, kv_tiles)  # [b, nQ, t, Kt]
    full = (seen == tile).all(2)  # [batch, nQ, Kt]
    partial = (seen > 0).any(2) & ~full  # [batch, nQ, Kt]

    def ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:  # counts [b, 1, nQ] and tile indices [b, 1, nQ, Kt], seen first
        counts = tiles.sum(-1, dtype=torch.int32)[:, None]
        order = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, order[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, context_len + q_len))


def with_lengths(mask: BlockMask, q_len: int, kv_len: int) -> BlockMask:
    """The same tiles and rule for a query and key length computed where it is used: inside a compiled region, from
    the sizes of the tensors passed to it, so that the key length is symbolic wherever the context length is."""
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=mask.kv_num_blocks, kv_indices=mask.kv_indices,
                     full_kv_num_blocks=mask.full_kv_num_blocks, full_kv_indices=mask.full_kv_indices,
                     q_num_blocks=mask.q_num_blocks, q_indices=mask.q_indices, full_q_num_blocks=mask.full_q_num_blocks,
                     full_q_indices=mask.full_q_indices, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod)
