"""Per-worker and per-run control: the Python API behind restart-worker, pause, resume, requeue and drain.

Workers read their control key between chunks (and their heartbeat thread reads it during one), so these work for
workers on any host. A warm restart finishes the current chunk; `now` gives the chunk back to the front of its
queue at once and exits. A worker exits with status 75 (workers.worker.EXIT_RESTART) on either, and `dflashq up`
starts it again immediately; a worker not under `up` just stops and is started by whoever runs it.
"""

from __future__ import annotations

from rq import Worker
from rq.registry import FailedJobRegistry

from dflashq.exceptions import DflashqError
from dflashq.run import Run
from ops.status import run_queues


def _run_workers(run: Run) -> set[str]:
    return {w.name for q in run_queues(run) for w in Worker.all(queue=q)}


def restart_worker(run: Run, name: str, now: bool = False) -> None:
    if name not in _run_workers(run):
        known = ", ".join(sorted(_run_workers(run))) or "none"
        raise DflashqError(f"No worker named {name} in run '{run.settings.run}' (workers: {known}): check the name in `dflashq status`.")
    run.conn.set(run.keys.worker_control(name), "restart-now" if now else "restart", ex=3600)


def pause(run: Run, name: str | None = None) -> None:
    """Stop `name` (or every worker of the run) from taking new chunks; the current ones finish."""
    run.conn.sadd(run.keys.paused, name or "*")


def resume(run: Run, name: str | None = None) -> None:
    if name:
        run.conn.srem(run.keys.paused, name)
    else:
        run.conn.delete(run.keys.paused)


def requeue_failed(run: Run) -> list[str]:
    """Put every failed chunk of the run back in its queue (and in the backlog)."""
    requeued = []
    for queue in run_queues(run):
        registry = FailedJobRegistry(queue=queue)
        for job_id in registry.get_job_ids():
            run.conn.sadd(run.keys.inflight, job_id)
            registry.requeue(job_id)
            requeued.append(job_id)
    return requeued


def drain(run: Run) -> None:
    """Stop admitting new chunks; everything already admitted is extracted and trained."""
    run.conn.set(run.keys.draining, 1)
