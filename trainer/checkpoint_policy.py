"""When the trainer group checkpoints: every `train.checkpoint_every_steps` steps or `checkpoint_every_minutes`, and
whenever half the backlog limit (or half the store budget) is held unacknowledged, since the producer waits on
exactly that. Every rank decides alike from what the step's offers say (rank 0 reads the clock and the store bytes)."""

from __future__ import annotations

import time

from dflashq.run import Run
from trainer.checkpoint import TrainState


class CheckpointPolicy:
    def __init__(self, run: Run, state: TrainState):
        """`state`: the one the run resumed from (its last checkpoint, or a fresh start)."""
        self.run = run
        self.cfg = run.settings.train  # read at each decision: a setting changed on the live trainer applies
        self.saved_at = time.monotonic()
        self.step, self.epoch = state.step, state.epoch  # of the last checkpoint

    def overdue(self) -> bool:
        """Rank 0: checkpoint_every_minutes passed, or half the store budget is held."""
        held_bytes = int(self.run.conn.get(self.run.keys.store_bytes) or 0)
        return (time.monotonic() - self.saved_at >= 60 * self.cfg.checkpoint_every_minutes
                or held_bytes >= self.run.settings.backpressure.max_store_bytes // 2)

    def due(self, state: TrainState, overdue: bool, unacked_everywhere: int) -> bool:
        """After a step: `overdue` as rank 0 offered it, `unacked_everywhere` over every rank."""
        if state.step == self.step:
            return False
        return (state.step - self.step >= max(1, self.cfg.checkpoint_every_steps) or overdue
                or unacked_everywhere >= max(1, self.run.settings.backpressure.max_backlog // 2))

    def unsaved(self, state: TrainState) -> bool:
        """Whether the state differs from the last checkpoint's (a finished epoch counts: a restart must see it)."""
        return (state.step, state.epoch) != (self.step, self.epoch)

    def saved(self, state: TrainState) -> None:
        self.saved_at = time.monotonic()
        self.step, self.epoch = state.step, state.epoch
