"""The DFlash training attention rule, defined once and used twice: as a flex_attention `mask_mod` and, evaluated
on index grids, as the dense boolean mask of the SDPA path.

Layout of one sequence's attention: queries are the N*B block slots (block j, offset k = q // B, q % B); keys are
the T context positions followed by the same N*B block slots. Query (j, k) sits at position a_j + k and sees
  - context position c iff c < a_j (strictly: at inference the target has not processed the anchor yet),
  - block slots of its own block only (blocks are blind to each other),
and in sliding layers additionally only keys at positions p with p <= a_j + k and a_j + k - p < window.
"""

from __future__ import annotations

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


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """The rule as a boolean SDPA mask [batch, 1, q_len, kv_len] (True = may attend), shared by all heads."""
    b = torch.arange(batch, device=device)[:, None, None]  # [batch, 1, 1]
    q = torch.arange(q_len, device=device)[None, :, None]  # [1, q_len, 1]
    kv = torch.arange(kv_len, device=device)[None, None, :]  # [1, 1, kv_len]
    h = torch.zeros((), dtype=torch.long, device=device)  # []
    return mask_mod(b, h, q, kv).expand(batch, q_len, kv_len)[:, None]  # [batch, 1, q_len, kv_len]
