"""The part of RQ that the extraction worker and its recovery stand on (workers/worker.py overrides or calls these;
workers/recovery.py calls them), recorded as the RQ release pyproject.toml allows has them. RQ has no documented
hook for what these overrides do (heartbeats from a thread during a job, a short worker TTL, control requests read
between chunks, the dequeue a chunk is in hand after, a pubsub listener that stops at once), so a new RQ release
must be read against this list before the pin moves: a changed or missing method fails here, not in a run."""

from __future__ import annotations

import inspect
import textwrap

import rq
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.worker.base import WorkerStatus

from workers.worker import ExtractionWorker

# parameters (names, kinds, defaults) of each method, without annotations: a new type hint is no change
SIGNATURES = {
    "SimpleWorker.__init__": "(self, queues, name=None, default_result_ttl=500, connection=None, exception_handlers=None, "
                             "maintenance_interval=600, default_worker_ttl=None, worker_ttl=None, job_class=None, "
                             "queue_class=None, log_job_description=True, job_monitoring_interval=30, "
                             "disable_default_exception_handler=False, prepare_for_work=True, serializer=None, "
                             "work_horse_killed_handler=None)",
    "SimpleWorker.work": "(self, burst=False, logging_level=None, date_format='%H:%M:%S', "
                         "log_format='%(asctime)s %(message)s', max_jobs=None, max_idle_time=None, with_scheduler=False, "
                         "dequeue_strategy=<DequeueStrategy.DEFAULT: 'default'>)",
    "SimpleWorker.subscribe": "(self)",
    "SimpleWorker.teardown": "(self)",
    "SimpleWorker.heartbeat": "(self, timeout=None, pipeline=None)",
    "SimpleWorker.get_state": "(self)",
    "SimpleWorker.set_state": "(self, state, pipeline=None)",
    "SimpleWorker.get_heartbeat_ttl": "(self, job)",
    "SimpleWorker.clean_registries": "(self)",
    "SimpleWorker.execute_job": "(self, job, queue)",
    "SimpleWorker.prepare_execution": "(self, job)",
    "SimpleWorker.handle_job_failure": "(self, job, queue, started_job_registry=None, exc_string='')",
    "SimpleWorker.procline": "(self, message)",
    "SimpleWorker.reorder_queues": "(self, reference_queue)",
    "SimpleWorker.dequeue_job_and_maintain_ttl": "(self, timeout, max_idle_time=None)",
    "SimpleWorker.handle_payload": "(self, message)",
    "SimpleWorker._pubsub_exception_handler": "(self, exc, pubsub, pubsub_thread)",
    "Execution.heartbeat": "(self, started_job_registry, ttl, pipeline)",
    "Job.heartbeat": "(self, timestamp, ttl, pipeline=None, xx=False)",
    "Job.fetch": "(id, connection=None, serializer=None)",
    "Job.set_status": "(self, status, pipeline=None)",
    "Job.key_for": "(job_id)",
    "Job.latest_result": "(self, timeout=0)",
    "Queue.__init__": "(self, name='default', connection=None, default_timeout=None, is_async=True, job_class=None, "
                      "serializer=None, death_penalty_class=<class 'rq.timeouts.UnixSignalDeathPenalty'>, **kwargs)",
    "Queue.push_job_id": "(self, job_id, pipeline=None, at_front=False)",
    "StartedJobRegistry.__init__": "(self, name='default', connection=None, job_class=None, queue=None, serializer=None, "
                                   "death_penalty_class=None)",
    "StartedJobRegistry.get_job_and_execution_ids": "(self, start=0, end=-1, desc=False, cleanup=True)",
    "FailedJobRegistry.get_job_ids": "(self, start=0, end=-1, desc=False, cleanup=True)",
    "FailedJobRegistry.requeue": "(self, job_or_id, at_front=False)",
    "rq.utils.now": "()",
    "rq.utils.current_timestamp": "()",
    "rq.worker_registration.unregister": "(worker, pipeline=None)",
}

# RQ's own subscribe, of which ExtractionWorker.subscribe is a copy with a 1 s listener wait: a change here must be
# carried over there
RQ_SUBSCRIBE = '''
def subscribe(self):
    """Subscribe to this worker's channel"""
    self.log.info('Worker %s: subscribing to channel %s', self.name, self.pubsub_channel_name)
    self.pubsub = self.connection.pubsub()
    self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
    self.pubsub_thread = self.pubsub.run_in_thread(
        sleep_time=60, daemon=True, exception_handler=self._pubsub_exception_handler
    )
'''


def bare(fn) -> str:
    signature = inspect.signature(fn)
    return str(signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                             for p in signature.parameters.values()],
                                 return_annotation=inspect.Signature.empty))


def resolve(name: str):
    owners = {"SimpleWorker": SimpleWorker, "Execution": Execution, "Job": Job, "Queue": Queue,
              "StartedJobRegistry": StartedJobRegistry, "FailedJobRegistry": FailedJobRegistry}
    owner, _, member = name.rpartition(".")
    target = owners.get(owner) or __import__(owner, fromlist=[member])
    return getattr(target, member)


def test_the_rq_methods_the_worker_overrides_or_calls_keep_their_signatures():
    changed = {name: bare(resolve(name)) for name in SIGNATURES if bare(resolve(name)) != SIGNATURES[name]}
    assert changed == {}, f"rq {rq.__version__} changed what workers/ rely on: {changed}"


def test_every_rq_method_the_worker_overrides_is_in_the_contract():
    overridden = {name for name, value in vars(ExtractionWorker).items()
                  if callable(value) and hasattr(SimpleWorker, name)}
    assert overridden and overridden <= {n.split(".", 1)[1] for n in SIGNATURES if n.startswith("SimpleWorker.")}


def test_the_rq_behaviour_the_worker_builds_on(redis_url):
    """What no signature shows: the attributes the worker sets or reads, the dequeue that reorders the queues right
    after a pop and beats only after that, and the subscribe the worker copied."""
    import redis

    worker = SimpleWorker([Queue("contract", connection=redis.Redis.from_url(redis_url))],
                          connection=redis.Redis.from_url(redis_url))
    assert worker._stop_requested is False and worker.execution is None and worker.pubsub_channel_name
    assert isinstance(inspect.getattr_static(Job, "started_job_registry"), property)
    assert isinstance(inspect.getattr_static(Job, "func_name"), property)
    assert SimpleWorker.redis_worker_namespace_prefix == "rq:worker:" and Queue.redis_queue_namespace_prefix == "rq:queue:"
    assert {WorkerStatus.BUSY, WorkerStatus.IDLE, WorkerStatus.SUSPENDED} and JobStatus.QUEUED.value == "queued"
    dequeue = inspect.getsource(SimpleWorker.dequeue_job_and_maintain_ttl)
    pop, reorder = dequeue.index("dequeue_any("), dequeue.index("self.reorder_queues(reference_queue=queue)")
    assert pop < reorder < dequeue.rindex("self.heartbeat()")  # ExtractionWorker._job_in_hand is set in between
    assert textwrap.dedent(inspect.getsource(SimpleWorker.subscribe)).strip() == RQ_SUBSCRIBE.strip()
