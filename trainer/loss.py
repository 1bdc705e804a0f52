"""The DFlash loss: decay-weighted cross-entropy of the block slots through the frozen target LM head, computed in
row chunks so that only one chunk's [rows, V] logits is ever alive; plus per-slot accuracy and EAL.

Each slot's label is a distribution over a few tokens: the target's greedy token alone (the reference recipe), or
with train.distill_weight w, (1 - w) on that token plus w spread over the target's own top-k next-token
probabilities (store.target_topk, renormalized over the k), as EAGLE-3-style trainers distil the target's
distribution rather than its argmax alone. One code path: the hard label is the one-column case."""

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


def label_distribution(targets: Tensor, soft: tuple[Tensor, Tensor] | None, distill_weight: float
                       ) -> tuple[Tensor, Tensor]:
    """Each slot's label as (ids [..., m], weights [..., m]) summing to 1: column 0 the greedy token `targets` [...],
    weighted 1 - distill_weight, then `soft` = (ids [..., k], probabilities [..., k]) weighted distill_weight."""
    ids = targets[..., None]  # [..., 1]
    weights = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)  # [..., 1]
    if soft is None or distill_weight == 0:
        return ids, weights
    soft_ids, soft_p = soft
    return (torch.cat([ids, soft_ids.long()], -1),  # [..., 1 + k]
            torch.cat([weights * (1.0 - distill_weight), soft_p.float() * distill_weight], -1))  # [..., 1 + k]


def dflash_loss(
    hidden: Tensor,
    lm_head: Tensor,
    targets: Tensor,
    slot_valid: Tensor,
    gamma: float | None = None,
    chunk_rows: int = defaults.LOSS_CHUNK_ROWS,
    soft: tuple[Tensor, Tensor] | None = None,
    distill_weight: float = 0.0,
) -> DFlashLoss:
    """hidden [b, N, B, H] final drafter states; lm_head [V, H] frozen; targets, slot_valid [b, N, B]
    (trainer.anchors.gather_blocks); soft: the target's top-k (ids, probabilities) [b, N, B, k] for each slot's
    token, used with distill_weight > 0. Loss = sum_valid w_k CE(label) / sum_valid w_k; only valid rows reach the
    head. Accuracy is always against the greedy token: what decoding accepts."""
    block_size = hidden.shape[2]
    weights = decay_weights(block_size, gamma, hidden.device).expand_as(slot_valid)  # [b, N, B]
    slots = torch.arange(block_size, device=hidden.device).expand_as(slot_valid)  # [b, N, B]
    row_weights = weights[slot_valid]  # [R]
    row_scale = row_weights / loss_weight(slot_valid, gamma).clamp_min(torch.finfo(torch.float32).tiny)  # [R]
    label_ids, label_weights = label_distribution(targets, soft, distill_weight)  # [b, N, B, m] x2
    loss, correct_rows = _ChunkedHeadCrossEntropy.apply(
        hidden[slot_valid], lm_head, label_ids[slot_valid], label_weights[slot_valid], row_scale, chunk_rows
    )  # [], [R]
    row_slots = slots[slot_valid]  # [R]
    count = torch.bincount(row_slots, minlength=block_size)[1:]  # [B-1]
    correct = torch.bincount(row_slots, weights=correct_rows.float(), minlength=block_size)[1:]  # [B-1]
    acc = correct / count.clamp_min(1)  # [B-1]
    return DFlashLoss(loss, acc, expected_acceptance_length(acc), correct, count)


def _chunk_terms(logits: Tensor, label_ids: Tensor, label_weights: Tensor, scale: Tensor, need_grad: bool):
    """One chunk's scaled CE sum against the label distributions, top-1 hits against column 0 (the greedy token) and,
    if asked, d loss / d logits = (softmax - label) * scale in the logits' dtype. logits [r, V] (the head's dtype),
    label_ids and label_weights [r, m], scale [r]. Compiled on the GPU in training (trainer.fused): one pass over the
    logits instead of a kernel per line."""
    logits32 = logits.float()  # [r, V]
    lse = logits32.logsumexp(-1)  # [r]
    label_logit = (logits32.gather(1, label_ids) * label_weights).sum(1)  # [r]: the weights sum to 1
    loss = ((lse - label_logit) * scale).sum()  # []
    correct = logits32.argmax(-1) == label_ids[:, 0]  # [r]
    if not need_grad:
        return loss, correct, None
    # built in place in the fp32 buffer: eager code (the CPU) never holds a second [r, V] fp32 tensor
    grad = logits32.sub_(lse[:, None]).exp_()  # [r, V]
    grad.scatter_add_(1, label_ids, -label_weights)  # a token listed twice (greedy and top-k) gets both weights
    grad *= scale[:, None]
    return loss, correct, grad.to(logits.dtype)  # [], [r], [r, V]


def _chunk_sizes(logits: Tensor, label_ids: Tensor, label_weights: Tensor, scale: Tensor, need_grad: bool):
    return [(logits, [0]), (label_ids, [0]), (label_weights, [0]), (scale, [0])]  # the last chunk's rows differ


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_r scale_r * CE(hidden_r @ lm_head.T, label_r) with the gradient w.r.t. hidden computed chunk by chunk
    during the forward: the head is frozen, so this costs two head matmuls (no recomputation in backward) and
    keeps only [R, H] for backward, never [R, V]."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, label_ids: Tensor, label_weights: Tensor, row_scale: Tensor,
                chunk_rows: int):
        if lm_head.requires_grad:
            raise ValueError("the target LM head must be frozen (requires_grad=False): its gradient is not computed")
        need_grad = ctx.needs_input_grad[0]
        weight = lm_head.to(hidden.dtype)  # [V, H]
        terms = fused(_chunk_terms, hidden, need_grad, _chunk_sizes)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)  # []
        correct = torch.empty(label_ids.shape[:1], dtype=torch.bool, device=hidden.device)  # [R]
        grad_hidden = torch.empty_like(hidden) if need_grad else None  # [R, H]
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk_loss, correct[rows], grad_logits = terms(hidden[rows] @ weight.T, label_ids[rows],
                                                           label_weights[rows], row_scale[rows],
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
        return (grad_loss * grad_hidden).to(grad_hidden.dtype), None, None, None, None, None
