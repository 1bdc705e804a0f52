"""Where one trainer rank's chunks come from, and where they go once trained.

With retention `delete` (and for epoch 0 with `keep`) they are entries of the results stream, read through this
rank's consumer (trainer.consumer); with `keep`, every later epoch trains this rank's share of the epoch-0 blobs in
the epoch's seeded order. A re-delivery of a chunk the checkpoint already holds (a crash between checkpoint and
acknowledgement) is acknowledged at once, blob and all, and counted as a duplicate, never trained twice. Blobs start
reading as soon as their chunk is taken (trainer.prefetch). Trained entries wait unacknowledged until the checkpoint
that holds them exists; the daemon then settles them.
"""

from __future__ import annotations

import random

from dflashq.run import Run
from trainer.checkpoint import TrainState
from trainer.consumer import Entry, ResultsConsumer
from trainer.prefetch import Prefetcher
from trainer.ranks import Ranks


class ChunkSource:
    def __init__(self, run: Run, ranks: Ranks, prefetch: Prefetcher):
        self.run = run
        self.cfg = run.settings.train
        self.ranks = ranks
        self.prefetch = prefetch
        self.consumer = ResultsConsumer(run.conn, run.keys, ranks.consumer, self.cfg.claim_idle_seconds,
                                        live=ranks.consumers)
        self.unacked: list[Entry] = []  # trained, waiting for the checkpoint that holds them
        self.upcoming: list[Entry] = []  # the next step's chunks, taken while this step trains (their blobs read ahead)
        self.duplicates: dict[int, int] = {}  # per epoch: acknowledged since the last pop_duplicates
        self._store_order: tuple[int, list[str]] = (-1, [])  # retention `keep`: (epoch, its chunks in training order)

    @property
    def from_store(self) -> bool:
        return self.run.settings.store.retention == "keep"

    def take(self, state: TrainState) -> list[Entry]:
        """This rank's chunks for the next step, up to train.chunks_per_step: those taken ahead first, then what the
        stream holds (waiting a moment for it), or with `keep` after epoch 0 its share of the stored blobs."""
        held, self.upcoming = self.upcoming, []
        return self._gather(state, held, ahead_of=None)

    def take_ahead(self, state: TrainState, ahead_of: set[str]) -> None:
        """Take the step after the one about to train (`ahead_of`: its chunk ids on every rank) without waiting,
        so that its blobs read while this one trains. Stream entries taken stay pending for this consumer, so a
        restart re-reads them like any other unacknowledged entry. A store share is recomputed from the state at
        each take; taken ahead of the epoch's last step it is empty, so it never spans an epoch change."""
        self.upcoming = self._gather(state, [], ahead_of)

    def _gather(self, state: TrainState, held: list[Entry], ahead_of: set[str] | None) -> list[Entry]:
        later: list[Entry] = []
        if self.from_store and state.epoch > 0:
            # taken ahead, the steps after the next one start reading too: decoding a blob on one thread can take
            # longer than a small drafter's step
            steps = 1 + (self.prefetch.threads if ahead_of is not None else 0)
            held, later = self._store_share(state, exclude=ahead_of or set(), steps=steps)
        else:
            while len(held) < self.cfg.chunks_per_step:
                entries = self.consumer.read(count=self.cfg.chunks_per_step - len(held),
                                             block_ms=None if ahead_of is not None else 1000)
                if not entries:
                    break
                for entry in entries:
                    if entry.chunk in state.consumed_in(entry.epoch):
                        self.duplicates[entry.epoch] = self.duplicates.get(entry.epoch, 0) + 1
                        self.delete_blobs([entry])
                        self.ack([entry])
                    else:
                        held.append(entry)
        self.prefetch.ahead([e.path for e in held + later])
        return held

    def _store_share(self, state: TrainState, exclude: set[str], steps: int) -> tuple[list[Entry], list[Entry]]:
        """This rank's chunks of the next step, and of the `steps` - 1 steps after it as they stand now."""
        epoch = state.epoch
        if self._store_order[0] != epoch:  # once per epoch, not per step
            order = sorted(state.consumed_in(0))
            random.Random(self.cfg.seed + epoch).shuffle(order)
            self._store_order = (epoch, order)
        done = set(state.consumed_in(epoch))
        k, width, rank = self.cfg.chunks_per_step, self.ranks.world_size * self.cfg.chunks_per_step, self.ranks.rank
        pending = [c for c in self._store_order[1] if c not in done and c not in exclude][:width * steps]  # alike on every rank
        # only a full step has a step after it, so the first k of this rank's chunks are the next step's
        mine = [Entry("", chunk, self.run.store.blob_path(chunk, 0), epoch, 0)
                for start in range(0, len(pending), width) for chunk in pending[start + rank * k:start + (rank + 1) * k]]
        return mine[:k], mine[k:]

    def pop_duplicates(self) -> dict[int, int]:
        """Duplicates acknowledged since the last call, per epoch (what this rank's next offer reports)."""
        duplicates, self.duplicates = self.duplicates, {}
        return duplicates

    def trained(self, held: list[Entry]) -> None:
        self.unacked += [e for e in held if e.id]  # store shares have no stream entry to acknowledge

    def unacknowledged_with(self, held: list[Entry]) -> int:
        """Entries this rank holds unacknowledged once `held` is trained."""
        return len(self.unacked) + sum(1 for e in held if e.id)

    def settle(self) -> list[Entry]:
        """After the checkpoint holding them: the trained entries, their blobs deleted (they have done their work);
        the caller acknowledges them."""
        entries, self.unacked = self.unacked, []
        self.delete_blobs(entries)
        return entries

    def delete_blobs(self, entries: list[Entry]) -> None:
        if self.run.settings.store.retention == "delete":
            for entry in entries:
                self.run.store.delete(entry.path)

    def ack(self, entries: list[Entry]) -> None:
        self.consumer.ack([e for e in entries if e.id])
