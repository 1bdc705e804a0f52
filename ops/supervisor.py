"""`dflashq up`: the whole pipeline as supervised child processes (producer, workers, trainer: one process, or the
launcher of its ranks; ops.placement decides which GPUs each gets).

A child that crashes is started again with exponential backoff; a worker's chunks are re-queued (front) the moment
it is seen dead, before the restart. A worker that exits asking for a restart (`dflashq restart-worker`) starts
again at once. A child that exits twice in a row with a configuration or input error (exit 2: restarting cannot
mend it) stops the run, and `up` ends with that child's sentence. A trainer whose step ran out of memory (exit 3:
often another process held the GPU for a while) is started again up to defaults.OUT_OF_MEMORY_RETRIES times in a
row, each time saying what held the GPU, and stops the run only if it keeps running out. Ctrl-C or SIGTERM stops
everything gracefully: workers finish their chunk, the trainer checkpoints.
When the trainer has done its epochs, the workers and producer are stopped, the drafter is exported, and a summary
is printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from dflashq import defaults
from dflashq.connection import redact
from dflashq.exceptions import ChildFailed, RedisUnavailable, TrainerOutOfMemory
from dflashq.run import Run
from ops import status
from ops.launch import settings_args
from workers import recovery
from workers.worker import EXIT_RESTART, worker_name

EXIT_USER_ERROR = 2  # DflashqError.exit_code: the CLI printed one sentence naming what to fix
EXIT_OUT_OF_MEMORY = TrainerOutOfMemory.exit_code  # the CLI printed what held the memory and what shrinks the step
USER_ERRORS_TO_STOP = 2  # in a row; one may be a race with a command that fixes it (a manifest write, say)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
STOP_TIMEOUT_S = 300.0  # a worker finishing a long chunk, the trainer writing a checkpoint


@dataclasses.dataclass
class Child:
    kind: str  # producer | worker | trainer
    argv: list[str]
    name: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    start_after: float = 0.0
    done: bool = False
    user_errors: int = 0  # consecutive exits with EXIT_USER_ERROR
    out_of_memory: int = 0  # consecutive exits with EXIT_OUT_OF_MEMORY
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # its own, over the supervisor's (the trainer's GPUs)


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """The children's environment: the checkout first on PYTHONPATH (`python -m ops.cli` from any directory), then
    whatever the user had there (an install through `pip --target` lives only on PYTHONPATH)."""
    paths = [str(Path(__file__).resolve().parent.parent)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def last_sentence(log: Path) -> str | None:
    """What the child said last as a user error (the CLI's `dflashq: ...` line), from its log."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        lines = []
    said = next((line for line in reversed(lines) if line.startswith("dflashq: ")), None)
    return said[len("dflashq: "):] if said else None


def error_sentence(log: Path) -> str:
    said = last_sentence(log)
    return f"stopped the run: {said}" if said else "exited twice with a configuration or input error"


class Supervisor:
    def __init__(self, run: Run, workers: list[tuple[str, int]], trainer_args: list[str], log_dir: Path,
                 console: Console | None = None, trainer_env: dict[str, str] | None = None):
        """`trainer_args`: the trainer's device and ranks flags (ops.placement)."""
        settings = run.settings
        self.run = run
        self.console = console or Console()
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        common = settings_args(settings)
        base = [sys.executable, "-m", "ops.cli"]
        self.children = [Child("producer", base + ["produce", *common, "--no-progress"], "producer")]
        for device, index in workers:
            flags = ["--device", "cpu", "--index", str(index)] if device == "cpu" else ["--gpu", str(index)]
            self.children.append(Child("worker", base + ["worker", *common, *flags], worker_name(device, index)))
        self.children.append(Child("trainer", base + ["train", *common, *trainer_args, "--no-progress"], "trainer",
                                   env=trainer_env or {}))
        self.stopping = False
        self.failure: str | None = None  # a child's user error that stopped the run
        self.started_at = time.monotonic()

    # --- children -------------------------------------------------------------------------------------------
    def _log_path(self, child: Child) -> Path:
        return self.log_dir / f"{child.name}.log"

    def _spawn(self, child: Child) -> None:
        env = {**child_environment(os.environ), **child.env}
        log = open(self._log_path(child), "ab")
        # own session: Ctrl-C in the terminal reaches only the supervisor, which then stops children in order
        child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def _backoff(self, child: Child) -> float:
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, child.restarts - 1))

    def _poll(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.done:
                continue
            if child.proc is None:
                if now >= child.start_after and not self.stopping:
                    self._spawn(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.proc = None
            if code == 0 and child.kind in ("producer", "trainer"):
                child.done = True
                continue
            if child.kind == "worker":
                # its chunks go back to the front of the queue now, not after its heartbeat expires
                recovery.release_worker(self.run.conn, self.run.keys, child.name, status.run_queues(self.run))
            if self.stopping:
                child.done = True
                continue
            child.user_errors = child.user_errors + 1 if code == EXIT_USER_ERROR else 0
            child.out_of_memory = child.out_of_memory + 1 if code == EXIT_OUT_OF_MEMORY else 0
            if child.user_errors >= USER_ERRORS_TO_STOP:
                child.done = True
                self.failure = f"{child.name} {error_sentence(self._log_path(child))} (log: {self._log_path(child)})"
                continue
            if child.out_of_memory:
                said = last_sentence(self._log_path(child)) or "ran out of memory"
                if child.out_of_memory > defaults.OUT_OF_MEMORY_RETRIES:
                    child.done = True
                    self.failure = (f"{child.name} stopped the run after running out of memory {child.out_of_memory} "
                                    f"times in a row: {said} (log: {self._log_path(child)})")
                    continue
                self.console.log(f"{child.name} ran out of memory (try {child.out_of_memory} of "
                                 f"{defaults.OUT_OF_MEMORY_RETRIES + 1}): {said}")
            child.restarts += code != EXIT_RESTART
            delay = 0.0 if code == EXIT_RESTART else self._backoff(child)
            child.start_after = now + delay
            self.console.log(f"{child.name} exited with {code}; starting it again in {delay:.0f} s (see {self.log_dir / (child.name + '.log')})")

    def _trainer_done(self) -> bool:
        return next(c for c in self.children if c.kind == "trainer").done

    def _training_finished(self) -> bool:
        """Whether the trainer trained every epoch: it exits 0 too when a signal stopped it after a checkpoint."""
        return json.loads(self.run.conn.hget(self.run.keys.trainer, "done") or "false")

    def _drained(self) -> bool:
        return bool(self.run.conn.exists(self.run.keys.draining)) and self.run.conn.scard(self.run.keys.inflight) == 0

    def stop(self) -> None:
        """SIGTERM every child (warm stop), wait for them, SIGKILL what is left after STOP_TIMEOUT_S."""
        self.stopping = True
        running = [c for c in self.children if c.proc is not None]
        for child in running:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in running:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self._poll()

    # --- main loop ------------------------------------------------------------------------------------------
    def run_until_done(self, live: bool = True) -> bool:
        """True when the configured epochs were trained; False when stopped early by a signal."""
        interrupted = []
        outage = status.OutageWatch(self.run.settings.redis.url, self.run.settings.redis.outage_seconds)
        handlers = {sig: signal.signal(sig, lambda *_: interrupted.append(True)) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with Live(console=self.console, refresh_per_second=1, transient=True) if live else contextlib.nullcontext() as view:
                while not interrupted and not self.failure and not self._trainer_done() and not self._drained():
                    if outage.down():  # the children ride it through; their exits wait until Redis is back
                        if outage.given_up:
                            raise RedisUnavailable(f"Redis at {redact(self.run.settings.redis.url)} was unreachable "
                                                   "for longer than redis.outage_seconds: check that it is running, "
                                                   "then run `dflashq up` again (the run goes on where it stopped).")
                        if view is not None:
                            view.update(outage.render())
                        time.sleep(0.5)
                        continue
                    self._poll()
                    if view is not None:  # collecting status is a few dozen Redis round trips: only for a live view
                        view.update(status.render(status.collect(self.run), "up"))
                    time.sleep(0.5)
        finally:
            self.stop()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.failure:
            raise ChildFailed(self.failure)
        return self._trainer_done() and self._training_finished()

    def summary(self, exported: str | None) -> dict:
        data = status.collect(self.run)
        tokens = sum(int(f[b"tokens"]) for _, f in self.run.conn.xrange(self.run.keys.results))
        seconds = time.monotonic() - self.started_at
        trainer = data["trainer"]
        return {
            "run": self.run.settings.run,
            "chunks": data["chunks"],
            "tokens_extracted": tokens,
            "seconds": round(seconds, 1),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else 0.0,
            "epochs": f"{trainer.get('epoch', 0)}/{trainer.get('epochs', self.run.settings.train.epochs)}",
            "final_loss": trainer.get("loss"),
            "final_eal": trainer.get("eal"),
            "exported_drafter": exported,
            "restarts": {c.name: c.restarts for c in self.children if c.restarts},
        }
