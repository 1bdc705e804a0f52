"""DFlash2's two additions to the DFlash drafter, computed as the z-lab reference computes them (`dflash` 0.1.0,
dflash/model.py: GroupedDynamicCausalConv, CandidateSelector), and the selector's training objective (docs/dflash2.md).

GroupedDynamicCausalConv wraps a sublayer (attention, MLP) of every drafter layer: a causal depthwise convolution
along the slots of each block before the sublayer and another after it, each tap a learned per-channel weight plus a
per-group weight predicted from the sublayer's input. The taps never reach across a block's start (zeros there):
the reference drafts one block at a time, and training's blocks are side by side in one sequence of slots.
CandidateSelector turns the block's independent argmaxes into one chain: at each slot it keeps the top-K tokens of
the drafter's logits and picks the one scoring best after the previous slot's pick (the anchor token before slot 1),
S(a, c) = U(c) + <A[a] * P h, B[c]>, with U the logits, A / B the predecessor / successor codebooks, P h the slot's
projected hidden state.

Shapes: b rows, N blocks per row, B block size, Q = N*B slots, H hidden size, G = H/g channel groups of g channels,
k kernel taps, S draft slots (B-1), V vocabulary, K candidates, r selector rank, R training rows (valid slots).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [before/after, k, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)  # [2*k*G, H]

    def init_weights(self) -> None:
        # the identity (tap 0 passes each channel through, nothing predicted): a fresh DFlash2 drafter computes what
        # a DFlash drafter of its other weights does, and the convolutions learn only what helps
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor], block_size: int) -> Tensor:
        """sublayer(x) wrapped: x [b, Q, H] -> [b, Q, H]; both kernels are predicted from x."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)  # [b, Q, 2, k, G]
        before = grouped_dynamic_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_size)
        return grouped_dynamic_convolve(sublayer(before), dynamic[..., 1, :, :], self.base_kernel[1], self.group_size,
                                        block_size)  # [b, Q, H]


def grouped_dynamic_convolve(x: Tensor, dynamic: Tensor, base: Tensor, group_size: int, block_size: int) -> Tensor:
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // g]) * x[t - o, c] within each block (x = 0 before its slot 0).

    x [b, Q, H], dynamic [b, Q, k, G], base [k, H] -> [b, Q, H]; the two products are added one after the other, in
    the reference's order."""
    b, q_len, hidden = x.shape
    groups = hidden // group_size
    blocks = x.view(b, q_len // block_size, block_size, groups, group_size)  # [b, N, B, G, g]
    dynamic = dynamic.reshape(b, q_len // block_size, block_size, -1, groups, 1)  # [b, N, B, k, G, 1]
    out = torch.zeros_like(blocks)  # [b, N, B, G, g]
    for offset in range(min(base.shape[0], block_size)):  # a tap past the block's start sees only zeros
        shifted = blocks if offset == 0 else F.pad(blocks[:, :, :-offset], (0, 0, 0, 0, offset, 0))  # [b, N, B, G, g]
        out = out + base[offset].view(groups, group_size).to(x.dtype) * shifted
        out = torch.addcmul(out, dynamic[:, :, :, offset], shifted)
    return out.view_as(x)  # [b, Q, H]


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)  # A [V, r]
        self.successor_codebook = nn.Embedding(vocab_size, rank)  # B [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # P [r, H]

    def init_weights(self) -> None:
        # B = 0: every pair term is 0, so a fresh selector picks each slot's argmax (the DFlash drafts), and A and P,
        # whose gradients wait for B, start from their random init
        with torch.no_grad():
            self.successor_codebook.weight.zero_()

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessor: Tensor) -> Tensor:
        """S(a, c) for each candidate c after predecessor a: hidden [..., H], unary and candidates [..., K] (logits
        and token ids), predecessor [...] -> [..., K]."""
        query = self.predecessor_codebook(predecessor) * self.hidden_projection(hidden)  # [..., r]
        return unary + torch.einsum("...r,...kr->...k", query, self.successor_codebook(candidates))  # [..., K]

    def chain(self, hidden: Tensor, logits: Tensor, anchor: Tensor) -> Tensor:
        """Greedy drafts: slot by slot the best-scoring candidate after the previous pick. hidden [b, S, H], logits
        [b, S, V] of slots 1..S, anchor [b] the block's committed first token -> tokens [b, S]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)  # [b, S, K] x2
        picked, predecessor = [], anchor  # [b]
        for slot in range(hidden.shape[1]):
            scores = self.scores(hidden[:, slot], unary[:, slot], candidates[:, slot], predecessor)  # [b, K]
            predecessor = candidates[:, slot].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]  # [b]
            picked.append(predecessor)
        return torch.stack(picked, dim=1)  # [b, S]


@dataclasses.dataclass
class SelectorLoss:
    loss: Tensor  # [] differentiable in the selector's weights only
    correct: Tensor  # [B-1] valid rows per slot where the selector, given the true predecessor, picks the true token
    reachable: Tensor  # [B-1] valid rows per slot whose true token is among the K candidates


def selector_loss(selector: CandidateSelector, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessor: Tensor,
                  target: Tensor, weight: Tensor, slot: Tensor, block_size: int) -> SelectorLoss:
    """Teacher-forced K-way cross-entropy of the selector (docs/dflash2.md): at every valid slot, among the drafter's
    top-K candidates, the target's token after the true previous token. Rows whose target token is not a candidate
    are left out: no pick can be accepted there, so no pick is better. The backbone gets no gradient from it (hidden
    states and logits enter detached); it keeps DFlash's loss.

    hidden [R, H] final drafter states of the valid slots, unary / candidates [R, K] their top-K logits and ids,
    predecessor / target [R] the true token before and at each slot, weight [R] DFlash's decay weight of the slot,
    slot [R] its index in the block."""
    scores = selector.scores(hidden.detach().float(), unary.detach().float(), candidates, predecessor)  # [R, K]
    is_target = candidates == target[:, None]  # [R, K]
    reachable = is_target.any(-1)  # [R]
    cross_entropy = scores.logsumexp(-1) - scores.masked_fill(~is_target, 0.0).sum(-1)  # [R] (any value unreachable)
    row_weight = weight * reachable  # [R]
    loss = (cross_entropy * row_weight).sum() / row_weight.sum().clamp_min(torch.finfo(torch.float32).tiny)  # []
    correct = reachable & is_target.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]  # [R]
    return SelectorLoss(loss, _per_slot(correct, slot, block_size), _per_slot(reachable, slot, block_size))


def _per_slot(rows: Tensor, slot: Tensor, block_size: int) -> Tensor:
    return torch.bincount(slot, weights=rows.float(), minlength=block_size)[1:]  # [B-1]
