"""The epoch a trainer group is in and its learning-rate horizon, both from the producer's counts of each epoch's
chunks: rank 0 reads them, every rank advances alike from what it read."""

from __future__ import annotations

import math

import torch

from dflashq.run import Run
from trainer.checkpoint import TrainState
from trainer.step import WarmupCosine


def producer_counts(run: Run) -> tuple[dict[int, int | None], int | None]:
    """Chunks per epoch as the producer counted them (None until it has seen the whole epoch; with retention `keep`
    every epoch trains epoch 0's chunks), and epoch 0's chunks for the learning-rate horizon: counted, else the
    producer's running estimate, else None."""
    epochs = range(run.settings.train.epochs)
    key = (lambda e: e) if run.settings.store.retention == "delete" else (lambda e: 0)
    *raw, estimate = run.conn.mget([run.keys.epoch_total(key(e)) for e in epochs] + [run.keys.epoch_estimate])
    totals = {e: int(v) if v is not None else None for e, v in zip(epochs, raw)}
    return totals, totals[0] or (int(estimate) if estimate is not None else None)


def advance(state: TrainState, totals: dict[int, int | None]) -> None:
    """Move past every epoch whose counted chunks are all trained (`totals`: rank 0's producer_counts)."""
    def done(epoch):
        return totals[epoch] is not None and len(state.consumed_in(epoch)) >= totals[epoch]

    while state.epoch < len(totals) and done(state.epoch):
        state.epoch += 1


def follow_horizon(state: TrainState, horizon_chunks: int, epochs: int, chunks_per_step: int, schedule: WarmupCosine,
                   optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Set the learning-rate horizon to the steps left for the chunks left of `epochs` epochs of epoch 0's
    `horizon_chunks`; `chunks_per_step` over every rank."""
    left = horizon_chunks * epochs - sum(len(v) for v in state.consumed.values())
    schedule.total = max(1, state.step + math.ceil(max(0, left) / chunks_per_step))
    # the coming step's rate was set under the former horizon (the first step's under none)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * schedule(scheduler.last_epoch)
