"""What the trainer tells operators: its status in Redis (what `dflashq status` and the dashboard read) and its
train log (one JSON record per step and event, what `dflashq report` draws)."""

from __future__ import annotations

import json
import os
import socket
import time

from dflashq.run import Run
from trainer.checkpoint import TrainState
from trainer.ranks import Ranks


class TrainerStatus:
    def __init__(self, run: Run, ranks: Ranks, device: str, state: TrainState):
        """`state`: the one the run resumed from; rates and counts since this start are measured from it."""
        self.run = run
        self.cfg = run.settings.train
        self.ranks = ranks
        self.device = device
        self.log_path = run.store.path(self.cfg.log_file)
        self.started = time.time()
        self.steps_at_start = state.step
        self.consumed_at_start = sum(len(v) for v in state.consumed.values())
        self.rank_chunks, self.rank_tokens, self.busy_seconds = 0, 0, 0.0  # this rank, this process: its training rate
        if ranks.leader:  # fields of ranks that a larger world of an earlier start left behind
            stale = [f for f in run.conn.hkeys(run.keys.trainer_ranks) if int(f) >= ranks.world_size]
            if stale:
                run.conn.hdel(run.keys.trainer_ranks, *stale)

    def trained(self, chunks: int, tokens: int, busy_seconds: float) -> None:
        """This rank's part of a step: what its training rate counts (time spent training, not waiting)."""
        self.rank_chunks += chunks
        self.rank_tokens += tokens
        self.busy_seconds += busy_seconds

    def log(self, record: dict) -> None:
        if self.run.store.remote or not self.ranks.leader:
            return
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def publish(self, state: TrainState, unacknowledged: int, unacked_everywhere: int, checkpoint: str | None,
                **extra) -> None:
        """Rank 0: the run's trainer status (as the single trainer published it); every rank: its own entry under
        trainer_ranks, with its training rate. `unacknowledged`: this rank's, `unacked_everywhere`: all ranks'."""
        run, cfg = self.run, self.cfg
        rank = {"rank": self.ranks.rank, "consumer": self.ranks.consumer, "host": socket.gethostname(),
                "device": self.device, "pid": os.getpid(), "chunks": self.rank_chunks, "tokens": self.rank_tokens,
                "busy_tokens_per_second": self.rank_tokens / self.busy_seconds if self.busy_seconds else None,
                "unacknowledged": unacknowledged, "updated": time.time()}
        run.conn.hset(run.keys.trainer_ranks, str(self.ranks.rank), json.dumps(rank))
        if not self.ranks.leader:
            return
        finished = state.epoch >= cfg.epochs
        consumed_total = sum(len(v) for v in state.consumed.values())
        data = {"step": state.step, "epoch": state.epoch, "epochs": cfg.epochs,
                "consumed": len(state.consumed_in(cfg.epochs - 1 if finished else state.epoch)),
                "consumed_total": consumed_total, "chunks_since_start": consumed_total - self.consumed_at_start,
                "duplicates_skipped": sum(state.duplicates_skipped.values()), "tokens": state.tokens,
                "unacknowledged": unacked_everywhere, "checkpoint": checkpoint,
                "updated": time.time(), "started": self.started, "steps_since_start": state.step - self.steps_at_start,
                "ranks": self.ranks.world_size, "parallel": cfg.parallel if self.ranks.distributed else None, **extra}
        run.conn.hset(run.keys.trainer, mapping={k: json.dumps(v) for k, v in data.items()})
