"""Run status as one dict: the stable JSON interface of `dflashq status --json` (documented in docs/operations.md)."""

from __future__ import annotations

import datetime
import json
import time

from rq import Queue, Worker
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from dflashq.run import Run


def run_queues(run: Run) -> list[Queue]:
    """The run's shared queue and every per-worker queue of it."""
    # the shared queue always (workers listen on it before the first job exists), plus every known queue of the run
    names = {run.keys.shared_queue} | {q.name for q in Queue.all(connection=run.conn) if run.keys.is_run_queue(q.name)}
    return [Queue(name, connection=run.conn, serializer=JSONSerializer) for name in sorted(names)]


def _admitted(run: Run) -> int:
    return sum(run.conn.scard(key) for key in run.conn.scan_iter(match=run.keys.admitted("*"), count=1000))


def worker_progress(run: Run) -> dict[str, dict]:
    """What every worker that ever ran in the run last reported (tokens done, tokens/s), by name."""
    return {k.decode(): json.loads(v) for k, v in run.conn.hgetall(run.keys.workers).items()}


def trainer_ranks(run: Run, world_size: int | None = None) -> list[dict]:
    """What each trainer rank last reported (rank, consumer, host, device, pid, chunks, tokens,
    busy_tokens_per_second, unacknowledged), in rank order; with `world_size`, only the ranks of that world."""
    ranks = sorted((json.loads(v) for v in run.conn.hvals(run.keys.trainer_ranks)), key=lambda r: r["rank"])
    return [r for r in ranks if world_size is None or r["rank"] < world_size]


def rates(workers: list[dict], ranks: list[dict]) -> dict:
    """The run's extraction and training rates (tokens/s, each the sum over its workers or ranks of their rate
    while busy, so a side held back by the other still shows what it could do) and which of the two limits the run."""
    extraction = sum(w["busy_tokens_per_second"] for w in workers if w.get("busy_tokens_per_second")) or None
    training = sum(r["busy_tokens_per_second"] for r in ranks if r.get("busy_tokens_per_second")) or None
    limited_by = None
    if extraction and training:
        limited_by = "extraction" if extraction < training else "training"
    return {"extraction_tokens_per_second": extraction, "training_tokens_per_second": training,
            "limited_by": limited_by}


def _workers(run: Run, queues: list[Queue]) -> list[dict]:
    now = datetime.datetime.now(datetime.timezone.utc)
    progress = worker_progress(run)
    seen, out = set(), []
    for queue in queues:
        for worker in Worker.all(queue=queue):
            if worker.name in seen:
                continue
            seen.add(worker.name)
            beat = worker.last_heartbeat
            age = (now - beat.replace(tzinfo=datetime.timezone.utc)).total_seconds() if beat else None
            extra = progress.get(worker.name, {})
            out.append({
                "name": worker.name,
                "state": worker.get_state(),
                "current_chunk": worker.get_current_job_id(),
                "chunks_done": worker.successful_job_count,
                "chunks_failed": worker.failed_job_count,
                "tokens_per_second": extra.get("tokens_per_second"),
                "busy_tokens_per_second": extra.get("busy_tokens_per_second"),
                "seconds_per_chunk": extra.get("seconds_per_chunk"),
                "last_heartbeat_seconds_ago": round(age, 1) if age is not None else None,
                "paused": bool(run.conn.sismember(run.keys.paused, worker.name) or run.conn.sismember(run.keys.paused, "*")),
                "stuck": age is not None and age > 0.75 * run.settings.workers.worker_ttl,  # heartbeat late: the worker is wedged or its host is overloaded
            })
    return sorted(out, key=lambda w: w["name"])


def _failed(registries: list[FailedJobRegistry], limit: int = 20) -> list[dict]:
    """Failed chunks with the last line of their error, newest first."""
    out = []
    for registry in registries:
        for job_id in registry.get_job_ids()[:limit]:
            job = registry.job_class.fetch(job_id, connection=registry.connection, serializer=JSONSerializer)
            result = job.latest_result()
            reason = (result.exc_string or "").strip().splitlines()[-1] if result and result.exc_string else "unknown"
            out.append({"chunk": job_id, "reason": reason})
    return out[:limit]


def _eta_seconds(run: Run, trainer: dict) -> float | None:
    """Time left for the trainer at its pace so far in this process (None until both are known)."""
    per_epoch = run.conn.get(run.keys.epoch_total(0))
    # chunks, not steps: a step of N ranks trains N x train.chunks_per_step chunks (a trainer before ranks: 1)
    chunks, started = trainer.get("chunks_since_start", trainer.get("steps_since_start")), trainer.get("started")
    if per_epoch is None or not chunks or not started:
        return None
    remaining = int(per_epoch) * run.settings.train.epochs - trainer.get("consumed_total", 0)
    return max(0.0, remaining * (time.time() - started) / chunks)


def _trainer(run: Run) -> dict:
    raw = run.conn.hgetall(run.keys.trainer)
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def collect(run: Run) -> dict:
    settings = run.settings
    queues = run_queues(run)
    failed = [FailedJobRegistry(queue=q) for q in queues]
    trainer = _trainer(run)
    workers = _workers(run, queues)
    ranks = trainer_ranks(run, trainer.get("ranks"))
    return {
        "run": settings.run,
        "chunks": {
            "admitted": _admitted(run),
            "queued": sum(q.count for q in queues),
            "started": sum(StartedJobRegistry(queue=q).count for q in queues),
            "finished": int(run.conn.scard(run.keys.finished)),
            "failed": sum(r.count for r in failed),
            "requeued": int(run.conn.get(run.keys.requeued) or 0),
        },
        "backlog": {"current": int(run.conn.scard(run.keys.inflight)), "limit": settings.backpressure.max_backlog},
        "store": {"bytes": int(run.conn.get(run.keys.store_bytes) or 0), "limit": settings.backpressure.max_store_bytes,
                  "reserved": int(run.conn.get(run.keys.reserved_bytes) or 0)},
        "workers": workers,
        "trainer": trainer,
        "trainer_ranks": ranks,
        "rates": rates(workers, ranks),
        "failed": _failed(failed),
        "eta_seconds": _eta_seconds(run, trainer),
    }


def render(data: dict, redis_url: str):
    """The human view of `collect()`: a rich renderable."""
    from rich.console import Group
    from rich.table import Table

    chunks, backlog, store = data["chunks"], data["backlog"], data["store"]
    head = Table(title=f"run '{data['run']}'  ({redis_url})", show_header=False)
    head.add_row("chunks", "  ".join(f"{k} {v}" for k, v in chunks.items()))
    full = backlog["current"] >= backlog["limit"]
    head.add_row("backlog", f"{'[yellow]' if full else ''}{backlog['current']} / {backlog['limit']}")
    head.add_row("store", f"{store['bytes'] / 1e9:.3f} / {store['limit'] / 1e9:.3f} GB (+{store['reserved'] / 1e9:.3f} GB reserved by running chunks)")
    parts = [head]
    if data["workers"]:
        parts.append(_table("workers", ("name", "state", "current chunk", "done", "failed", "tokens/s", "heartbeat"), [
            [w["name"], w["state"] + (" (paused)" if w["paused"] else "") + (" [red]STUCK: heartbeat late[/]" if w["stuck"] else ""),
             w["current_chunk"] or "-", str(w["chunks_done"]), str(w["chunks_failed"]), _rate(w["tokens_per_second"]),
             f"{w['last_heartbeat_seconds_ago']:.0f}s ago" if w["last_heartbeat_seconds_ago"] is not None else "-"]
            for w in data["workers"]]))
    if data["eta_seconds"] is not None:
        head.add_row("ETA", f"{data['eta_seconds'] / 3600:.2f} h at the trainer's pace")
    extraction, training = data["rates"]["extraction_tokens_per_second"], data["rates"]["training_tokens_per_second"]
    if extraction or training:
        limit = f": {data['rates']['limited_by']} limits the run" if data["rates"]["limited_by"] else ""
        head.add_row("rates", f"extraction {_rate(extraction)} tokens/s, training {_rate(training)} tokens/s "
                              f"(while busy){limit}")
    if data["failed"]:
        parts.append(_table("failed chunks (dflashq requeue --failed)", ("chunk", "reason"),
                            [[f["chunk"], f["reason"]] for f in data["failed"]]))
    if data["trainer"]:
        trainer = Table(title="trainer", show_header=False)
        for k, v in data["trainer"].items():
            trainer.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
        parts.append(trainer)
    if data["trainer_ranks"]:
        parts.append(_table("trainer ranks", ("rank", "consumer", "host", "device", "chunks", "tokens/s", "unacknowledged"), [
            [str(r["rank"]), r["consumer"], r["host"], r["device"], str(r["chunks"]), _rate(r["busy_tokens_per_second"]),
             str(r["unacknowledged"])] for r in data["trainer_ranks"]]))
    return Group(*parts)


def _table(title: str, columns: tuple[str, ...], rows: list[list[str]]):
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def _rate(tokens_per_second: float | None) -> str:
    return f"{tokens_per_second:,.0f}" if tokens_per_second else "-"


class OutageWatch:
    """Whether the run's Redis answers right now, through a probe connection that never waits or retries, and since
    when it has not: what `status --watch` and `up`'s view show instead of the run's figures during an outage (the
    run's own clients keep retrying meanwhile, for up to redis.outage_seconds)."""

    def __init__(self, url: str, outage_seconds: float):
        import redis

        self.url, self.outage_seconds = url, outage_seconds
        self.probe = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        self.since: float | None = None

    def down(self) -> bool:
        import redis

        try:
            self.probe.ping()
        except (redis.ConnectionError, redis.TimeoutError):
            self.since = self.since or time.time()
            return True
        self.since = None
        return False

    @property
    def given_up(self) -> bool:
        """Down for longer than the run's clients wait: they have ended (or will) with the one sentence."""
        return self.since is not None and time.time() - self.since > self.outage_seconds

    def render(self):
        from rich.text import Text

        from dflashq.connection import redact

        since = self.since or time.time()
        return Text(f"Redis at {redact(self.url)} is unreachable since {time.strftime('%H:%M:%S', time.localtime(since))} "
                    f"({time.time() - since:.0f} s): the run's commands keep retrying for up to "
                    f"{self.outage_seconds:.0f} s (redis.outage_seconds), then stop with one sentence.", style="bold yellow")

