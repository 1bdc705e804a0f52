"""The GPU worker: a long-lived RQ SimpleWorker that loads the target once and runs only the extraction job.

Named `<host>.gpu<N>` (`<host>.cpu<N>`), it listens on its own queue first, then on the run's shared queue.
Unlike stock SimpleWorker it heartbeats from a thread during jobs and keeps its Redis key alive for only
`worker_ttl` seconds, so a dead worker is noticed quickly and its chunk re-queued (workers/recovery.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from rq import Queue, SimpleWorker
from rq.exceptions import DeserializationError, StopRequested
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker.base import WorkerStatus

from dflashq.budget import used_bytes
from dflashq.exceptions import DflashqError
from dflashq.keys import EXTRACT_FUNCTION
from dflashq.run import Run
from workers import recovery
from workers.extract import Extractor

log = logging.getLogger(__name__)

# Exit status of a worker that stops because it was asked to restart: its supervisor starts it again at once.
EXIT_RESTART = 75


def worker_name(device: str, index: int) -> str:
    kind = "cpu" if device == "cpu" else "gpu"
    return f"{socket.gethostname()}.{kind}{index}"


class ExtractionWorker(SimpleWorker):
    def __init__(self, run: Run, name: str, device: str):
        settings = run.settings
        self.run_ctx = run
        self.device = device
        self.heartbeat_seconds = settings.workers.heartbeat_seconds
        self.poll_seconds = settings.backpressure.poll_seconds
        self.max_store_bytes = settings.backpressure.max_store_bytes
        queues = [
            Queue(run.keys.worker_queue(name), connection=run.conn, serializer=JSONSerializer),
            Queue(run.keys.shared_queue, connection=run.conn, serializer=JSONSerializer),
        ]
        super().__init__(
            queues, name=name, connection=run.conn, serializer=JSONSerializer,
            worker_ttl=settings.workers.worker_ttl, job_monitoring_interval=int(self.heartbeat_seconds),
        )
        self.extractor: Extractor | None = None
        self._last_recovery = 0.0
        self.restart_requested = False
        self._job_in_hand = False

    # --- lifecycle --------------------------------------------------------------------------------------
    def take_name(self) -> None:
        """Free this worker's name from a dead predecessor (re-queueing its chunks), or refuse a live one."""
        conn = self.connection
        deadline = time.monotonic() + self.worker_ttl + 5
        while conn.exists(self.key) and not conn.hexists(self.key, "death"):
            if recovery.local_worker_dead(conn, self.name):
                requeued = recovery.release_worker(conn, self.run_ctx.keys, self.name, self.queues)
                log.warning("%s: predecessor died; re-queued %s", self.name, requeued or "nothing")
                return
            if time.monotonic() > deadline:
                host, pid = (v.decode() if v else "?" for v in conn.hmget(self.key, "hostname", "pid"))
                raise DflashqError(f"A worker named {self.name} is alive on {host} (pid {pid}): stop it, or start this one with another --gpu/--index.")
            time.sleep(1)  # a predecessor on another host: its key expires within worker_ttl
        # a predecessor that shut down cleanly may still have unannounced chunks (it flushes, but be sure)
        recovery.release_worker(conn, self.run_ctx.keys, self.name, self.queues)

    def work(self, **kwargs) -> bool:
        self.take_name()
        self.extractor = Extractor(self.run_ctx, self.name, self.device)  # load the target before taking jobs
        kwargs.setdefault("with_scheduler", False)
        return super().work(**kwargs)

    def subscribe(self):
        # RQ's own, with a 1 s wait instead of 60: once unsubscribed at shutdown, its listener thread waits that long
        # for a subscription, and redis-py 8's PubSubWorkerThread.stop() waits for the thread: a warm shutdown took
        # 60 s whenever the listener saw its unsubscription before the stop (tests/test_worker.py, 1 run in 6)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=1, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def teardown(self):
        # Blobs already handed to the writer are written and announced before the worker deregisters.
        if self.extractor is not None:
            self.extractor.close()
        super().teardown()

    # --- heartbeats -------------------------------------------------------------------------------------
    def heartbeat(self, timeout=None, pipeline=None):
        super().heartbeat(timeout or self.worker_ttl, pipeline=pipeline)
        if pipeline is None:
            # RQ's idle loop beats once per dequeue timeout without returning to us: look after dead peers and
            # control requests here too
            self._recover_peers()
            # RQ beats once more after a dequeue: a stop raised there would leave the chunk it just popped in no queue
            # and no registry (an orphan, re-queued only ORPHAN_SECONDS later); _check_control has asked RQ to stop
            # after that chunk instead
            if self._check_control() and not self._job_in_hand:
                raise StopRequested()

    def _check_control(self) -> bool:
        """Act on `dflashq restart-worker`: "restart" stops after the current chunk (returns True while idle, so
        the caller stops at once); "restart-now" gives the chunks back (front of the queue) and exits now."""
        key = self.run_ctx.keys.worker_control(self.name)
        if self._job_in_hand and self.get_state() != WorkerStatus.BUSY and self.connection.get(key) == b"restart-now":
            # a chunk RQ just popped sits in no queue or registry until its start is recorded: giving the chunks back
            # now would miss it, so the request stays for the job's own beat
            return False
        request = self.connection.getdel(key)
        if request == b"restart-now":
            requeued = recovery.release_worker(self.connection, self.run_ctx.keys, self.name, self.queues)
            log.warning("%s: restart now requested; re-queued %s", self.name, requeued or "nothing")
            os._exit(EXIT_RESTART)
        if request == b"restart":
            log.warning("%s: restart requested; stopping after the current chunk", self.name)
            self.restart_requested = True
            self._stop_requested = True
            return self.get_state() != WorkerStatus.BUSY
        return False

    def get_heartbeat_ttl(self, job) -> int:
        return self.worker_ttl

    def _beat_during(self, job, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_seconds):
            try:
                with self.connection.pipeline() as pipe:
                    self.heartbeat(self.worker_ttl, pipeline=pipe)
                    self.execution.heartbeat(job.started_job_registry, self.worker_ttl, pipeline=pipe)
                    job.heartbeat(now(), self.worker_ttl, pipeline=pipe, xx=True)
                    pipe.execute()
                self._recover_peers()
                self._check_control()
            except Exception:  # a missed beat is not fatal; the next one may get through
                log.exception("%s: heartbeat failed", self.name)

    def clean_registries(self):
        # RQ's own cleanup would move a dead worker's expired job to the failed registry: re-queue it first.
        recovery.recover(self.connection, self.run_ctx.keys, self.queues)
        super().clean_registries()

    def _recover_peers(self) -> None:
        """Every half worker_ttl, re-queue chunks of workers that died anywhere in the run."""
        if time.monotonic() - self._last_recovery < self.worker_ttl / 2:
            return
        self._last_recovery = time.monotonic()
        requeued = recovery.recover(self.connection, self.run_ctx.keys, self.queues)
        if requeued:
            log.warning("%s: re-queued chunks of dead workers: %s", self.name, requeued)

    # --- jobs -------------------------------------------------------------------------------------------
    def _refusal(self, job) -> str | None:
        try:
            func = job.func_name
        except DeserializationError:
            return "refused: the job payload is not JSON (dflashq workers never unpickle)"
        if func != EXTRACT_FUNCTION:
            return f"refused: {func!r} is not the registered extraction function {EXTRACT_FUNCTION}"
        return None

    def execute_job(self, job, queue):
        reason = self._refusal(job)
        if reason:
            log.error("%s: job %s %s", self.name, job.id, reason)
            # No prepare_job_execution: it reads the payload, which for a refused job may be a pickle.
            self.prepare_execution(job)
            self.handle_job_failure(job, queue, exc_string=reason)
            self.set_state(WorkerStatus.IDLE)
            return
        stop = threading.Event()
        beat = threading.Thread(target=self._beat_during, args=(job, stop), daemon=True, name="heartbeat")
        beat.start()
        try:
            super().execute_job(job, queue)
        finally:
            stop.set()
            beat.join()

    def handle_job_failure(self, job, queue, started_job_registry=None, exc_string=""):
        # A failed chunk is no longer in flight: it leaves the backlog until `dflashq requeue --failed`. Before it
        # shows in the failed registry, so that whoever sees it there never also counts it in the backlog.
        self.connection.srem(self.run_ctx.keys.inflight, job.id)
        super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _must_wait(self) -> str | None:
        conn, keys = self.connection, self.run_ctx.keys
        if conn.sismember(keys.paused, self.name) or conn.sismember(keys.paused, "*"):
            return "paused"
        if used_bytes(conn, keys) >= self.max_store_bytes:
            return "store over budget"
        return None

    def reorder_queues(self, reference_queue):
        super().reorder_queues(reference_queue)
        self._job_in_hand = True  # RQ reorders right after a successful dequeue

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        self._job_in_hand = False
        while (reason := self._must_wait()) is not None:
            self.set_state(WorkerStatus.SUSPENDED)
            self.procline(f"waiting: {reason}")
            self.heartbeat()
            if self._stop_requested or self._check_control():
                raise StopRequested()
            time.sleep(self.poll_seconds)
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
