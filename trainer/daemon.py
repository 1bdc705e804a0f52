"""`dflashq train`: the trainer daemon. Consumes finished blobs with backpressure and trains each chunk exactly once
per epoch, even when it is killed; on one rank, or on N ranks of one torch.distributed group (trainer.ranks).

A step is one optimizer step over `train.chunks_per_step` chunks of every rank (each chunk's samples in
micro-batches of at most `train.micro_batch_tokens` padded tokens, gradients accumulated, then averaged over the
ranks by DDP or FSDP). Ranks agree on every step through one gather of what each brings (its chunks, duplicates
skipped, a stop request; rank 0 adds what it read from Redis: the producer's chunk totals, whether a checkpoint is
overdue), so all of them take the same decisions from the same state: how many chunks the step averages, the
epoch, when to checkpoint, when to stop. A rank without a chunk joins the step with an empty batch; when no rank
holds one, nobody steps.

Exactly once: the checkpoint records the chunk ids trained in each epoch (all ranks'); stream entries are
acknowledged (freeing backlog and store budget, and with retention `delete` removing the blob) only after the
checkpoint that contains them: rank 0 writes it, then a barrier, then every rank acknowledges its own. After a
crash the group rolls back to its checkpoint, every rank re-reads its own pending entries and entries of ranks that
no longer exist are claimed; they are trained again, and entries of chunks the checkpoint already holds are
acknowledged and counted as duplicates, never trained twice.
Checkpoints come every `checkpoint_every_steps` steps or `checkpoint_every_minutes`, and also whenever half the
backlog limit (or half the store budget) is held unacknowledged, since the producer waits on exactly that.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import socket
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflashq import defaults, manifest
from dflashq.chunk import micro_batches
from dflashq.exceptions import BlobError, ConfigError
from dflashq.run import Run
from dflashq.target import resolve_dtype
from trainer import checkpoint, parallel
from trainer.anchors import chunk_generator
from trainer.consumer import Entry, ResultsConsumer
from trainer.drafter import DFlashDrafter, DrafterConfig, drafter_architecture
from trainer.loss import expected_acceptance_length
from trainer.mask_token import resolve_mask_token
from trainer.prefetch import Prefetcher
from trainer.ranks import Ranks
from trainer.step import (WarmupCosine, backward, build_optimizer, collate, draw_blocks, empty_batch, loss_shares,
                          optimizer_step)
from trainer.target_head import TargetHead


@dataclasses.dataclass
class TrainReport:
    steps: int
    epochs_done: int
    consumed: dict[int, int]  # epoch -> chunks trained
    duplicates_skipped: dict[int, int]
    last_loss: float | None
    last_eal: float | None
    checkpoint: str | None
    stopped: bool  # True when stopped by a signal or max_steps before the epochs were done


@dataclasses.dataclass
class Offer:
    """What one rank brings to a step; gathered from every rank, so that each decides alike."""
    chunks: list[tuple[int, str]]  # (epoch, chunk id) it trains in this step
    duplicates: dict[int, int]  # per epoch: re-deliveries of checkpointed chunks it acknowledged since its last offer
    unacknowledged: int  # entries it holds unacknowledged once the step is done
    stop: bool  # a signal asked it to stop
    totals: dict[int, int | None]  # rank 0: the chunks of each epoch, once the producer has counted them
    horizon_chunks: int | None  # rank 0: epoch 0's chunks, counted or (until then) the producer's estimate
    overdue: bool  # rank 0: checkpoint_every_minutes passed, or half the store budget is held


@dataclasses.dataclass
class RankStats:
    """What one rank's chunks gave in a step, gathered for the step's record."""
    losses: list[float]  # per chunk: the mean over its micro-batches
    correct: list[float]  # [B-1] over its chunks
    count: list[float]  # [B-1]
    tokens: int


class Trainer:
    def __init__(self, run: Run, device: str = "cpu", progress: bool = True, ranks: Ranks | None = None):
        """`ranks`: this process's place in a group it has joined (trainer.ranks.Ranks.joined); default one rank."""
        self.run = run
        s = run.settings.train
        self.cfg = s
        self.ranks = ranks or Ranks()
        self.device = torch.device(device)
        self.progress = progress and self.ranks.leader
        model_path = run.settings.model.path
        with open(Path(model_path) / "config.json") as f:
            target_config = json.load(f)
        text = target_config.get("text_config") or target_config
        self.head = TargetHead.from_pretrained(model_path, dtype=resolve_dtype("auto", self.device), device=self.device)
        mask = resolve_mask_token(model_path, s.mask_token_id, text["vocab_size"])
        shape = {name: getattr(s, name) for name in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                     "intermediate_size", "layer_types") if getattr(s, name)}
        config = DrafterConfig.default_for_target(target_config, s.num_layers, run.layer_ids, mask_token_id=mask.id,
                                                  block_size=s.block_size, sliding_window=s.sliding_window,
                                                  rope_theta=s.rope_theta, **shape, **drafter_architecture(s))
        first_choice = run.manifest.get("mask_token_id") is None  # recorded only once the config is known valid
        run.manifest = manifest.join(run.conn, run.store, {"run": run.settings.run, "mask_token_id": mask.id,
                                                           "architecture": s.architecture})
        if first_choice and self.ranks.leader:  # said once per run; the manifest and the export keep it
            print(f"MASK token id {mask.id}: {mask.reason} (recorded in the run manifest).", flush=True)
        torch.manual_seed(s.seed)
        self.drafter = DFlashDrafter(config).to(self.device)  # fp32 master weights, the same on every rank
        self.model = parallel.wrap(self.drafter, self.ranks, s.parallel, self.device)
        # horizon: train.total_steps, else the steps left for the chunks left of epoch 0's size (estimated or counted)
        self.schedule = WarmupCosine(s.warmup_ratio, s.total_steps or None)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), s.learning_rate, s.weight_decay,
                                                         self.schedule)
        self.ckpt_root = run.store.path("checkpoints")
        self.state = checkpoint.TrainState()
        found = self._restore()
        self.consumer = ResultsConsumer(run.conn, run.keys, self.ranks.consumer, s.claim_idle_seconds,
                                        live=self.ranks.consumers)
        self.unacked: list[Entry] = []
        self.upcoming: list[Entry] = []  # the next step's chunks, taken while this step trains (their blobs read ahead)
        self.prefetch = Prefetcher(run.store, defaults.READ_AHEAD_THREADS, pinned=self.device.type == "cuda")
        self.unacked_everywhere = 0  # over all ranks, as of the last step's offers
        self.duplicates: dict[int, int] = {}  # acknowledged since this rank's last offer
        self._store_order: tuple[int, list[str]] = (-1, [])  # retention `keep`: (epoch, its chunks in training order)
        self.last_checkpoint = time.monotonic()
        self.steps_at_checkpoint = self.state.step
        self.epoch_at_checkpoint = self.state.epoch
        self.last_checkpoint_path = str(found) if found else None
        self.stop_requested = False
        self.started = time.time()
        self.steps_at_start = self.state.step
        self.consumed_at_start = sum(len(v) for v in self.state.consumed.values())
        self.rank_chunks, self.rank_tokens, self.busy_seconds = 0, 0, 0.0  # this rank, this process: its training rate
        self.step_ended = time.perf_counter()  # the start of the first step's `between` (see _train)
        self.log_path = run.store.path(s.log_file)
        if self.ranks.leader:  # fields of ranks that a larger world of an earlier start left behind
            stale = [f for f in run.conn.hkeys(run.keys.trainer_ranks) if int(f) >= self.ranks.world_size]
            if stale:
                run.conn.hdel(run.keys.trainer_ranks, *stale)
        if found is not None:
            self._log({"event": "resumed", "step": self.state.step, "checkpoint": str(found),
                       "ranks": self.ranks.world_size})

    def _restore(self) -> Path | None:
        """Load the latest checkpoint, read by rank 0 alone (the other ranks may not see its folder) and broadcast."""
        saved = None
        if self.ranks.leader:
            found = checkpoint.latest(self.ckpt_root)
            saved = checkpoint.read(found) if found is not None else None
        # the small part to every rank; the tensors go through torch.distributed.checkpoint's broadcast
        meta = self.ranks.from_leader(dataclasses.replace(saved, weights={}, optimizer={}) if saved else None)
        if meta is None:
            return None
        meta.check_config(self.drafter.config)
        parallel.load_full_state(self.model, self.optimizer, self.ranks, saved.weights if saved else {},
                                 saved.optimizer if saved else {})
        self.scheduler.load_state_dict(meta.scheduler)
        checkpoint.set_rng_state(meta.rng.get(self.ranks.rank, {}), self.device)  # a new rank keeps its fresh one
        self.state = meta.state
        return meta.path

    # --- epochs -------------------------------------------------------------------------------------------
    def _counts(self) -> tuple[dict[int, int | None], int | None]:
        """Chunks per epoch as the producer counted them (None until it has seen the whole epoch; with retention
        `keep` every epoch trains epoch 0's chunks), and epoch 0's chunks for the learning-rate horizon: counted,
        else the producer's running estimate, else None."""
        epochs = range(self.cfg.epochs)
        key = (lambda e: e) if self.run.settings.store.retention == "delete" else (lambda e: 0)
        *raw, estimate = self.run.conn.mget([self.run.keys.epoch_total(key(e)) for e in epochs]
                                            + [self.run.keys.epoch_estimate])
        totals = {e: int(v) if v is not None else None for e, v in zip(epochs, raw)}
        return totals, totals[0] or (int(estimate) if estimate is not None else None)

    def _advance_epoch(self, totals: dict[int, int | None], horizon_chunks: int | None) -> None:
        """From rank 0's counts, so that every rank moves on at the same step and sets the same horizon."""
        def done(epoch):
            return totals[epoch] is not None and len(self.state.consumed_in(epoch)) >= totals[epoch]

        while self.state.epoch < self.cfg.epochs and done(self.state.epoch):
            self.state.epoch += 1
        if horizon_chunks and not self.cfg.total_steps:
            left = horizon_chunks * self.cfg.epochs - sum(len(v) for v in self.state.consumed.values())
            per_step = self.ranks.world_size * self.cfg.chunks_per_step
            self.schedule.total = max(1, self.state.step + math.ceil(max(0, left) / per_step))
            # the coming step's rate was set under the former horizon (the first step's under none)
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                group["lr"] = base * self.schedule(self.scheduler.last_epoch)

    @property
    def finished(self) -> bool:
        return self.state.epoch >= self.cfg.epochs

    # --- sources of chunks ----------------------------------------------------------------------------------
    def _take(self, ahead_of: set[str] | None = None) -> list[Entry]:
        """This rank's chunks for the next step, up to train.chunks_per_step: stream entries (every epoch with
        retention `delete`, epoch 0 with `keep`), or with `keep` after epoch 0 its share of the epoch-0 blobs in the
        epoch's shuffled order. Re-deliveries of chunks the checkpoint already holds (a crash between checkpoint
        and ack) are acknowledged at once, blob and all, and counted as duplicates. Their blobs start reading at once.

        `ahead_of`: the chunk ids of the step about to train (every rank's); the call then takes what is there
        without waiting, and the next call starts from it (stream entries taken stay pending for this consumer, so a
        restart re-reads them like any other unacknowledged entry). A store share is recomputed from the state each
        time; taken ahead of the epoch's last step it is empty, so it never spans an epoch change."""
        if self.stop_requested:
            return []
        later: list[Entry] = []
        if self.run.settings.store.retention == "keep" and self.state.epoch > 0:
            self.upcoming = []
            # taken ahead, the steps after the next one start reading too: decoding one blob on one thread took
            # longer than a small drafter's step (SmolLM2: 0.017 s of a 0.08 s step waiting on it, H200)
            steps = 1 + (self.prefetch.threads if ahead_of is not None else 0)
            held, later = self._store_share(exclude=ahead_of or set(), steps=steps)
        else:
            held, self.upcoming = self.upcoming, []
            while len(held) < self.cfg.chunks_per_step:
                entries = self.consumer.read(count=self.cfg.chunks_per_step - len(held),
                                             block_ms=None if ahead_of is not None else 1000)
                if not entries:
                    break
                for entry in entries:
                    if entry.chunk in self.state.consumed_in(entry.epoch):
                        self.duplicates[entry.epoch] = self.duplicates.get(entry.epoch, 0) + 1
                        self._delete_blobs([entry])
                        self._ack([entry])
                    else:
                        held.append(entry)
        self.prefetch.ahead([e.path for e in held + later])
        return held

    def _store_share(self, exclude: set[str], steps: int = 1) -> tuple[list[Entry], list[Entry]]:
        """This rank's chunks of the next step, and of the `steps` - 1 steps after it as they stand now."""
        epoch = self.state.epoch
        if self._store_order[0] != epoch:  # once per epoch, not per step
            order = sorted(self.state.consumed_in(0))
            random.Random(self.cfg.seed + epoch).shuffle(order)
            self._store_order = (epoch, order)
        done = set(self.state.consumed_in(epoch))
        k, width, rank = self.cfg.chunks_per_step, self.ranks.world_size * self.cfg.chunks_per_step, self.ranks.rank
        pending = [c for c in self._store_order[1] if c not in done and c not in exclude][:width * steps]  # alike on every rank
        # only a full step has a step after it, so the first k of this rank's chunks are the next step's
        mine = [Entry("", chunk, self.run.store.blob_path(chunk, 0), epoch, 0)
                for start in range(0, len(pending), width) for chunk in pending[start + rank * k:start + (rank + 1) * k]]
        return mine[:k], mine[k:]

    # --- training -------------------------------------------------------------------------------------------
    def _offer(self, held: list[Entry]) -> Offer:
        duplicates, self.duplicates = self.duplicates, {}
        leader = self.ranks.leader
        totals, horizon_chunks = self._counts() if leader else ({}, None)
        return Offer([(e.epoch, e.chunk) for e in held], duplicates, len(self.unacked) + sum(1 for e in held if e.id),
                     self.stop_requested, totals, horizon_chunks, leader and self._overdue())

    def _train(self, held: list[Entry], chunks_in_step: int) -> tuple[RankStats, float, float]:
        """This rank's part of one optimizer step; returns its stats, and the step's learning rate and gradient
        norm (alike on every rank). Each chunk's loss is scaled by world_size / chunks_in_step, so the average over
        ranks that DDP (or FSDP) takes of the gradients is their mean over the step's chunks; without a chunk the
        rank trains an empty batch, so that the gradient collectives run on every rank."""
        started = time.perf_counter()
        # where the step's wall time goes, logged with it: between steps (waiting for blobs and the other ranks,
        # checkpoints, Redis), reading its blobs (waiting for the read-ahead, copy to the device, unshuffle), computing
        self.timing = {"between": started - self.step_ended, "read": 0.0, "compute": 0.0}
        scale = self.ranks.world_size / chunks_in_step
        slots = self.drafter.config.block_size - 1
        losses, correct, count, tokens = [], torch.zeros(slots), torch.zeros(slots), 0
        if not held:
            empty = empty_batch(self.drafter.config, self.device)
            with parallel.gradient_sync(self.model, True):
                backward(self.model, self.head, empty,
                         draw_blocks(self.drafter.config, empty, self.cfg.num_anchors, attention=self.cfg.attention),
                         loss_chunk_rows=self.cfg.loss_chunk_rows, attention=self.cfg.attention)
        for i, entry in enumerate(held):
            loss, chunk_correct, chunk_count, chunk_tokens = self._train_chunk(entry, scale, i == len(held) - 1)
            losses.append(loss)
            correct, count, tokens = correct + chunk_correct, count + chunk_count, tokens + chunk_tokens
        lr, grad_norm = optimizer_step(self.model, self.optimizer, self.scheduler, self.cfg.grad_clip)
        busy = time.perf_counter() - started
        self.busy_seconds += busy
        self.timing["compute"] = busy - self.timing["read"]
        self.rank_chunks += len(held)
        self.rank_tokens += tokens
        return RankStats(losses, correct.tolist(), count.tolist(), tokens), lr, grad_norm

    def _train_chunk(self, entry: Entry, scale: float, last: bool) -> tuple[float, torch.Tensor, torch.Tensor, int]:
        """Forward and backward of one chunk's micro-batches, the chunk's loss (each micro-batch's weighed by its
        share of the chunk's blocks, trainer.step.loss_shares) scaled by `scale`; only the step's last backward
        (`last`: of its last chunk) communicates. Returns loss, correct and valid rows per slot [B-1], tokens."""
        read_started = time.perf_counter()
        try:  # on the training device: an fp8 blob crosses as 1-byte values and is dequantized there
            samples = list(self.prefetch.get(entry.path).samples(self.device))
        except (BlobError, FileNotFoundError) as exc:
            self._log({"event": "unreadable blob", "chunk": entry.chunk, "error": str(exc)})
            raise
        self.timing["read"] += time.perf_counter() - read_started
        lengths = [int(ids.shape[0]) for _, ids, _ in samples]
        groups = micro_batches(lengths, self.cfg.micro_batch_tokens)
        loss, correct, count, j = 0.0, 0, 0, 0
        try:
            batches = [collate([samples[n] for n in group], self.device) for group in groups]
            del samples  # the padded micro-batches hold the chunk now
            # every micro-batch's blocks before the first backward: each one's share of the chunk's loss needs them all
            generator = chunk_generator(self.cfg.seed, entry.epoch, entry.chunk, self.device)
            drawn = [draw_blocks(self.drafter.config, batch, self.cfg.num_anchors, generator, self.cfg.attention)
                     for batch in batches]
            shares = loss_shares(drawn)  # [M]
            for j, (batch, blocks) in enumerate(zip(batches, drawn)):
                with parallel.gradient_sync(self.model, last and j == len(groups) - 1):
                    out = backward(self.model, self.head, batch, blocks,
                                   loss_chunk_rows=self.cfg.loss_chunk_rows, scale=scale * shares[j],
                                   attention=self.cfg.attention)
                loss += float(out.loss.detach() * shares[j])
                correct, count = correct + out.correct.detach().cpu(), count + out.count.detach().cpu()
        except torch.OutOfMemoryError:
            group = groups[j]
            raise self._out_of_memory(entry, len(group), max(lengths[n] for n in group) * len(group)) from None
        return loss, correct, count, sum(lengths)

    def _out_of_memory(self, entry: Entry, samples: int, padded_tokens: int) -> ConfigError:
        """The sentence for a micro-batch that does not fit: what holds the GPU, and the settings that shrink it.
        Nothing is lost: the chunk is not acknowledged, and the next start trains it from the last checkpoint."""
        held = ""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            mine = torch.cuda.memory_reserved(self.device)
            held = (f" (this trainer holds {mine / 2**30:.1f} GiB, other processes {(total - free - mine) / 2**30:.1f} "
                    f"GiB of {total / 2**30:.1f})")
        return ConfigError(
            f"The trainer ran out of memory on {self.device}{held} with {samples} samples, {padded_tokens} padded "
            f"tokens of chunk {entry.chunk}: lower train.micro_batch_tokens (now {self.cfg.micro_batch_tokens}) or "
            f"train.num_anchors (now {self.cfg.num_anchors}), or give the trainer a GPU of its own (`up --trainer-gpus`).")

    def _step(self, held: list[Entry], offers: list[Offer]) -> dict:
        """Train the agreed step on every rank and record it alike everywhere; returns the step's record."""
        chunks = [chunk for offer in offers for chunk in offer.chunks]
        mine, lr, grad_norm = self._train(held, len(chunks))
        everyone = self.ranks.gather(mine)
        losses = [loss for s in everyone for loss in s.losses]
        correct = torch.tensor([s.correct for s in everyone]).sum(0)  # [B-1]
        count = torch.tensor([s.count for s in everyone]).sum(0)  # [B-1]
        acc = correct / count.clamp_min(1)  # [B-1] over the whole step
        tokens = sum(s.tokens for s in everyone)
        self.state.step += 1
        self.state.tokens += tokens
        for epoch, chunk in chunks:
            self.state.consumed_in(epoch).append(chunk)
        self.unacked += [e for e in held if e.id]
        record = {"step": self.state.step, "epoch": chunks[0][0], "chunks": [c for _, c in chunks],
                  "loss": sum(losses) / len(losses), "acc": acc.tolist(), "eal": float(expected_acceptance_length(acc)),
                  "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "time": time.time(),
                  "seconds": {k: round(v, 4) for k, v in self.timing.items()}}  # rank 0's
        self._log(record)
        self._publish(loss=record["loss"], eal=record["eal"], lr=record["lr"])
        self.step_ended = time.perf_counter()
        return record

    def _log(self, record: dict) -> None:
        if self.run.store.remote or not self.ranks.leader:
            return
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _publish(self, **extra) -> None:
        """Rank 0: the run's trainer status (as the single trainer published it); every rank: its own entry under
        trainer_ranks, with its training rate (tokens per second spent training, not waiting for chunks)."""
        run, s = self.run, self.state
        rank = {"rank": self.ranks.rank, "consumer": self.ranks.consumer, "host": socket.gethostname(),
                "device": str(self.device), "pid": os.getpid(), "chunks": self.rank_chunks, "tokens": self.rank_tokens,
                "busy_tokens_per_second": self.rank_tokens / self.busy_seconds if self.busy_seconds else None,
                "unacknowledged": len(self.unacked), "updated": time.time()}
        run.conn.hset(run.keys.trainer_ranks, str(self.ranks.rank), json.dumps(rank))
        if not self.ranks.leader:
            return
        consumed_total = sum(len(v) for v in s.consumed.values())
        data = {"step": s.step, "epoch": s.epoch, "epochs": self.cfg.epochs,
                "consumed": len(s.consumed_in(s.epoch)) if not self.finished else len(s.consumed_in(self.cfg.epochs - 1)),
                "consumed_total": consumed_total, "chunks_since_start": consumed_total - self.consumed_at_start,
                "duplicates_skipped": sum(s.duplicates_skipped.values()), "tokens": s.tokens,
                "unacknowledged": self.unacked_everywhere, "checkpoint": self.last_checkpoint_path,
                "updated": time.time(), "started": self.started, "steps_since_start": s.step - self.steps_at_start,
                "ranks": self.ranks.world_size, "parallel": self.cfg.parallel if self.ranks.distributed else None,
                **extra}
        run.conn.hset(run.keys.trainer, mapping={k: json.dumps(v) for k, v in data.items()})

    # --- checkpoints ----------------------------------------------------------------------------------------
    def _overdue(self) -> bool:
        bp = self.run.settings.backpressure
        held_bytes = int(self.run.conn.get(self.run.keys.store_bytes) or 0)
        return (time.monotonic() - self.last_checkpoint >= 60 * self.cfg.checkpoint_every_minutes
                or held_bytes >= bp.max_store_bytes // 2)

    def _checkpoint_due(self, offers: list[Offer]) -> bool:
        if self.state.step == self.steps_at_checkpoint:
            return False
        return (self.state.step - self.steps_at_checkpoint >= max(1, self.cfg.checkpoint_every_steps)
                or offers[0].overdue
                or self.unacked_everywhere >= max(1, self.run.settings.backpressure.max_backlog // 2))

    def save_checkpoint(self) -> str:
        """Write the group's checkpoint: collective (every rank calls it), rank 0 writes, and every rank returns
        once the checkpoint exists."""
        weights, optimizer = parallel.full_state(self.model, self.optimizer)
        rng = self.ranks.gather(checkpoint.rng_state(self.device))
        if self.ranks.leader:
            checkpoint.save(self.ckpt_root, self.drafter.config, weights, optimizer, self.scheduler.state_dict(),
                            self.state, rng)
        self.ranks.barrier()  # no rank acknowledges an entry before the checkpoint holding it exists
        return str(checkpoint.path_of(self.ckpt_root, self.state.step))

    def checkpoint_and_ack(self) -> None:
        self.last_checkpoint_path = self.save_checkpoint()
        self._delete_blobs(self.unacked)  # trained and checkpointed: the blob has done its work
        self._ack(self.unacked)
        self.unacked, self.unacked_everywhere = [], 0  # every rank acknowledges with it
        self.last_checkpoint = time.monotonic()
        self.steps_at_checkpoint = self.state.step
        self.epoch_at_checkpoint = self.state.epoch

    def _delete_blobs(self, entries: list[Entry]) -> None:
        if self.run.settings.store.retention == "delete":
            for entry in entries:
                self.run.store.delete(entry.path)

    def _ack(self, entries: list[Entry]) -> None:
        self.consumer.ack([e for e in entries if e.id])

    def run_until_done(self, max_steps: int | None = None) -> TrainReport:
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        last = {}
        columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}"))
        try:
            with Progress(*columns, disable=not self.progress) as bar:
                task = bar.add_task("train", total=None, status="waiting for blobs")
                self._advance_epoch(*self.ranks.from_leader(self._counts() if self.ranks.leader else None))
                self._publish()
                steps_this_run = 0
                while not self.finished and (max_steps is None or steps_this_run < max_steps):
                    held = self._take()
                    offers = self.ranks.gather(self._offer(held))
                    self.unacked_everywhere = sum(offer.unacknowledged for offer in offers)
                    for offer in offers:
                        for epoch, n in offer.duplicates.items():
                            self.state.duplicates_skipped[epoch] = self.state.duplicates_skipped.get(epoch, 0) + n
                    if any(offer.chunks for offer in offers):  # else nobody steps
                        self.upcoming = self._take(ahead_of={c for offer in offers for _, c in offer.chunks})
                        last = self._step(held, offers)
                        steps_this_run += 1
                    self._advance_epoch(offers[0].totals, offers[0].horizon_chunks)
                    if last:
                        counted = offers[0].horizon_chunks or self.cfg.total_steps
                        bar.update(task, completed=self.state.step, total=self.schedule.total if counted else None,
                                   status=f"epoch {self.state.epoch} loss {last['loss']:.3f} EAL {last['eal']:.2f}")
                    if any(offer.stop for offer in offers):
                        break
                    if self._checkpoint_due(offers):
                        self.checkpoint_and_ack()
                # the last state, with the epoch counter past the finished epoch, is what a restart must see
                if (self.state.step, self.state.epoch) != (self.steps_at_checkpoint, self.epoch_at_checkpoint):
                    self.checkpoint_and_ack()
                self._publish(**({"loss": last["loss"], "eal": last["eal"]} if last else {}), done=self.finished)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return TrainReport(self.state.step, min(self.state.epoch, self.cfg.epochs),
                           {e: len(v) for e, v in self.state.consumed.items()}, dict(self.state.duplicates_skipped),
                           last.get("loss"), last.get("eal"), self.last_checkpoint_path,
                           stopped=not self.finished)

    def _request_stop(self, signum, frame) -> None:
        # every rank finishes the current step, then one checkpoint, acknowledgements, exit
        self.stop_requested = True
