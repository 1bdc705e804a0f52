"""`dflashq train`: the trainer daemon. Consumes finished blobs with backpressure and trains each chunk exactly once
per epoch, even when it is killed.

One optimizer step per chunk (its samples in micro-batches of at most `train.micro_batch_tokens` padded tokens,
gradients accumulated). Exactly once: the checkpoint records the chunk ids trained in each epoch; stream entries
are acknowledged (freeing backlog and store budget, and with retention `delete` removing the blob) only after
the checkpoint that contains them. After a crash the model rolls back to its checkpoint, and the entries trained
since then come back as this consumer's pending entries and are trained again; entries of chunks the checkpoint
already holds are acknowledged and counted as duplicates, never trained twice.
Checkpoints come every `checkpoint_every_steps` steps or `checkpoint_every_minutes`, and also whenever half the
backlog limit (or half the store budget) is held unacknowledged, since the producer waits on exactly that.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import socket
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflashq import manifest
from dflashq.blob import decode_blob
from dflashq.chunk import micro_batches
from dflashq.exceptions import BlobError
from dflashq.run import Run
from dflashq.target import resolve_dtype
from trainer import checkpoint
from trainer.consumer import Entry, ResultsConsumer
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.loss import expected_acceptance_length
from trainer.mask_token import resolve_mask_token
from trainer.step import WarmupCosine, build_optimizer, collate, train_step
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


class Trainer:
    def __init__(self, run: Run, device: str = "cpu", progress: bool = True):
        self.run = run
        s = run.settings.train
        self.cfg = s
        self.device = torch.device(device)
        self.progress = progress
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
                                                  rope_theta=s.rope_theta, **shape)
        first_choice = run.manifest.get("mask_token_id") is None  # recorded only once the config is known valid
        run.manifest = manifest.join(run.conn, run.store, {"run": run.settings.run, "mask_token_id": mask.id})
        if first_choice:  # said once per run; the manifest and the export keep it
            print(f"MASK token id {mask.id}: {mask.reason} (recorded in the run manifest).", flush=True)
        torch.manual_seed(s.seed)
        self.drafter = DFlashDrafter(config).to(self.device)  # fp32 master weights
        # horizon: train.total_steps, else (chunks per epoch x epochs) once the producer has counted an epoch
        self.schedule = WarmupCosine(s.warmup_ratio, s.total_steps or 1)
        self.optimizer, self.scheduler = build_optimizer(self.drafter, s.learning_rate, s.weight_decay, self.schedule)
        self.generator = torch.Generator(device=self.device).manual_seed(s.seed)
        self.ckpt_root = run.store.path("checkpoints")
        self.state = checkpoint.TrainState()
        found = checkpoint.latest(self.ckpt_root)
        if found is not None:
            self.state = checkpoint.restore(found, self.drafter, self.optimizer, self.scheduler, self.generator)
        self.consumer = ResultsConsumer(run.conn, run.keys, f"{socket.gethostname()}.trainer", s.claim_idle_seconds)
        self.unacked: list[Entry] = []
        self._store_order: tuple[int, list[str]] = (-1, [])  # retention `keep`: (epoch, its chunks still to train)
        self.last_checkpoint = time.monotonic()
        self.steps_at_checkpoint = self.state.step
        self.epoch_at_checkpoint = self.state.epoch
        self.last_checkpoint_path = str(found) if found else None
        self.stop_requested = False
        self.started = time.time()
        self.steps_at_start = self.state.step
        self.log_path = run.store.path(s.log_file)
        if found is not None:
            self._log({"event": "resumed", "step": self.state.step, "checkpoint": str(found)})

    # --- epochs -------------------------------------------------------------------------------------------
    def _epoch_total(self, epoch: int) -> int | None:
        raw = self.run.conn.get(self.run.keys.epoch_total(epoch if self.run.settings.store.retention == "delete" else 0))
        return int(raw) if raw is not None else None

    def _epoch_done(self, epoch: int) -> bool:
        total = self._epoch_total(epoch)
        return total is not None and len(self.state.consumed_in(epoch)) >= total

    def _advance_epoch(self) -> None:
        while self.state.epoch < self.cfg.epochs and self._epoch_done(self.state.epoch):
            self.state.epoch += 1
        per_epoch = self._epoch_total(0)
        if per_epoch and not self.cfg.total_steps:
            self.schedule.total = max(self.schedule.total, per_epoch * self.cfg.epochs)

    @property
    def finished(self) -> bool:
        return self.state.epoch >= self.cfg.epochs

    # --- sources of chunks ----------------------------------------------------------------------------------
    def _next_entries(self) -> list[Entry]:
        """Stream entries (every epoch with retention `delete`, epoch 0 with `keep`), or with `keep` after epoch
        0, the epoch-0 blobs from the store in a per-epoch shuffled order."""
        keep = self.run.settings.store.retention == "keep"
        if keep and self.state.epoch > 0:
            epoch = self.state.epoch
            if self._store_order[0] != epoch:  # once per epoch, not per step: its order, less what is trained
                done = set(self.state.consumed_in(epoch))
                order = sorted(self.state.consumed_in(0))
                random.Random(self.cfg.seed + epoch).shuffle(order)
                self._store_order = (epoch, [c for c in reversed(order) if c not in done])  # reversed: pop() takes the next
            remaining = self._store_order[1]
            if not remaining:
                return []
            chunk = remaining.pop()
            return [Entry("", chunk, self.run.store.blob_path(chunk, 0), epoch, 0)]
        return self.consumer.read(count=1, block_ms=1000)

    # --- training -------------------------------------------------------------------------------------------
    def _train_chunk(self, entry: Entry) -> tuple[float, list[float], float, float, float, int]:
        """One optimizer step over the chunk's samples; returns loss, per-slot accuracy, EAL, lr, grad norm, tokens."""
        # on the training device: an fp8 blob crosses as 1-byte values and is dequantized there
        samples = list(decode_blob(self.run.store.read(entry.path)).samples(self.device))
        lengths = [int(ids.shape[0]) for _, ids, _ in samples]
        groups = micro_batches(lengths, self.cfg.micro_batch_tokens)
        loss, correct, count = 0.0, 0, 0
        for i, group in enumerate(groups):
            stats = train_step(self.drafter, self.head, collate([samples[j] for j in group], self.device),
                               self.optimizer, self.scheduler, num_anchors=self.cfg.num_anchors,
                               grad_clip=self.cfg.grad_clip, loss_chunk_rows=self.cfg.loss_chunk_rows,
                               generator=self.generator, accumulate=len(groups), apply=i == len(groups) - 1,
                               attention=self.cfg.attention)
            loss += stats.loss / len(groups)
            correct, count = correct + stats.correct, count + stats.count
        acc = correct / count.clamp_min(1)  # [B-1] over the whole chunk
        return loss, acc.tolist(), float(expected_acceptance_length(acc)), stats.lr, stats.grad_norm, sum(lengths)

    def _log(self, record: dict) -> None:
        if self.run.store.remote:
            return
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _publish(self, **extra) -> None:
        s = self.state
        data = {"step": s.step, "epoch": s.epoch, "epochs": self.cfg.epochs,
                "consumed": len(s.consumed_in(s.epoch)) if not self.finished else len(s.consumed_in(self.cfg.epochs - 1)),
                "consumed_total": sum(len(v) for v in s.consumed.values()),
                "duplicates_skipped": sum(s.duplicates_skipped.values()), "tokens": s.tokens,
                "unacknowledged": len(self.unacked), "checkpoint": self.last_checkpoint_path,
                "updated": time.time(), "started": self.started, "steps_since_start": s.step - self.steps_at_start,
                **extra}
        self.run.conn.hset(self.run.keys.trainer, mapping={k: json.dumps(v) for k, v in data.items()})

    def _checkpoint_due(self) -> bool:
        if self.state.step == self.steps_at_checkpoint:
            return False
        bp = self.run.settings.backpressure
        held_bytes = int(self.run.conn.get(self.run.keys.store_bytes) or 0)
        return (self.state.step - self.steps_at_checkpoint >= max(1, self.cfg.checkpoint_every_steps)
                or time.monotonic() - self.last_checkpoint >= 60 * self.cfg.checkpoint_every_minutes
                or len(self.unacked) >= max(1, bp.max_backlog // 2)
                or held_bytes >= bp.max_store_bytes // 2)

    def checkpoint_and_ack(self) -> None:
        path = checkpoint.save(self.ckpt_root, self.drafter, self.optimizer, self.scheduler, self.state, self.generator)
        self.last_checkpoint_path = str(path)
        if self.run.settings.store.retention == "delete":
            for entry in self.unacked:  # trained and checkpointed: the blob has done its work
                self.run.store.delete(entry.path)
        self._ack(self.unacked)
        self.unacked = []
        self.last_checkpoint = time.monotonic()
        self.steps_at_checkpoint = self.state.step
        self.epoch_at_checkpoint = self.state.epoch

    def _ack(self, entries: list[Entry]) -> None:
        self.consumer.ack([e for e in entries if e.id])

    def _handle(self, entry: Entry, on_step) -> None:
        epoch_done = self.state.consumed_in(entry.epoch)
        if any(e.chunk == entry.chunk and e.epoch == entry.epoch for e in self.unacked):
            return  # trained since the last checkpoint and re-delivered (claimed back): acknowledged with it
        if entry.chunk in epoch_done:
            # already in the checkpoint: a re-delivery after a crash between checkpoint and ack
            # (its effect is already saved, so it is acknowledged at once, blob and all)
            self.state.duplicates_skipped[entry.epoch] = self.state.duplicates_skipped.get(entry.epoch, 0) + 1
            if self.run.settings.store.retention == "delete":
                self.run.store.delete(entry.path)
            self._ack([entry])
            return
        try:
            loss, acc, eal, lr, grad_norm, tokens = self._train_chunk(entry)
        except (BlobError, FileNotFoundError) as exc:
            self._log({"event": "unreadable blob", "chunk": entry.chunk, "error": str(exc)})
            raise
        self.state.step += 1
        self.state.tokens += tokens
        epoch_done.append(entry.chunk)
        if entry.id:
            self.unacked.append(entry)
        record = {"step": self.state.step, "epoch": entry.epoch, "chunk": entry.chunk, "loss": loss, "acc": acc,
                  "eal": eal, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "time": time.time()}
        self._log(record)
        self._publish(loss=loss, eal=eal, lr=lr)
        on_step(record)

    def run_until_done(self, max_steps: int | None = None) -> TrainReport:
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        last = {}
        columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}"))
        try:
            with Progress(*columns, disable=not self.progress) as bar:
                task = bar.add_task("train", total=None, status="waiting for blobs")

                def on_step(record):
                    last.update(record)
                    total = self._epoch_total(0)
                    bar.update(task, completed=self.state.step, total=total * self.cfg.epochs if total else None,
                               status=f"epoch {self.state.epoch} loss {record['loss']:.3f} EAL {record['eal']:.2f}")

                self._advance_epoch()
                self._publish()
                steps_this_run = 0
                while not self.finished and not self.stop_requested:
                    if max_steps is not None and steps_this_run >= max_steps:
                        break
                    for entry in self._next_entries():
                        before = self.state.step
                        self._handle(entry, on_step)
                        steps_this_run += self.state.step - before
                        if self._checkpoint_due():
                            self.checkpoint_and_ack()
                    self._advance_epoch()
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
        # finish the current step, checkpoint, acknowledge, exit
        self.stop_requested = True
