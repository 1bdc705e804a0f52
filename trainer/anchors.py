"""Training blocks: sample anchors in each sequence and gather the block inputs, targets and valid slots."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def chunk_generator(seed: int, epoch: int, chunk: str, device: torch.device | str) -> torch.Generator:
    """The anchor draws of one chunk in one epoch, seeded from (train.seed, epoch, chunk id) alone: the same
    whichever rank trains the chunk, in whichever step, after however many restarts."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)  # a non-negative int64


def sample_anchors(
    loss_mask: Tensor, num_anchors: int, generator: torch.Generator | None = None, exact: bool = False
) -> tuple[Tensor, Tensor]:
    """Up to `num_anchors` anchors per sequence, drawn uniformly without replacement among positions p with
    loss_mask[p] and loss_mask[p + 1] both set, sorted ascending, padded at the end with invalid anchors at 0.

    loss_mask [batch, T] (right-padded with zeros); `generator` must live on loss_mask's device.
    Returns anchors [batch, N] long and valid [batch, N] bool, N = min(num_anchors, most candidates in a row), >= 1;
    with `exact`, N = num_anchors whatever the rows hold (the valid anchors are the same draws either way). Compiled
    flex training asks for it: a query length (N x block) that changes with the micro-batch recompiled the layer
    until Dynamo's limit, then ran it eager, or symbolic at about half the kernel's speed.
    """
    supervised = loss_mask.bool()  # [batch, T]
    candidate = torch.zeros_like(supervised)  # [batch, T]
    candidate[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    n = num_anchors if exact else max(1, min(num_anchors, int(candidate.sum(1).max())))
    # The n smallest of iid uniform keys form a uniform random subset; non-candidates get keys above any uniform.
    keys = torch.rand(candidate.shape, generator=generator, device=loss_mask.device)  # [batch, T]
    keys = keys.masked_fill(~candidate, 2.0)  # [batch, T]
    if n > keys.shape[1]:  # rows shorter than the anchor count: the extra columns can only be invalid
        keys = torch.nn.functional.pad(keys, (0, n - keys.shape[1]), value=2.0)  # [batch, n]
    chosen_keys, positions = keys.topk(n, dim=1, largest=False)  # [batch, N], [batch, N]
    valid = chosen_keys < 2.0  # [batch, N]
    # Sorting with invalid ones pushed past every real position keeps valid anchors first and ascending.
    order_key = positions.masked_fill(~valid, keys.shape[1])  # [batch, N]
    order_key, order = order_key.sort(dim=1)  # [batch, N], [batch, N]
    valid = valid.gather(1, order)  # [batch, N]
    anchors = order_key.masked_fill(~valid, 0)  # [batch, N]
    return anchors, valid


def gather_blocks(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, block_size: int, mask_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Block j = [x[a_j], MASK x (B-1)]; slot k >= 1 is trained to predict x[a_j + k].

    input_ids, loss_mask [batch, T]; anchors, valid [batch, N].
    Returns block_ids [batch, N, B], targets [batch, N, B] and slot_valid [batch, N, B] (block valid, k >= 1,
    a_j + k < T and loss_mask[a_j + k]; right padding carries loss_mask 0, so shorter rows need no lengths).
    """
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)  # [B]
    positions = anchors[:, :, None] + offsets  # [batch, N, B]
    in_range = positions < seq_len  # [batch, N, B]
    flat = positions.clamp(max=seq_len - 1).flatten(1)  # [batch, N*B]
    targets = input_ids.gather(1, flat).view_as(positions)  # [batch, N, B]
    supervised = loss_mask.bool().gather(1, flat).view_as(positions)  # [batch, N, B]
    slot_valid = valid[:, :, None] & in_range & supervised & (offsets >= 1)  # [batch, N, B]
    block_ids = torch.full_like(targets, mask_token_id)  # [batch, N, B]
    block_ids[:, :, 0] = targets[:, :, 0]
    return block_ids, targets, slot_valid
