"""The DFlash loss: decay-weighted cross-entropy of the block slots through the frozen target LM head, computed in
row chunks so that only one chunk's [rows, V] logits is ever alive; plus per-slot accuracy and EAL."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dflashq import defaults
from trainer.fused import fused


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


def dflash_loss(
    hidden: Tensor,
    lm_head: Tensor,
    targets: Tensor,
    slot_valid: Tensor,
    gamma: float | None = None,
    chunk_rows: int = defaults.LOSS_CHUNK_ROWS,
) -> DFlashLoss:
    """hidden [b, N, B, H] final drafter states; lm_head [V, H] frozen; targets, slot_valid [b, N, B]
    (trainer.anchors.gather_blocks). Loss = sum_valid w_k CE / sum_valid w_k; only valid rows reach the head."""
    block_size = hidden.shape[2]
    weights = decay_weights(block_size, gamma, hidden.device).expand_as(slot_valid)  # [b, N, B]
    slots = torch.arange(block_size, device=hidden.device).expand_as(slot_valid)  # [b, N, B]
    row_weights = weights[slot_valid]  # [R]
    row_scale = row_weights / loss_weight(slot_valid, gamma).clamp_min(torch.finfo(torch.float32).tiny)  # [R]
    loss, correct_rows = _ChunkedHeadCrossEntropy.apply(
        hidden[slot_valid], lm_head, targets[slot_valid], row_scale, chunk_rows
    )  # [], [R]
    row_slots = slots[slot_valid]  # [R]
    count = torch.bincount(row_slots, minlength=block_size)[1:]  # [B-1]
    correct = torch.bincount(row_slots, weights=correct_rows.float(), minlength=block_size)[1:]  # [B-1]
    acc = correct / count.clamp_min(1)  # [B-1]
    return DFlashLoss(loss, acc, expected_acceptance_length(acc), correct, count)


def _chunk_terms(logits: Tensor, targets: Tensor, scale: Tensor, need_grad: bool):
    """One chunk's scaled CE sum, top-1 hits and, if asked, d loss / d logits = (softmax - onehot) * scale in the
    logits' dtype. logits [r, V] (the head's dtype), targets and scale [r]. Compiled on the GPU in training
    (trainer.fused): one pass over the logits instead of a kernel per line."""
    logits32 = logits.float()  # [r, V]
    lse = logits32.logsumexp(-1)  # [r]
    target_logit = logits32.gather(1, targets[:, None])[:, 0]  # [r]
    loss = ((lse - target_logit) * scale).sum()  # []
    correct = logits32.argmax(-1) == targets  # [r]
    if not need_grad:
        return loss, correct, None
    # built in place in the fp32 buffer: eager code (the CPU) never holds a second [r, V] fp32 tensor
    grad = logits32.sub_(lse[:, None]).exp_()  # [r, V]
    grad[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    grad *= scale[:, None]
    return loss, correct, grad.to(logits.dtype)  # [], [r], [r, V]


def _chunk_sizes(logits: Tensor, targets: Tensor, scale: Tensor, need_grad: bool):
    return [(logits, [0]), (targets, [0]), (scale, [0])]  # the last chunk's rows differ


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_r scale_r * CE(hidden_r @ lm_head.T, target_r) with the gradient w.r.t. hidden computed chunk by chunk
    during the forward: the head is frozen, so this costs two head matmuls (no recomputation in backward) and
    keeps only [R, H] for backward, never [R, V]."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, targets: Tensor, row_scale: Tensor, chunk_rows: int):
        if lm_head.requires_grad:
            raise ValueError("the target LM head must be frozen (requires_grad=False): its gradient is not computed")
        need_grad = ctx.needs_input_grad[0]
        weight = lm_head.to(hidden.dtype)  # [V, H]
        terms = fused(_chunk_terms, hidden, need_grad, _chunk_sizes)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)  # []
        correct = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)  # [R]
        grad_hidden = torch.empty_like(hidden) if need_grad else None  # [R, H]
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk_loss, correct[rows], grad_logits = terms(hidden[rows] @ weight.T, targets[rows], row_scale[rows],
                                                           need_grad)  # [], [r], [r, V] or None
            loss += chunk_loss
            if need_grad:
                grad_hidden[rows] = grad_logits @ weight  # [r, H]
        ctx.mark_non_differentiable(correct)
        ctx.save_for_backward(grad_hidden)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_correct: Tensor):
        (grad_hidden,) = ctx.saved_tensors  # [R, H]
        return (grad_loss * grad_hidden).to(grad_hidden.dtype), None, None, None, None
