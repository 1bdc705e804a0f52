"""`dflashq regenerate`: the dataset's assistant turns replaced by the target's own responses, before `produce`.

Reads what the producer reads (records.py, conversation.py). Every input record gets a stable key (its `id`, else a
hash of its content) and becomes at most one line of an append-only JSONL output in the `messages` format, with the
key in `id` and the record's `file:line` in `source`. Assistant turns are made one at a time, each from the
already-regenerated history before it; system, user and tool turns are kept. Records are answered a turn per engine
call from a pool refilled from the input, and those a call finishes are written, flushed and fsynced together (in
the order they finish), so a rerun skips every key already written; a torn last line (a crash
mid-write) is cut off and its record redone; a lock on the output keeps a second run off it. Rejected records go to `<out>.rejects.jsonl`, records the engine could
not answer to `<out>.failed.jsonl` (`<out>` without .jsonl); both are rewritten by each run, whose rerun finds the
rejects again and retries the failures. The input is only read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflashq.exceptions import InputError, RejectedSample
from dflashq.settings import Settings
from producers.conversation import Conversation, Pretokenized, normalize
from producers.records import count_records, iter_records

if TYPE_CHECKING:  # only for annotations: the engines bring torch, which checking the paths does not need
    from producers.engines import Engine, Reply

PRETOKENIZED = "pre-tokenized records cannot be regenerated"


@dataclasses.dataclass
class RegenerateReport:
    out: str
    rejects_file: str
    failed_file: str
    records: int = 0  # input records read, bad ones included
    already_done: int = 0  # keys an earlier run wrote
    duplicates: int = 0  # keys seen before in this run's input: written once
    regenerated: int = 0
    rejected: int = 0
    failed: int = 0
    truncated_turns: int = 0  # assistant turns cut at regenerate.max_new_tokens
    tokens: int = 0  # generated tokens
    seconds: float = 0.0
    torn_line_dropped: bool = False
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclasses.dataclass
class _Pending:
    """One record being regenerated: the source conversation and the regenerated turns so far."""

    key: str
    source: str
    conversation: Conversation
    messages: list[dict] = dataclasses.field(default_factory=list)
    position: int = 0  # next source message to copy or answer
    error: str | None = None

    def advance(self) -> bool:
        """Copy the source turns up to its next assistant turn; True if the target must speak now."""
        source = self.conversation.messages
        while self.position < len(source) and source[self.position]["role"] != "assistant":
            self.messages.append(source[self.position])
            self.position += 1
        return self.position < len(source)

    def answer(self, reply: Reply) -> None:
        self.messages.append(reply.message())
        self.position += 1


def record_key(data: dict) -> str:
    """The record's own `id` (a string or integer), else a hash of its content (the same on every run)."""
    own = data.get("id")
    if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own):
        return str(own)
    # default=str: Parquet and datasets rows may hold timestamps or bytes, which JSON has no type for
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def side_files(out: str) -> tuple[str, str]:
    """The rejects and failed files next to the output."""
    stem = out.removesuffix(".jsonl")
    return f"{stem}.rejects.jsonl", f"{stem}.failed.jsonl"


def resolve_inputs(settings: Settings, inputs: list[str], out: str) -> list[str]:
    """The inputs (default: data.paths), checked to exist in a format the producer reads and to differ from the
    output, which must be .jsonl."""
    paths = list(inputs) or settings.data.paths
    if not paths:
        raise InputError("No input data: set data.paths (or pass input files to `dflashq regenerate`).")
    if not out.endswith(".jsonl"):
        raise InputError(f"Output {out} must end in .jsonl, the format `dflashq produce` reads.")
    for path in paths:
        iter_records(path)  # raises for a missing input or an unknown format; reads nothing yet
        if os.path.realpath(path) == os.path.realpath(out):
            raise InputError(f"Output {out} is also an input: write the regenerated conversations to a new file.")
    return paths


def regenerate(settings: Settings, inputs: list[str], out: str, engine: Engine, progress: bool = True) -> RegenerateReport:
    """Append to `out` the regenerated conversation of every record of `inputs` (default: data.paths) not in it yet."""
    paths = resolve_inputs(settings, inputs, out)
    report = RegenerateReport(out, *side_files(out))
    total = sum(count_records(path) or 0 for path in paths) or None
    start = time.monotonic()
    with contextlib.ExitStack() as files:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            output = files.enter_context(open(out, "ab"))
            try:  # two runs appending to one output would both write the records neither had seen yet
                fcntl.flock(output, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InputError(f"Output {out} is being written by another `dflashq regenerate`; wait for it to end.") from None
            done, report.torn_line_dropped = _resume(out)
            rejects = files.enter_context(open(report.rejects_file, "w", encoding="utf-8"))
            failed = files.enter_context(open(report.failed_file, "w", encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"Cannot write {exc.filename} ({exc.strerror}): choose another --out.") from None
        bar = files.enter_context(_progress(progress))
        task = bar.add_task("regenerating", total=total, speed="")

        def on_tokens(tokens: int) -> None:
            report.tokens += tokens
            bar.update(task, speed=f"{report.tokens / (time.monotonic() - start):,.0f} generated tokens/s")

        def on_reject(source: str, reason: str) -> None:
            report.rejected += 1
            report.reasons[reason] += 1
            rejects.write(json.dumps({"source": source, "reason": reason}) + "\n")
            bar.advance(task)

        def on_skip() -> None:
            bar.advance(task)

        def write(finished: list[_Pending]) -> None:
            for item in finished:
                if item.error is not None:
                    report.failed += 1
                    failed.write(json.dumps({"id": item.key, "source": item.source, "reason": item.error}) + "\n")
                    continue
                report.regenerated += 1
                line = {"id": item.key, "source": item.source, "messages": item.messages}
                if item.conversation.tools:
                    line["tools"] = item.conversation.tools
                # ASCII escapes: a lone surrogate from the input cannot break the UTF-8 encoding of the line
                output.write(json.dumps(line).encode() + b"\n")
            output.flush()
            os.fsync(output.fileno())  # the call's lines survive a crash of the machine, not just of this process
            failed.flush()
            bar.advance(task, len(finished))

        for finished in _rounds(_pending(paths, done, report, on_reject, on_skip), engine, report, on_tokens):
            write(finished)
    report.seconds = time.monotonic() - start
    return report


def _resume(out: str) -> tuple[set[str], bool]:
    """The keys already in the output, and whether a torn last line (one without its newline) was cut off."""
    if not os.path.exists(out):
        return set(), False
    done: set[str] = set()
    end = 0
    with open(out, "rb+") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):  # lines are written whole with their newline: this one was cut short
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
                return done, True
            try:
                data = json.loads(line)
                key = data["id"] if "messages" in data else None
            except (ValueError, TypeError, KeyError):
                key = None
            if not isinstance(key, str):
                raise InputError(f"Output {out} line {number} is no regenerated conversation: give --out a new file or "
                                 f"the output of an earlier `dflashq regenerate`.")
            done.add(key)
            end += len(line)
    return done, False


def _pending(paths: list[str], done: set[str], report: RegenerateReport, on_reject, on_skip) -> Iterator[_Pending]:
    """The records still to regenerate, in input order; rejects, already-done keys and duplicates are counted."""
    seen: set[str] = set()
    for record in (record for path in paths for record in iter_records(path)):
        report.records += 1
        if record.error is not None:
            on_reject(record.source, record.error)
            continue
        try:
            sample = normalize(record.data)
        except RejectedSample as exc:
            on_reject(record.source, exc.reason)
            continue
        if isinstance(sample, Pretokenized):
            on_reject(record.source, PRETOKENIZED)
            continue
        key = record_key(record.data)
        if key in seen:
            report.duplicates += 1
            on_skip()
        elif key in done:
            seen.add(key)
            report.already_done += 1
            on_skip()
        else:
            seen.add(key)
            yield _Pending(key, record.source, sample)


def _rounds(items: Iterator[_Pending], engine: Engine, report: RegenerateReport, on_tokens) -> Iterator[list[_Pending]]:
    """Engine calls over a pool of records that each wait for their next assistant turn; yields after each call the
    records it finished (every turn answered, or failed). The pool is refilled from the input before every call, so
    a record at its tenth turn shares a call with records at their first: no call is spent on a few long chats, and
    finished records are written as they finish rather than when the slowest of a fixed batch is done."""
    pool: list[_Pending] = []
    while True:
        finished = []
        for item in itertools.islice(items, max(0, engine.batch_size - len(pool))):
            (pool if item.advance() else finished).append(item)  # a record with no assistant turn is written as is
        if not pool:
            if finished:
                yield finished
            return
        replies = engine.respond([Conversation(item.messages, item.conversation.tools) for item in pool])
        on_tokens(sum(reply.tokens for reply in replies))
        waiting = []
        for item, reply in zip(pool, replies):
            item.error = reply.error or _empty(reply)
            if item.error is None:
                report.truncated_turns += reply.truncated
                item.answer(reply)
            (waiting if item.error is None and item.advance() else finished).append(item)
        pool = waiting
        yield finished


def _empty(reply: Reply) -> str | None:
    """Why a reply is unusable though the engine answered: `produce` rejects an assistant turn with no content."""
    if reply.content.strip() or reply.tool_calls:
        return None
    return "empty response" + (" (cut at regenerate.max_new_tokens)" if reply.truncated else "")


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
        TimeElapsedColumn(), TextColumn("{task.fields[speed]}"), disable=not enabled, transient=False,
    )


def open_engine(settings: Settings, name: str, device: str | None = None, endpoint: str | None = None) -> Engine:
    """The engine `name` (endpoint, transformers or vllm), a context manager that frees what it holds: `dflashq
    regenerate` and the quality benchmark choose through this one place. `device`: cuda:0 where a GPU is visible,
    else the CPU. Without vLLM installed, vllm fails here in one sentence, before torch and the tokenizer load."""
    if name == "vllm":
        from dflashq.vllm_target import require_vllm

        require_vllm()
    import torch  # the engines bring torch; checking the paths first (resolve_inputs) does not need it

    from producers.engines import EndpointEngine

    if name == "endpoint":
        return EndpointEngine(endpoint, settings.regenerate)
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "vllm":
        from producers.vllm_engine import VllmEngine  # imports vLLM: only when asked for

        return VllmEngine(settings, device)
    from producers.engine_processes import local_engine

    return local_engine(settings, device)
