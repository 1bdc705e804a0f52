"""The DFlash loss: decay-weighted cross-entropy of the block slots through the frozen target LM head, computed in
row chunks so that only one chunk's [rows, V] logits is ever alive; plus per-slot accuracy and EAL."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashq import defaults
from trainer.fused import fused

if TYPE_CHECKING:
    from trainer.dflash2 import SelectorLoss


def default_gamma(block_size: int) -> float:
    """The decay constant: 7 for B=16 and 4 for B=8 (the published values), linear in B between and beyond."""
    return 1.0 + 3.0 * block_size / 8.0


def decay_weights(block_size: int, gamma: float | None = None, device: torch.device | str | None = None) -> Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1, and 0 for slot 0 (never a loss term): [B] fp32."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32, device=device)  # [B]
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)  # [B]


def expected_acceptance_length(acc: Tensor) -> Tensor:
    """EAL = 1 + sum_k prod_{i<=k} acc_i over the per-slot accuracies acc [B-1] of slots 1..B-1."""
    return 1.0 + acc.cumprod(0).sum()  # []


def loss_weight(slot_valid: Tensor, gamma: float | None = None) -> Tensor:
    """The loss's denominator: the decay weights of the valid slots, summed. slot_valid [b, N, B] -> [] fp32."""
    return (slot_valid * decay_weights(slot_valid.shape[-1], gamma, slot_valid.device)).sum()  # []


@dataclasses.dataclass
class DFlashLoss:
    loss: Tensor  # [] differentiable
    acc: Tensor  # [B-1] top-1 accuracy of slots 1..B-1 (0 where a slot has no valid row)
    eal: Tensor  # [] expected acceptance length from acc
    correct: Tensor  # [B-1] correct valid rows per slot, for aggregating accuracy over steps
    count: Tensor  # [B-1] valid rows per slot
    top_logits: Tensor | None = None  # [R, K] with top_k: the K largest logits of each valid row (fp32)...
    top_ids: Tensor | None = None  # [R, K] ...and their token ids (DFlash2's selector candidates)
    selector: SelectorLoss | None = None  # a DFlash2 drafter's selector loss (trainer.step.backward)


def dflash_loss(
    hidden: Tensor,
    lm_head: Tensor,
    targets: Tensor,
    slot_valid: Tensor,
    gamma: float | None = None,
    chunk_rows: int = defaults.LOSS_CHUNK_ROWS,
    top_k: int = 0,
) -> DFlashLoss:
    """hidden [b, N, B, H] final drafter states; lm_head [V, H] frozen; targets, slot_valid [b, N, B]
    (trainer.anchors.gather_blocks). Loss = sum_valid w_k CE / sum_valid w_k; only valid rows reach the head, in
    the order of hidden[slot_valid]. top_k > 0 also keeps each row's top-k logits (from the same head products)."""
    block_size = hidden.shape[2]
    weights = decay_weights(block_size, gamma, hidden.device).expand_as(slot_valid)  # [b, N, B]
    slots = torch.arange(block_size, device=hidden.device).expand_as(slot_valid)  # [b, N, B]
    row_weights = weights[slot_valid]  # [R]
    row_scale = row_weights / loss_weight(slot_valid, gamma).clamp_min(torch.finfo(torch.float32).tiny)  # [R]
    loss, correct_rows, top_logits, top_ids = _ChunkedHeadCrossEntropy.apply(
        hidden[slot_valid], lm_head, targets[slot_valid], row_scale, chunk_rows, top_k
    )  # [], [R], [R, K], [R, K]
    row_slots = slots[slot_valid]  # [R]
    count = torch.bincount(row_slots, minlength=block_size)[1:]  # [B-1]
    correct = torch.bincount(row_slots, weights=correct_rows.float(), minlength=block_size)[1:]  # [B-1]
    acc = correct / count.clamp_min(1)  # [B-1]
    return DFlashLoss(loss, acc, expected_acceptance_length(acc), correct, count,
                      top_logits if top_k else None, top_ids if top_k else None)


def _chunk_terms(logits: Tensor, targets: Tensor, scale: Tensor, need_grad: bool, top_k: int = 0):
    """One chunk's scaled CE sum, top-1 hits, its top_k logits and ids (empty for 0) and, if asked, d loss / d logits
    = (softmax - onehot) * scale in the logits' dtype. logits [r, V] (the head's dtype), targets and scale [r].
    Compiled on the GPU in training (trainer.fused): one pass over the logits instead of a kernel per line."""
    logits32 = logits.float()  # [r, V]
    lse = logits32.logsumexp(-1)  # [r]
    target_logit = logits32.gather(1, targets[:, None])[:, 0]  # [r]
    loss = ((lse - target_logit) * scale).sum()  # []
    correct = logits32.argmax(-1) == targets  # [r]
    top = logits32.topk(top_k, dim=-1)  # [r, K] x2
    if not need_grad:
        return loss, correct, top, None
    # built in place in the fp32 buffer: eager code (the CPU) never holds a second [r, V] fp32 tensor
    grad = logits32.sub_(lse[:, None]).exp_()  # [r, V]
    grad[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    grad *= scale[:, None]
    return loss, correct, top, grad.to(logits.dtype)  # [], [r], [r, K] x2, [r, V]


def _chunk_sizes(logits: Tensor, targets: Tensor, scale: Tensor, need_grad: bool, top_k: int = 0):
    return [(logits, [0]), (targets, [0]), (scale, [0])]  # the last chunk's rows differ


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_r scale_r * CE(hidden_r @ lm_head.T, target_r) with the gradient w.r.t. hidden computed chunk by chunk
    during the forward: the head is frozen, so this costs two head matmuls (no recomputation in backward) and
    keeps only [R, H] for backward, never [R, V]."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, targets: Tensor, row_scale: Tensor, chunk_rows: int,
                top_k: int):
        if lm_head.requires_grad:
            raise ValueError("the target LM head must be frozen (requires_grad=False): its gradient is not computed")
        need_grad = ctx.needs_input_grad[0]
        weight = lm_head.to(hidden.dtype)  # [V, H]
        terms = fused(_chunk_terms, hidden, need_grad, _chunk_sizes)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)  # []
        correct = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)  # [R]
        top_logits = torch.empty(targets.shape[0], top_k, dtype=torch.float32, device=hidden.device)  # [R, K]
        top_ids = torch.empty(targets.shape[0], top_k, dtype=torch.long, device=hidden.device)  # [R, K]
        grad_hidden = torch.empty_like(hidden) if need_grad else None  # [R, H]
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk_loss, correct[rows], (top_logits[rows], top_ids[rows]), grad_logits = terms(
                hidden[rows] @ weight.T, targets[rows], row_scale[rows], need_grad, top_k)  # [], [r], [r, K] x2, [r, V]
            loss += chunk_loss
            if need_grad:
                grad_hidden[rows] = grad_logits @ weight  # [r, H]
        ctx.mark_non_differentiable(correct, top_logits, top_ids)
        ctx.save_for_backward(grad_hidden)
        return loss, correct, top_logits, top_ids

    @staticmethod
    def backward(ctx, grad_loss: Tensor, *grad_rest):
        (grad_hidden,) = ctx.saved_tensors  # [R, H]
        return (grad_loss * grad_hidden).to(grad_hidden.dtype), None, None, None, None, None
