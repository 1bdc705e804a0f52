"""Admission of chunks under backpressure.

backlog = chunks queued + started + announced-but-unacknowledged = SCARD of the run's `inflight` set (a set,
so repeated adds and removes can never drift). A chunk is admitted only while backlog < max_backlog and
unacknowledged blob bytes < max_store_bytes; the check, the bookkeeping and the RQ enqueue run in ONE
optimistic transaction (WATCH/MULTI), so two producers together never exceed the limit.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from dflashq.budget import used_bytes
from dflashq.chunk import Chunk
from dflashq.keys import EXTRACT_FUNCTION, Keys
from dflashq.store import Store

FAILED_JOB_TTL = 30 * 24 * 3600  # failed chunks stay re-queueable for a month
FINISHED_JOB_TTL = 600  # the blob and the stream entry are the record; the job hash (with its tokens) can go


class Outcome(enum.Enum):
    ADMITTED = "admitted"
    DUPLICATE = "duplicate"  # already admitted in this epoch
    EXISTS = "exists"  # its blob is already in the store
    WAIT = "wait"  # over a backpressure limit


def run_queue(conn: redis.Redis, run: str) -> Queue:
    return Queue(Keys(run).shared_queue, connection=conn, serializer=JSONSerializer)


def build_job(queue: Queue, chunk: Chunk, job_timeout: int):
    return queue.create_job(
        EXTRACT_FUNCTION,
        args=(chunk.to_json(),),
        job_id=chunk.id,
        timeout=job_timeout,
        result_ttl=FINISHED_JOB_TTL,
        failure_ttl=FAILED_JOB_TTL,
        description=f"extract {chunk.id} ({len(chunk.samples)} samples, {chunk.tokens} tokens)",
        meta={"tokens": chunk.tokens, "samples": len(chunk.samples), "epoch": chunk.epoch},
    )


class Admission:
    def __init__(self, conn: redis.Redis, run: str, store: Store, max_backlog: int, max_store_bytes: int, job_timeout: int, poll_seconds: float = 0.5):
        self.conn = conn
        self.keys = Keys(run)
        self.store = store
        self.queue = run_queue(conn, run)
        self.max_backlog = max_backlog
        self.max_store_bytes = max_store_bytes
        self.job_timeout = job_timeout
        self.poll_seconds = poll_seconds

    def backlog(self) -> int:
        return int(self.conn.scard(self.keys.inflight))

    def store_bytes(self) -> int:
        return used_bytes(self.conn, self.keys)

    def try_admit(self, chunk: Chunk) -> Outcome:
        admitted_key = self.keys.admitted(chunk.epoch)
        if self.conn.sismember(admitted_key, chunk.id):
            return Outcome.DUPLICATE
        if self.store.exists(self.store.blob_path(chunk.id, chunk.epoch)):
            return Outcome.EXISTS
        job = build_job(self.queue, chunk, self.job_timeout)
        with self.conn.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.keys.inflight, self.keys.store_bytes, self.keys.reserved_bytes, admitted_key)
                    if pipe.sismember(admitted_key, chunk.id):
                        return Outcome.DUPLICATE
                    if pipe.scard(self.keys.inflight) >= self.max_backlog:
                        return Outcome.WAIT
                    if used_bytes(pipe, self.keys) >= self.max_store_bytes:
                        return Outcome.WAIT
                    pipe.multi()
                    pipe.sadd(admitted_key, chunk.id)
                    pipe.sadd(self.keys.inflight, chunk.id)
                    self.queue.enqueue_job(job, pipeline=pipe)
                    pipe.execute()
                    return Outcome.ADMITTED
                except redis.WatchError:
                    continue  # another producer or the trainer changed the backlog: decide again

    def admit(self, chunk: Chunk, on_wait: Callable[[], None] | None = None) -> Outcome:
        """Admit `chunk`, waiting while the run is over a backpressure limit."""
        while (outcome := self.try_admit(chunk)) is Outcome.WAIT:
            if on_wait:
                on_wait()
            time.sleep(self.poll_seconds)
        return outcome
