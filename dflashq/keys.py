"""Redis key and RQ queue names of a run. Our keys are prefixed `dflashq:<run>:`; RQ keeps its own `rq:` keys,
so queue names carry the run instead."""

from __future__ import annotations

EXTRACT_FUNCTION = "workers.extract.extract_chunk"  # the one job function a worker runs
TRAINER_GROUP = "trainer"


class Keys:
    def __init__(self, run: str):
        self.run = run
        self.prefix = f"dflashq:{run}:"

    # run-level
    @property
    def manifest(self) -> str:
        return self.prefix + "manifest"

    @property
    def inflight(self) -> str:
        """Set of chunk ids admitted and not yet acknowledged by the trainer (or failed): the backlog."""
        return self.prefix + "inflight"

    @property
    def store_bytes(self) -> str:
        """Bytes of blobs announced and not yet acknowledged (the store budget counts these)."""
        return self.prefix + "store_bytes"

    @property
    def reserved_bytes(self) -> str:
        """Uncompressed sizes of chunks being extracted now (dflashq.budget): counted against the budget too."""
        return self.prefix + "reserved_bytes"

    def reservations(self, worker_name: str) -> str:
        """Hash chunk id -> bytes reserved by one worker (so a dead worker's reservations can be released)."""
        return f"{self.prefix}reservations:{worker_name}"

    def orphan_seen(self, job_id: str) -> str:
        """When recovery first found chunk `job_id` queued in no list (Redis's clock, seconds; workers/recovery.py)."""
        return f"{self.prefix}orphan:{job_id}"

    @property
    def blob_bytes(self) -> str:
        """Hash chunk id -> bytes of its announced, unacknowledged blob (keeps store_bytes exact on re-runs)."""
        return self.prefix + "blob_bytes"

    def admitted(self, epoch: int) -> str:
        """Set of chunk ids admitted in an epoch: admitting the same data twice adds nothing."""
        return f"{self.prefix}admitted:{epoch}"

    def epoch_total(self, epoch: int) -> str:
        """Number of chunks the producer will admit in an epoch, once it has seen the whole dataset."""
        return f"{self.prefix}epoch_total:{epoch}"

    @property
    def epoch_estimate(self) -> str:
        """The producer's running estimate of epoch 0's chunks while it reads an input whose record count is known:
        the trainer's learning-rate horizon until epoch_total is set."""
        return self.prefix + "epoch_estimate"

    @property
    def finished(self) -> str:
        """Set of chunk ids whose blob has been written and announced (a set: a re-run chunk counts once)."""
        return self.prefix + "finished"

    @property
    def requeued(self) -> str:
        """Counter of chunks re-queued from dead workers (shown by status; a crash drill's evidence)."""
        return self.prefix + "requeued"

    @property
    def results(self) -> str:
        """Stream of finished blobs (XADD by workers, consumer group by the trainer). Never trimmed by length."""
        return self.prefix + "results"

    @property
    def producer(self) -> str:
        """Hash of the producer's counters (read, kept, rejected, truncated, dropped, admitted, waiting)."""
        return self.prefix + "producer"

    @property
    def draining(self) -> str:
        return self.prefix + "draining"

    @property
    def trainer(self) -> str:
        """Hash of the trainer's progress (step, epoch, loss, EAL, consumed)."""
        return self.prefix + "trainer"

    @property
    def trainer_ranks(self) -> str:
        """Hash rank -> JSON of that trainer rank's own progress and training rate (rank 0 keeps `trainer`)."""
        return self.prefix + "trainer_ranks"

    @property
    def workers(self) -> str:
        """Hash worker name -> JSON of its last reported progress."""
        return self.prefix + "workers"

    def worker_control(self, name: str) -> str:
        return f"{self.prefix}control:{name}"

    @property
    def paused(self) -> str:
        return self.prefix + "paused"

    # RQ queue names (RQ allows letters, digits, '_', '-', '.')
    @property
    def shared_queue(self) -> str:
        return f"dflashq-{self.run}"

    def worker_queue(self, worker_name: str) -> str:
        return f"dflashq-{self.run}-{worker_name}"

    def is_run_queue(self, name: str) -> bool:
        """The shared queue or a per-worker queue of this run."""
        return name == self.shared_queue or name.startswith(self.shared_queue + "-")
