"""Recovery of chunks held by dead workers: re-queued at the FRONT of their queue, never failed, never lost.

A worker holds a chunk in two ways: as RQ's started job (forward running), and, after the job returned, as an
unannounced chunk whose blob is still being compressed and written in its writer threads. A worker is dead when
its RQ key has expired (no heartbeat for `worker_ttl` seconds), or, for a restart on the same host, at once when
its recorded pid no longer runs. RQ alone would move an abandoned job to the failed registry; we usually get there
first, and where RQ's own registry cleanup got there first (after a Redis outage every worker's heartbeats lapse at
once), the chunk is taken back out of the failed registry and re-queued at the front just the same. A third way
to lose a chunk: RQ pops a job from several queues with a plain BLPOP (its copy-keeping BLMOVE serves one queue only),
so a worker that loses Redis or dies between the pop and recording the start leaves a queued chunk in no list; such
an orphan is re-queued once it has stayed so for defaults.ORPHAN_SECONDS.
"""

from __future__ import annotations

import os
import socket

import redis
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import current_timestamp
from rq.worker_registration import unregister

from dflashq import defaults
from dflashq.budget import release_all
from dflashq.keys import Keys


def unannounced_key(keys: Keys, worker_name: str) -> str:
    """Chunks whose job returned on `worker_name` but whose blob is not yet announced."""
    return f"{keys.prefix}unannounced:{worker_name}"


def _worker_alive(conn: redis.Redis, name: str) -> bool:
    return bool(conn.exists(Worker.redis_worker_namespace_prefix + name))


def pid_running(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def local_worker_dead(conn: redis.Redis, name: str) -> bool:
    """True when `name` is registered by a process of THIS host that no longer runs (a crashed predecessor)."""
    key = Worker.redis_worker_namespace_prefix + name
    hostname, pid = conn.hmget(key, "hostname", "pid")
    if hostname is None or pid is None:
        return False
    return hostname.decode() == socket.gethostname() and not pid_running(int(pid))


def requeue_front(conn: redis.Redis, job: Job) -> None:
    """Put `job` back at the front of its queue, out of the started registry."""
    queue = Queue(job.origin, connection=conn, serializer=JSONSerializer)
    registry = StartedJobRegistry(queue=queue)
    # Entries are "<job id>:<execution id>"; a dead worker's execution records may already have expired.
    entries = [e for e in conn.zrange(registry.key, 0, -1) if e.decode().split(":")[0] == job.id]
    with conn.pipeline() as pipe:
        if entries:
            pipe.zrem(registry.key, *entries)
        job.set_status(JobStatus.QUEUED, pipeline=pipe)
        job.worker_name = None
        queue.push_job_id(job.id, pipeline=pipe, at_front=True)
        pipe.execute()


def release_worker(conn: redis.Redis, keys: Keys, name: str, queues: list[Queue]) -> list[str]:
    """Re-queue (front) every chunk `name` held, then free its name. Call only for a dead worker."""
    requeued = []
    finished = keys.finished
    for queue in queues:
        registry = StartedJobRegistry(queue=queue)
        for job_id, _ in registry.get_job_and_execution_ids(cleanup=False):
            try:
                job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
            except NoSuchJobError:
                continue
            if job.worker_name == name:
                requeue_front(conn, job)
                requeued.append(job_id)
    pending = unannounced_key(keys, name)
    for raw in conn.smembers(pending):
        job_id = raw.decode()
        if not conn.sismember(finished, job_id) and job_id not in requeued:
            try:
                job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
            except NoSuchJobError:
                continue
            requeue_front(conn, job)
            requeued.append(job_id)
    conn.delete(pending)
    release_all(conn, keys, name)
    if requeued:
        conn.incrby(keys.requeued, len(requeued))
    worker = Worker(queues or [Queue(keys.shared_queue, connection=conn)], name=name, connection=conn)
    unregister(worker)
    conn.delete(worker.key)
    return requeued


def recover(conn: redis.Redis, keys: Keys, queues: list[Queue]) -> list[str]:
    """Find chunks held by workers that are dead (key expired) and re-queue them. Safe to run from anywhere,
    any number of times, concurrently: a chunk re-queued twice runs twice and is announced once."""
    holders: set[str] = set()
    now = current_timestamp()
    for queue in queues:
        registry = StartedJobRegistry(queue=queue)
        # entries whose execution heartbeat lapsed: their worker stopped beating
        for entry in conn.zrangebyscore(registry.key, 0, now):
            job_id = entry.decode().split(":")[0]
            try:
                job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
            except NoSuchJobError:
                conn.zrem(registry.key, entry)
                continue
            if job.worker_name and not _worker_alive(conn, job.worker_name):
                holders.add(job.worker_name)
    prefix = unannounced_key(keys, "")
    for key in conn.scan_iter(match=prefix + "*"):
        name = key.decode()[len(prefix):]
        if conn.scard(key) and not _worker_alive(conn, name):
            holders.add(name)
    requeued = []
    for name in sorted(holders):
        requeued += release_worker(conn, keys, name, queues)
    return requeued + reclaim_abandoned(conn, keys, queues) + reclaim_orphans(conn, keys)


ABANDONED = "due to AbandonedJobError"  # what RQ's StartedJobRegistry.cleanup writes into a job it moves to failed


def reclaim_abandoned(conn: redis.Redis, keys: Keys, queues: list[Queue]) -> list[str]:
    """Chunks that RQ's registry cleanup moved to the failed registry as abandoned (their worker died, or lost
    Redis): a dead worker is never a chunk's fault, so each goes back to the front of its queue. Chunks that
    failed for a reason of their own stay failed."""
    reclaimed = []
    for queue in queues:
        failed = FailedJobRegistry(queue=queue)
        for job_id in failed.get_job_ids():
            try:
                job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
            except NoSuchJobError:
                continue
            result = job.latest_result()
            reason = (result.exc_string if result is not None else None) or job.exc_info or ""
            if ABANDONED not in reason or conn.sismember(keys.finished, job_id):
                continue
            if conn.zrem(failed.key, job_id):  # one of several recovering workers takes it
                requeue_front(conn, job)
                reclaimed.append(job_id)
    if reclaimed:
        conn.incrby(keys.requeued, len(reclaimed))
    return reclaimed


def reclaim_orphans(conn: redis.Redis, keys: Keys) -> list[str]:
    """Chunks in flight whose job is queued yet in no queue list (popped by a worker that then lost Redis or died),
    each re-queued at the front of its queue once two sightings defaults.ORPHAN_SECONDS apart (Redis's clock) found
    it so: a live worker's pop-to-start gap never lasts that long. Reads two job fields per chunk, never its
    payload: a job is fetched whole only to be re-queued."""
    reclaimed = []
    now_s = conn.time()[0]
    for raw in conn.smembers(keys.inflight):
        job_id = raw.decode()
        seen = keys.orphan_seen(job_id)
        status, origin = conn.hmget(Job.key_for(job_id), "status", "origin")  # both None: not yet enqueued
        orphaned = (status == JobStatus.QUEUED.value.encode() and not conn.sismember(keys.finished, job_id)
                    and conn.lpos(Queue.redis_queue_namespace_prefix + origin.decode(), job_id) is None)
        if not orphaned:
            conn.delete(seen)
            continue
        if conn.set(seen, now_s, nx=True, ex=24 * 3600):
            continue  # first sighting
        first = conn.get(seen)
        if first is not None and now_s - int(first) >= defaults.ORPHAN_SECONDS and conn.delete(seen):
            try:  # the delete above let one of several recovering workers take it
                requeue_front(conn, Job.fetch(job_id, connection=conn, serializer=JSONSerializer))
            except NoSuchJobError:
                continue
            reclaimed.append(job_id)
    if reclaimed:
        conn.incrby(keys.requeued, len(reclaimed))
    return reclaimed
