"""One optimisation step of the drafter, shared by the trainer daemon and the benchmark: `backward` per
(micro-)batch, then `optimizer_step`.

fp32 master weights (the drafter's parameters stay fp32 and AdamW updates them in fp32) with bf16 compute under
autocast on the GPU; on the CPU everything runs in fp32. Warm-up then cosine decay, gradient clipping.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from dflashq import defaults
from trainer.anchors import gather_blocks, sample_anchors
from trainer.drafter import Attention, DFlashDrafter, DrafterConfig, uses_flex
from trainer.loss import DFlashLoss, decay_weights, dflash_loss, loss_weight
from trainer.target_head import TargetHead


@dataclasses.dataclass
class Batch:
    context: Tensor  # [b, T, K*H] tapped target states, right-padded
    input_ids: Tensor  # [b, T] long
    loss_mask: Tensor  # [b, T] uint8 (0 on padding)

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.shape[0] * self.loss_mask.shape[1])


def collate(samples: list[tuple[Tensor, Tensor, Tensor]], device: torch.device | str) -> Batch:
    """Per-sample (hidden [T, K, H], input_ids [T], loss_mask [T]) -> one right-padded batch on `device`."""
    length = max(int(ids.shape[0]) for _, ids, _ in samples)
    b = len(samples)
    k, h = samples[0][0].shape[1:]
    context = torch.zeros(b, length, k * h, dtype=samples[0][0].dtype, device=samples[0][0].device)  # [b, T, K*H]
    ids = torch.zeros(b, length, dtype=torch.long)  # [b, T]
    mask = torch.zeros(b, length, dtype=torch.uint8)  # [b, T]
    for row, (hidden, sample_ids, sample_mask) in enumerate(samples):
        n = hidden.shape[0]
        context[row, :n] = hidden.reshape(n, k * h)
        ids[row, :n] = sample_ids.long()
        mask[row, :n] = sample_mask
    return Batch(context.to(device, non_blocking=True), ids.to(device), mask.to(device))


class WarmupCosine:
    """Learning-rate factor: linear warm-up over `warmup_ratio` of the horizon, then cosine decay to zero. The
    horizon `total` may change while training runs (the trainer follows the producer's running estimate of an
    epoch's size where the input's record count is known, and its count once it has seen the whole dataset);
    LambdaLR calls this object every step, so the new horizon applies at once. Until there is one (`total` None:
    gzipped or JSON input not yet read to the end) the factor warms up over defaults.UNKNOWN_HORIZON_WARMUP_STEPS and
    holds the peak: a guessed horizon would decay the rate to zero while the producer is still reading a large
    dataset."""

    def __init__(self, warmup_ratio: float, total: int | None):
        self.warmup_ratio = warmup_ratio
        self.total = None if total is None else max(1, total)

    def __call__(self, step: int) -> float:
        if self.total is None:
            return min(1.0, (step + 1) / defaults.UNKNOWN_HORIZON_WARMUP_STEPS)
        warmup = max(1, int(self.warmup_ratio * self.total))
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def empty_batch(config: DrafterConfig, device: torch.device | str) -> Batch:
    """A sequence without a supervised token: zero loss and zero gradient, yet a forward and backward through
    every parameter (what a rank without a chunk trains, so that the gradient collectives run on every rank)."""
    length = config.block_size
    return Batch(torch.zeros(1, length, config.num_tapped * config.hidden_size, device=device),  # [1, T, K*H]
                 torch.zeros(1, length, dtype=torch.long, device=device),  # [1, T]
                 torch.zeros(1, length, dtype=torch.uint8, device=device))  # [1, T]


def build_optimizer(parameters, lr: float, weight_decay: float, schedule: WarmupCosine):
    """AdamW over the drafter's (fp32) parameters, and its LambdaLR scheduler following `schedule`. On the GPU the
    fused AdamW: one kernel per step instead of a dozen multi-tensor passes, which a small drafter's step, bound by
    launching kernels, waits for."""
    parameters = list(parameters)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                  fused=all(p.is_cuda for p in parameters) or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


@dataclasses.dataclass
class StepStats:
    loss: float
    acc: list[float]  # per slot 1..B-1
    eal: float
    correct: Tensor  # [B-1], for averaging over steps
    count: Tensor  # [B-1]
    lr: float
    grad_norm: float


@dataclasses.dataclass
class Blocks:
    """A (micro-)batch's training blocks (trainer.anchors)."""
    anchors: Tensor  # [b, N] long
    block_ids: Tensor  # [b, N, B] long
    targets: Tensor  # [b, N, B] long
    slot_valid: Tensor  # [b, N, B] bool


def draw_blocks(config: DrafterConfig, batch: Batch, num_anchors: int, generator: torch.Generator | None = None,
                attention: Attention = "auto") -> Blocks:
    anchors, valid = sample_anchors(batch.loss_mask, num_anchors, generator,
                                    exact=uses_flex(attention, batch.context))  # [b, N] x2
    return Blocks(anchors, *gather_blocks(batch.input_ids, batch.loss_mask, anchors, valid, config.block_size,
                                          config.mask_token_id))  # [b, N, B] x3


def loss_shares(drawn: list[Blocks]) -> Tensor:
    """Each micro-batch's share of its chunk's loss: its valid slots' decay weight over the whole chunk's. Each
    micro-batch's loss is a weighted mean over its own slots, so the shares make their sum the loss of the chunk as
    one batch, every block weighing the same; a plain mean weighed a micro-batch of one long sample as much as one of
    ten short ones (the likely reason split chunks learned less in the same steps: docs/performance.md). [M] fp32."""
    weights = torch.stack([loss_weight(blocks.slot_valid) for blocks in drawn])  # [M]
    return weights / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)  # [M]


def backward(model: nn.Module, head: TargetHead, batch: Batch, blocks: Blocks, *, loss_chunk_rows: int,
             scale: float | Tensor = 1.0, attention: Attention = "auto") -> DFlashLoss:
    """Forward and backward of one (micro-)batch through `model` (the drafter, or its DDP / FSDP form), the
    gradient of `scale` x its loss accumulated into the parameters. A DFlash2 drafter adds its selector's loss
    (trainer.dflash2.selector_loss), returned in `selector`; `loss` stays DFlash's."""
    drafter = model.module if isinstance(model, DistributedDataParallel) else model
    config = drafter.config
    on_gpu = batch.context.is_cuda
    with torch.autocast(device_type=batch.context.device.type, dtype=torch.bfloat16, enabled=on_gpu):
        hidden = model(batch.context, blocks.block_ids, blocks.anchors, head, attention)  # [b, N, B, H]
    # the head runs in its own dtype (bf16 on GPU): never a converted copy of the [V, H] matrix per step
    hidden = hidden.to(head.lm_head.dtype)  # [b, N, B, H]
    out = dflash_loss(hidden, head.lm_head, blocks.targets, blocks.slot_valid, chunk_rows=loss_chunk_rows,
                      top_k=config.selector_top_k if config.dflash2 else 0)
    loss = out.loss
    if config.dflash2:
        valid = blocks.slot_valid  # [b, N, B]
        slots = torch.arange(config.block_size, device=valid.device).expand_as(valid)  # [b, N, B]
        predecessors = torch.cat([blocks.targets[..., :1], blocks.targets[..., :-1]], dim=-1)  # [b, N, B] token before
        out.selector = drafter.selector_loss(
            hidden[valid], out.top_logits, out.top_ids, predecessors[valid], blocks.targets[valid],
            decay_weights(config.block_size, device=valid.device).expand_as(valid)[valid], slots[valid],
            config.block_size)
        loss = loss + out.selector.loss
    (loss * scale).backward()
    return out


def optimizer_step(model: nn.Module, optimizer, scheduler, grad_clip: float) -> tuple[float, float]:
    """Clip, step the optimizer and the schedule; returns the step's learning rate and its gradient norm."""
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the trainer may have set it since the schedule)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # [] on the device
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # read only now: waiting for the norm before the optimizer's kernels were queued left the GPU idle meanwhile
    return lr, float(grad_norm)


def train_step(drafter: DFlashDrafter, head: TargetHead, batch: Batch, optimizer, scheduler, *, num_anchors: int,
               grad_clip: float, loss_chunk_rows: int, generator: torch.Generator | None = None,
               attention: Attention = "auto", model: nn.Module | None = None) -> StepStats:
    """One batch, one optimizer step (the benchmark's step); `model` is the drafter's DDP form on several ranks."""
    blocks = draw_blocks(drafter.config, batch, num_anchors, generator, attention)
    out = backward(model or drafter, head, batch, blocks, loss_chunk_rows=loss_chunk_rows, attention=attention)
    lr, grad_norm = optimizer_step(model or drafter, optimizer, scheduler, grad_clip)
    return StepStats(float(out.loss.detach()), out.acc.tolist(), float(out.eal), out.correct.detach().cpu(),
                     out.count.detach().cpu(), lr, grad_norm)
