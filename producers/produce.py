"""`dflashq produce`: dataset -> tokenized, loss-masked samples -> chunks -> admitted under the backlog limit.

Tokenization runs in a process pool (ordered, so chunk ids stay deterministic); packing and admission run in
this process. Bad records are skipped, counted and written with file:line and reason to the rejects file.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflashq.chunk import Chunk, Sample, chunk_id, pack
from dflashq.exceptions import InputError
from dflashq.run import Run
from producers.admission import Admission, Outcome
from producers.records import Record, count_records, iter_records, require_input
from producers.tokenize import DROPPED_TOO_FEW_SUPERVISED, DROPPED_TOO_LONG, TokenizeResult, load_tokenizer, tokenize_record


@dataclasses.dataclass
class ProduceReport:
    records: int = 0
    kept: int = 0
    rejected: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_few_supervised: int = 0
    tokens: int = 0
    chunks: int = 0
    admitted: int = 0
    duplicates: int = 0
    already_stored: int = 0
    waited_seconds: float = 0.0
    seconds: float = 0.0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# --- tokenization worker processes -------------------------------------------------------------------------
_tokenizer = None
_options: dict = {}


def _init_worker(model_path: str, options: dict) -> None:
    global _tokenizer, _options
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallelism comes from the pool
    _tokenizer = load_tokenizer(model_path)
    _options = options


def _tokenize_batch(batch: list[tuple[int, Record]]) -> list[tuple[int, str, TokenizeResult]]:
    return [
        (index, record.source,
         TokenizeResult(rejected=record.error) if record.error is not None else tokenize_record(_tokenizer, record.data, **_options))
        for index, record in batch
    ]


def _batches(paths: list[str], size: int) -> Iterator[list[tuple[int, Record]]]:
    """Records of all files in order, numbered (unreadable ones too: they come back as rejections, in order)."""
    batch = []
    records = (record for path in paths for record in iter_records(path))
    for index, record in enumerate(records):
        batch.append((index, record))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenized(settings) -> Iterator[tuple[int, str, TokenizeResult]]:
    """The run's records in order as (index, source, outcome), in data.tokenize_processes processes."""
    options = {
        "max_length": settings.data.max_length,
        "on_long": settings.data.on_long,
        "min_supervised": settings.data.min_supervised_tokens,
    }
    batches = _batches(settings.data.paths, settings.data.tokenize_batch)
    if settings.data.tokenize_processes == 1:
        _init_worker(settings.model.path, options)
        for batch in map(_tokenize_batch, batches):
            yield from batch
        return
    ctx = multiprocessing.get_context("spawn")  # fork after torch/tokenizers threads have started is unsafe
    with ctx.Pool(settings.data.tokenize_processes, _init_worker, (settings.model.path, options)) as pool:
        for batch in pool.imap(_tokenize_batch, batches, chunksize=1):
            yield from batch


# --- the producer ------------------------------------------------------------------------------------------
def produce(run: Run, epochs: int | None = None, progress: bool = True) -> ProduceReport:
    """Admit every chunk of the dataset for `epochs` epochs (default: all training epochs when blobs are
    deleted after training, since each epoch then re-extracts; one epoch when they are kept)."""
    settings = run.settings
    if not settings.data.paths:
        raise InputError("No input data: set data.paths (or pass input files to `dflashq produce`).")
    for path in settings.data.paths:
        require_input(path)
    load_tokenizer(settings.model.path)  # fail fast, with one sentence, before starting the pool
    if epochs is None:
        epochs = settings.train.epochs if settings.store.retention == "delete" else 1
    admission = Admission(
        run.conn, settings.run, run.store,
        settings.backpressure.max_backlog, settings.backpressure.max_store_bytes, settings.workers.job_timeout,
        settings.backpressure.poll_seconds,
    )
    fingerprint = run.manifest["data_fingerprint"]
    counts = [count_records(p) for p in settings.data.paths]
    total_records = sum(c or 0 for c in counts) or None
    # the trainer's schedule needs epoch 0's size long before the producer has read it all (backpressure holds it back)
    countable = None if None in counts else total_records
    report = ProduceReport()
    start = time.monotonic()
    with _progress(progress) as bar:
        for epoch in range(epochs):
            task = bar.add_task(f"epoch {epoch}", total=total_records, status="")
            _produce_epoch(run, admission, fingerprint, epoch, report, bar, task, first_epoch=epoch == 0,
                           total_records=countable)
            if run.conn.exists(run.keys.draining):
                break
    report.seconds = time.monotonic() - start
    run.conn.hset(run.keys.producer, mapping={f.name: json.dumps(getattr(report, f.name)) for f in dataclasses.fields(report)})
    return report


def estimate_chunks(chunks: int, packed_tokens: int, read_tokens: int, records: int, total_records: int) -> int:
    """Epoch 0's chunks, estimated while the producer reads it: the `chunks` so far, holding `packed_tokens`, scaled
    by the tokens the whole input should give (`read_tokens` kept from the first `records` of `total_records`).
    Tokens, not samples: within a sort window the chunks hold first many short samples, then few long ones."""
    expected = total_records * read_tokens / max(1, records)
    return max(chunks, round(chunks * expected / max(1, packed_tokens)))


def _produce_epoch(run: Run, admission: Admission, fingerprint: str, epoch: int, report: ProduceReport, bar, task,
                   first_epoch: bool, total_records: int | None) -> None:
    settings = run.settings
    rejects_file = None
    if first_epoch and not run.store.remote:
        rejects_path = run.store.path(settings.data.rejects_file)
        os.makedirs(os.path.dirname(rejects_path), exist_ok=True)
        rejects_file = open(rejects_path, "w", encoding="utf-8")

    read_tokens = 0  # of the samples kept so far, those still in the sort window too

    def samples() -> Iterator[Sample]:
        nonlocal read_tokens
        for index, source, result in tokenized(settings):
            bar.advance(task)
            if not first_epoch:  # later epochs re-admit the same samples; count them once
                if result.kept:
                    yield Sample(result.input_ids, result.loss_mask, index)
                continue
            report.records += 1
            report.truncated += result.truncated
            if result.rejected is not None:
                report.rejected += 1
                report.reasons[result.rejected] += 1
                if rejects_file:
                    rejects_file.write(json.dumps({"source": source, "reason": result.rejected}) + "\n")
            elif result.dropped == DROPPED_TOO_LONG:
                report.dropped_too_long += 1
            elif result.dropped == DROPPED_TOO_FEW_SUPERVISED:
                report.dropped_few_supervised += 1
            else:
                report.kept += 1
                read_tokens += len(result.input_ids)
                yield Sample(result.input_ids, result.loss_mask, index)

    chunks = packed_tokens = 0
    try:
        for group in pack(samples(), settings.data.chunk_tokens, settings.data.sort_window):
            if run.conn.exists(run.keys.draining):
                bar.update(task, status="[yellow]draining: admission stopped")
                return
            chunk = Chunk(chunk_id(settings.run, fingerprint, epoch, group[0].index, group[-1].index), epoch, group)
            chunks += 1
            packed_tokens += chunk.tokens
            report.chunks += 1
            report.tokens += chunk.tokens
            if first_epoch and total_records:
                run.conn.set(run.keys.epoch_estimate,
                             estimate_chunks(chunks, packed_tokens, read_tokens, report.records, total_records))
            _admit(admission, chunk, report, bar, task)
        run.conn.set(run.keys.epoch_total(epoch), chunks)
    finally:
        if rejects_file:
            rejects_file.close()


def _admit(admission: Admission, chunk: Chunk, report: ProduceReport, bar, task) -> None:
    waiting_since = []

    def on_wait():
        if not waiting_since:
            waiting_since.append(time.monotonic())
        bar.update(task, status=f"[yellow]waiting on backlog {admission.backlog()}/{admission.max_backlog}, "
                                f"store {admission.store_bytes() / 1e9:.2f}/{admission.max_store_bytes / 1e9:.2f} GB")

    outcome = admission.admit(chunk, on_wait)
    if waiting_since:  # only time spent over a backpressure limit counts as waiting
        report.waited_seconds += time.monotonic() - waiting_since[0]
    if outcome is Outcome.ADMITTED:
        report.admitted += 1
    elif outcome is Outcome.DUPLICATE:
        report.duplicates += 1
    else:
        report.already_stored += 1
    bar.update(task, status=f"{report.admitted} chunks admitted")


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), disable=not enabled, transient=False,
    )
