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
Where chunks come from and go: trainer.chunk_source; when to checkpoint: trainer.checkpoint_policy; the epoch and
learning-rate horizon: trainer.epochs; what operators see: trainer.status.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflashq import defaults, manifest
from dflashq.chunk import micro_batches
from dflashq.exceptions import BlobError, TrainerOutOfMemory
from dflashq.run import Run
from dflashq.target import resolve_dtype
from trainer import checkpoint, epochs, parallel
from trainer.anchors import chunk_generator
from trainer.checkpoint_policy import CheckpointPolicy
from trainer.chunk_source import ChunkSource
from trainer.consumer import Entry
from trainer.drafter import DFlashDrafter, DrafterConfig, drafter_architecture
from trainer.loss import expected_acceptance_length
from trainer.mask_token import resolve_mask_token
from trainer.prefetch import Prefetcher
from trainer.ranks import Ranks
from trainer.status import TrainerStatus
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


def drafter_config(run: Run, leader: bool) -> DrafterConfig:
    """The drafter the run trains: the target's shape, train.* overrides, the MASK token (recorded in the manifest,
    and said once per run by rank 0)."""
    s, model_path = run.settings.train, run.settings.model.path
    with open(Path(model_path) / "config.json") as f:
        target_config = json.load(f)
    text = target_config.get("text_config") or target_config
    mask = resolve_mask_token(model_path, s.mask_token_id, text["vocab_size"])
    shape = {name: getattr(s, name) for name in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "intermediate_size", "layer_types") if getattr(s, name)}
    config = DrafterConfig.default_for_target(target_config, s.num_layers, run.layer_ids, mask_token_id=mask.id,
                                              block_size=s.block_size, sliding_window=s.sliding_window,
                                              rope_theta=s.rope_theta, **shape, **drafter_architecture(s))
    first_choice = run.manifest.get("mask_token_id") is None  # recorded only once the config is known valid
    run.manifest = manifest.join(run.conn, run.store, {"run": run.settings.run, "mask_token_id": mask.id,
                                                       "architecture": s.architecture})
    if first_choice and leader:  # said once per run; the manifest and the export keep it
        print(f"MASK token id {mask.id}: {mask.reason} (recorded in the run manifest).", flush=True)
    return config


def out_of_memory(device: torch.device, cfg, chunk: str, samples: int, padded_tokens: int) -> TrainerOutOfMemory:
    """The sentence for a micro-batch that does not fit: what holds the GPU, and the settings that shrink it.
    Nothing is lost: the chunk is not acknowledged, and the next start trains it from the last checkpoint."""
    held = ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        mine = torch.cuda.memory_reserved(device)
        held = (f" (this trainer holds {mine / 2**30:.1f} GiB, other processes {(total - free - mine) / 2**30:.1f} "
                f"GiB of {total / 2**30:.1f})")
    return TrainerOutOfMemory(
        f"The trainer ran out of memory on {device}{held} with {samples} samples, {padded_tokens} padded tokens of "
        f"chunk {chunk}: lower train.micro_batch_tokens (now {cfg.micro_batch_tokens}) or train.num_anchors (now "
        f"{cfg.num_anchors}), or give the trainer a GPU of its own (`up --trainer-gpus`).")


class Trainer:
    def __init__(self, run: Run, device: str = "cpu", progress: bool = True, ranks: Ranks | None = None):
        """`ranks`: this process's place in a group it has joined (trainer.ranks.Ranks.joined); default one rank."""
        self.run = run
        s = run.settings.train
        self.cfg = s
        self.ranks = ranks or Ranks()
        self.device = torch.device(device)
        self.progress = progress and self.ranks.leader
        self.head = TargetHead.from_pretrained(run.settings.model.path, dtype=resolve_dtype("auto", self.device),
                                               device=self.device)
        config = drafter_config(run, self.ranks.leader)
        torch.manual_seed(s.seed)
        self.drafter = DFlashDrafter(config).to(self.device)  # fp32 master weights, the same on every rank
        self.model = parallel.wrap(self.drafter, self.ranks, s.parallel, self.device)
        # horizon: train.total_steps, else the steps left for the chunks left of epoch 0's size (estimated or counted)
        self.schedule = WarmupCosine(s.warmup_ratio, s.total_steps or None)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), s.learning_rate, s.weight_decay,
                                                         self.schedule)
        self.ckpt_root = run.store.path("checkpoints")
        self.state, found = checkpoint.restore_group(self.ckpt_root, self.ranks, self.model, self.drafter.config,
                                                     self.optimizer, self.scheduler, self.device)
        self.prefetch = Prefetcher(run.store, defaults.READ_AHEAD_THREADS, pinned=self.device.type == "cuda")
        self.chunks = ChunkSource(run, self.ranks, self.prefetch)
        self.checkpoints = CheckpointPolicy(run, self.state)
        self.status = TrainerStatus(run, self.ranks, str(self.device), self.state)
        self.last_checkpoint_path = str(found) if found else None
        self.unacked_everywhere = 0  # over all ranks, as of the last step's offers
        self.stop_requested = False
        self.step_ended = time.perf_counter()  # the start of the first step's `between` (see _train)
        self.timing: dict[str, float] = {}  # where the last step's wall time went (see _train)
        if found is not None:
            self.status.log({"event": "resumed", "step": self.state.step, "checkpoint": str(found),
                             "ranks": self.ranks.world_size})

    @property
    def finished(self) -> bool:
        return self.state.epoch >= self.cfg.epochs

    def _advance_epoch(self, totals: dict[int, int | None], horizon_chunks: int | None) -> None:
        """From rank 0's counts, so that every rank moves on at the same step and sets the same horizon."""
        epochs.advance(self.state, totals)
        if horizon_chunks and not self.cfg.total_steps:
            epochs.follow_horizon(self.state, horizon_chunks, self.cfg.epochs, self.ranks.world_size * self.cfg.chunks_per_step,
                                  self.schedule, self.optimizer, self.scheduler)

    # --- training -------------------------------------------------------------------------------------------
    def _offer(self, held: list[Entry]) -> Offer:
        leader = self.ranks.leader
        totals, horizon_chunks = epochs.producer_counts(self.run) if leader else ({}, None)
        return Offer([(e.epoch, e.chunk) for e in held], self.chunks.pop_duplicates(),
                     self.chunks.unacknowledged_with(held), self.stop_requested, totals, horizon_chunks,
                     leader and self.checkpoints.overdue())

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
        self.timing["compute"] = busy - self.timing["read"]
        self.status.trained(len(held), tokens, busy)
        return RankStats(losses, correct.tolist(), count.tolist(), tokens), lr, grad_norm

    def _train_chunk(self, entry: Entry, scale: float, last: bool) -> tuple[float, torch.Tensor, torch.Tensor, int]:
        """Forward and backward of one chunk's micro-batches, the chunk's loss (each micro-batch's weighed by its
        share of the chunk's blocks, trainer.step.loss_shares) scaled by `scale`; only the step's last backward
        (`last`: of its last chunk) communicates. Returns loss, correct and valid rows per slot [B-1], tokens."""
        read_started = time.perf_counter()
        try:  # on the training device: an fp8 blob crosses as 1-byte values and is dequantized there
            samples = list(self.prefetch.get(entry.path).samples(self.device))
        except (BlobError, FileNotFoundError) as exc:
            self.status.log({"event": "unreadable blob", "chunk": entry.chunk, "error": str(exc)})
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
            raise out_of_memory(self.device, self.cfg, entry.chunk, len(group),
                                max(lengths[n] for n in group) * len(group)) from None
        return loss, correct, count, sum(lengths)

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
        self.chunks.trained(held)
        record = {"step": self.state.step, "epoch": chunks[0][0], "chunks": [c for _, c in chunks],
                  "loss": sum(losses) / len(losses), "acc": acc.tolist(), "eal": float(expected_acceptance_length(acc)),
                  "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "time": time.time(),
                  "seconds": {k: round(v, 4) for k, v in self.timing.items()}}  # rank 0's
        self.status.log(record)
        self._publish(loss=record["loss"], eal=record["eal"], lr=record["lr"])
        self.step_ended = time.perf_counter()
        return record

    def _publish(self, **extra) -> None:
        self.status.publish(self.state, len(self.chunks.unacked), self.unacked_everywhere, self.last_checkpoint_path,
                            **extra)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint_and_ack(self) -> None:
        self.last_checkpoint_path = checkpoint.save_group(self.ckpt_root, self.ranks, self.model, self.drafter.config,
                                                          self.optimizer, self.scheduler, self.state, self.device)
        self.chunks.ack(self.chunks.settle())  # only once the checkpoint holding them exists on every rank
        self.unacked_everywhere = 0  # every rank acknowledges with it
        self.checkpoints.saved(self.state)

    def run_until_done(self, max_steps: int | None = None) -> TrainReport:
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        last = {}
        columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}"))
        try:
            with Progress(*columns, disable=not self.progress) as bar:
                task = bar.add_task("train", total=None, status="waiting for blobs")
                self._advance_epoch(*self.ranks.from_leader(epochs.producer_counts(self.run) if self.ranks.leader else None))
                self._publish()
                steps_this_run = 0
                while not self.finished and (max_steps is None or steps_this_run < max_steps):
                    held = [] if self.stop_requested else self.chunks.take(self.state)
                    offers = self.ranks.gather(self._offer(held))
                    self.unacked_everywhere = sum(offer.unacknowledged for offer in offers)
                    for offer in offers:
                        for epoch, n in offer.duplicates.items():
                            self.state.duplicates_skipped[epoch] = self.state.duplicates_skipped.get(epoch, 0) + n
                    if any(offer.chunks for offer in offers):  # else nobody steps
                        if not self.stop_requested:
                            self.chunks.take_ahead(self.state, ahead_of={c for offer in offers for _, c in offer.chunks})
                        last = self._step(held, offers)
                        steps_this_run += 1
                    self._advance_epoch(offers[0].totals, offers[0].horizon_chunks)
                    if last:
                        counted = offers[0].horizon_chunks or self.cfg.total_steps
                        bar.update(task, completed=self.state.step, total=self.schedule.total if counted else None,
                                   status=f"epoch {self.state.epoch} loss {last['loss']:.3f} EAL {last['eal']:.2f}")
                    if any(offer.stop for offer in offers):
                        break
                    if self.checkpoints.due(self.state, offers[0].overdue, self.unacked_everywhere):
                        self.checkpoint_and_ack()
                # the last state, with the epoch counter past the finished epoch, is what a restart must see
                if self.checkpoints.unsaved(self.state):
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
