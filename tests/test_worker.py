"""Extraction workers as real processes against a real Redis: blobs, stream, refusal, SIGKILL and restart, OOM split."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from dflashq import settings as S
from dflashq.blob import decode_blob
from dflashq.chunk import Chunk, Sample
from dflashq.run import Run
from ops.status import run_queues
from producers.produce import produce
from producers.records import data_fingerprint
from producers.sample_data import write_sample_data
from dflashq.capture import decoder_layers
from workers.extract import Extractor
from workers.recovery import unannounced_key
from workers.verify import verify_samples

ROOT = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()


def overrides_for(tmp_path, redis_url, model, **extra) -> dict:
    overrides = {"run": "w", "redis.url": redis_url, "store.path": str(tmp_path / "store"), "model.path": model,
                 "data.paths": str(tmp_path / "data.jsonl"), "data.tokenize_processes": 1, "data.max_length": 512,
                 "data.chunk_tokens": 1024, "train.num_layers": 3, "workers.heartbeat_seconds": 0.5,
                 "workers.worker_ttl": 3, "backpressure.poll_seconds": 0.1}
    return {**overrides, **extra}


def settings_for(tmp_path, redis_url, model, **extra):
    return S.load(None, list(overrides_for(tmp_path, redis_url, model, **extra).items()), environ={})


def admit_sample_data(settings, n):
    write_sample_data(settings.data.paths[0], n=n)
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))
    return run, produce(run, epochs=1, progress=False)


def worker_cmd(settings, index, burst=True):
    cmd = [sys.executable, "-m", "ops.cli", "worker", "--device", "cpu", "--index", str(index),
           "--run", settings.run, "--redis-url", settings.redis.url, "--store", settings.store.path,
           "--model", settings.model.path]
    for key in ("data.max_length", "train.num_layers", "workers.heartbeat_seconds", "workers.worker_ttl",
                "backpressure.poll_seconds", "workers.batch_tokens", "store.codec"):
        section, name = key.split(".")
        cmd += ["-s", f"{key}={getattr(getattr(settings, section), name)}"]
    return cmd + (["--burst"] if burst else [])


def stream_chunks(conn, keys):
    return [fields[b"chunk"].decode() for _, fields in conn.xrange(keys.results)]


def assert_exactly_once(run, report):
    conn, keys = run.conn, run.keys
    chunks = stream_chunks(conn, keys)
    assert len(chunks) == len(set(chunks)) == report.admitted
    blobs = [p for p in Path(run.store.path("blobs", "e0")).iterdir() if p.suffix == ".dfq"]
    assert len(blobs) == report.admitted
    assert sorted(p.stem for p in blobs) == sorted(chunks)
    assert not list(Path(run.store.path("blobs", "e0")).glob(".*.tmp"))
    queues = run_queues(run)
    assert sum(FailedJobRegistry(queue=q).count for q in queues) == 0


@pytest.mark.slow
def test_worker_writes_verified_blobs_and_announces_each_once(tmp_path, redis_url, tiny_qwen35):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    run, report = admit_sample_data(settings, 40)
    proc = subprocess.run(worker_cmd(settings, 0), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exactly_once(run, report)
    assert int(run.conn.get(run.keys.store_bytes)) == sum(int(v) for v in run.conn.hvals(run.keys.blob_bytes)) > 0
    progress = json.loads(run.conn.hget(run.keys.workers, f"{HOST}.cpu0"))
    assert progress["tokens_done"] == report.tokens
    # where a chunk's time went, per chunk: the writer encoded and wrote every blob (a file write takes time)
    parts = progress["seconds_per_chunk"]
    assert parts.keys() == {"writer_wait", "device", "encode", "write", "announce"}
    assert all(v >= 0 for v in parts.values()) and parts["encode"] > 0 and parts["write"] > 0
    # the stored states are what a plain unbatched Transformers forward computes
    from dflashq.target import load_target

    model = load_target(tiny_qwen35)
    path = run.conn.xrange(run.keys.results)[0][1][b"path"].decode()
    blob = decode_blob(Path(path).read_bytes())
    assert blob.layer_ids == run.layer_ids == [1, 3, 5]  # DFlash rule for 8 layers, 3 drafter layers
    samples = [Sample(ids.numpy(), mask.numpy()) for _, ids, mask in blob.samples()]
    reports, ok = verify_samples(model, blob.layer_ids, samples, [h for h, _, _ in blob.samples()])
    assert ok, [r.problems() for r in reports]


@pytest.mark.slow
def test_fp8_worker_blobs_pass_verify_within_the_codec_tolerance(tmp_path, redis_url, tiny_qwen35):
    from workers.verify import verify_run

    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"store.codec": "fp8"})
    run, report = admit_sample_data(settings, 12)
    proc = subprocess.run(worker_cmd(settings, 0), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exactly_once(run, report)
    path = run.conn.xrange(run.keys.results)[0][1][b"path"].decode()
    blob = decode_blob(Path(path).read_bytes())
    assert blob.codec == "fp8" and blob.values.dtype == torch.float8_e4m3fn and len(blob.relative_error) == 3
    assert run.manifest["codec"] == "fp8"
    reports, ok, checked = verify_run(run, 4)
    assert ok and checked == 4, [r.problems() for r in reports]
    # the fp32 tiny target agrees with the reference to rounding: fp8's own error is what verify allowed for
    assert 1e-3 < max(r.max_rel_diff for r in reports) <= 1e-4 + 2 ** -4
    samples = [Sample(ids.numpy(), mask.numpy()) for _, ids, mask in blob.samples()]
    from dflashq.target import load_target

    _, lossless_ok = verify_samples(load_target(tiny_qwen35), blob.layer_ids, samples,
                                    [h for h, _, _ in blob.samples()], codec="bf16")
    assert not lossless_ok  # the same states judged as if stored losslessly


@pytest.mark.slow
def test_worker_refuses_other_functions_and_pickles(tmp_path, redis_url, tiny_qwen35):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    run, _ = admit_sample_data(settings, 1)
    conn, keys = run.conn, run.keys
    json_queue = Queue(keys.shared_queue, connection=conn, serializer=JSONSerializer)
    json_queue.enqueue("os.system", "echo pwned", job_id="evil-json")
    pickle_queue = Queue(keys.shared_queue, connection=conn)  # RQ's default serializer: pickle
    pickle_queue.enqueue("workers.extract.extract_chunk", {"id": "x"}, job_id="evil-pickle")
    proc = subprocess.run(worker_cmd(settings, 0), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = FailedJobRegistry(queue=json_queue)
    assert sorted(failed.get_job_ids()) == ["evil-json", "evil-pickle"]
    assert "not the registered extraction function" in Job.fetch("evil-json", connection=conn, serializer=JSONSerializer).latest_result().exc_string
    assert "not JSON" in Job.fetch("evil-pickle", connection=conn, serializer=JSONSerializer).latest_result().exc_string
    assert len(stream_chunks(conn, keys)) == 1  # the real chunk still ran


@pytest.mark.slow
@pytest.mark.parametrize("restart", [True, False], ids=["restarted-same-name", "left-dead"])
def test_sigkill_mid_chunk_loses_and_duplicates_nothing(tmp_path, redis_url, tiny_qwen35, restart):
    """Killed mid-chunk: restarted under the same name, it re-queues its chunk at once; left dead, the other
    worker re-queues it after the dead worker's key expires (the documented bound)."""
    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"data.chunk_tokens": 4096, "data.max_length": 2048})
    run, report = admit_sample_data(settings, 240)
    assert report.admitted >= 4
    conn = run.conn
    victim_key = f"rq:worker:{HOST}.cpu0"
    procs = [subprocess.Popen(worker_cmd(settings, i, burst=False), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not conn.hget(victim_key, "current_job"):  # wait until worker 0 is inside a chunk
            assert time.monotonic() < deadline, "worker 0 never started a chunk"
            time.sleep(0.02)
        held = conn.hget(victim_key, "current_job").decode()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        killed_at = time.monotonic()
        if restart:
            procs[0] = subprocess.Popen(worker_cmd(settings, 0, burst=False), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        else:
            procs.pop(0)
        ttl = settings.workers.worker_ttl
        bound = ttl + ttl / 2 + max(1, ttl - 15) + 5  # docs/operations.md: expiry + recovery interval + dequeue timeout (+ slack)
        while not int(conn.get(run.keys.requeued) or 0):
            assert time.monotonic() - killed_at < (60 if restart else bound), "the killed worker's chunk was never re-queued"
            time.sleep(0.1)
        deadline = time.monotonic() + 240
        while conn.scard(run.keys.finished) < report.admitted:
            assert time.monotonic() < deadline, f"only {conn.scard(run.keys.finished)} of {report.admitted} chunks finished"
            assert all(p.poll() is None for p in procs), procs[0].stderr.read().decode()[-3000:]
            time.sleep(0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    assert held in stream_chunks(conn, run.keys)
    assert_exactly_once(run, report)
    assert not conn.exists(victim_key) or conn.hexists(victim_key, "death")


def test_a_warm_shutdown_does_not_wait_a_minute_for_the_command_listener(tmp_path, redis_url, tiny_qwen35):
    """RQ's listener for worker commands, once it has seen its unsubscription, waits up to its sleep time for a new
    subscription, and redis-py 8 waits for the listener when RQ stops it at shutdown: with RQ's 60 s, a SIGTERMed
    worker outlived test_sigkill_mid_chunk_loses_and_duplicates_nothing's 60 s wait in 1 run of 6. Here that order
    of events is forced: the listener sees the unsubscription first, then RQ's teardown stops it."""
    from workers.worker import ExtractionWorker

    run = Run.open(settings_for(tmp_path, redis_url, tiny_qwen35), data_fingerprint="0" * 12)
    worker = ExtractionWorker(run, f"{HOST}.cpu7", "cpu")
    worker.subscribe()
    worker.pubsub.unsubscribe()
    deadline = time.monotonic() + 10
    while worker.pubsub.subscribed:  # the listener thread reads the confirmation
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    worker.unsubscribe()  # what RQ's teardown does
    assert time.monotonic() - started < 5 and not worker.pubsub_thread.is_alive()


@pytest.mark.slow
def test_a_restart_asked_just_after_a_dequeue_finishes_that_chunk_first(tmp_path, redis_url, tiny_qwen35):
    """RQ heartbeats once more between popping a chunk and starting it; a "restart" seen there used to stop the worker
    with the chunk in no queue and no registry, to be found as an orphan 30 s later (and never, by a burst worker
    that exits first). The request is sent at exactly that point: the worker must run that chunk, then stop."""
    from ops.control import restart_worker
    from workers.worker import ExtractionWorker

    class RestartAskedAtDequeue(ExtractionWorker):
        def reorder_queues(self, reference_queue):  # RQ calls it right after a successful dequeue
            if not self.restart_requested:
                restart_worker(self.run_ctx, self.name)
            super().reorder_queues(reference_queue)

    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    run, report = admit_sample_data(settings, 40)
    assert report.admitted >= 2
    worker = RestartAskedAtDequeue(run, f"{HOST}.cpu0", "cpu")
    worker.work(burst=True)
    assert worker.restart_requested
    assert len(stream_chunks(run.conn, run.keys)) == 1  # the chunk in hand, extracted and announced
    queues = run_queues(run)
    assert sum(q.count for q in queues) == report.admitted - 1  # the rest still queued, none lost or failed
    assert sum(FailedJobRegistry(queue=q).count for q in queues) == 0


RESTART_NOW_AT_DEQUEUE = """
import json, sys
from dflashq import settings as S
from ops.control import restart_worker
from ops.redis_server import open_run
from workers.worker import ExtractionWorker


class RestartNowAtDequeue(ExtractionWorker):
    def reorder_queues(self, reference_queue):  # RQ calls it right after a successful dequeue
        restart_worker(self.run_ctx, self.name, now=True)
        super().reorder_queues(reference_queue)


RestartNowAtDequeue(open_run(S.load(None, json.loads(sys.argv[1]), environ={})), sys.argv[2], "cpu").work(burst=True)
"""


@pytest.mark.slow
def test_a_restart_now_asked_just_after_a_dequeue_gives_that_chunk_back_too(tmp_path, redis_url, tiny_qwen35):
    """`restart-worker --now` at the same point: the worker exits at once (os._exit, so in its own process), and the
    chunk it had just popped is back in the queue or done when it has gone, not an orphan waiting 30 s for recovery."""
    from workers.worker import EXIT_RESTART

    run, report = admit_sample_data(settings_for(tmp_path, redis_url, tiny_qwen35), 40)
    assert report.admitted >= 2
    name = f"{HOST}.cpu0"
    overrides = json.dumps(list(overrides_for(tmp_path, redis_url, tiny_qwen35).items()))
    proc = subprocess.run([sys.executable, "-c", RESTART_NOW_AT_DEQUEUE, overrides, name], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_RESTART, proc.stderr[-3000:]
    assert "restart now requested" in proc.stderr
    queues = run_queues(run)
    announced, queued = stream_chunks(run.conn, run.keys), sum(q.count for q in queues)
    assert len(announced) <= 1 and len(announced) + queued == report.admitted
    assert sum(FailedJobRegistry(queue=q).count for q in queues) == 0


@pytest.mark.slow
def test_heartbeats_keep_a_long_chunk_alive_beyond_worker_ttl(tmp_path, redis_url, tiny_qwen35):
    """Chunks that take longer than worker_ttl are not declared abandoned while another worker watches."""
    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"workers.worker_ttl": 2, "workers.heartbeat_seconds": 0.5,
                                                                 "data.chunk_tokens": 16384, "data.max_length": 4096})
    write_sample_data(settings.data.paths[0], n=2)
    # few, long samples: one chunk of several seconds on the CPU
    long = [{"prompt": "Tell me a story. " * 300, "response": "Once upon a time. " * 600} for _ in range(4)]
    Path(settings.data.paths[0]).write_text("".join(json.dumps(r) + "\n" for r in long))
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))
    report = produce(run, epochs=1, progress=False)
    procs = [subprocess.Popen(worker_cmd(settings, i), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    started = time.monotonic()
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    assert time.monotonic() - started > 2 * settings.workers.worker_ttl  # the chunk really outlived the TTL
    assert int(run.conn.get(run.keys.requeued) or 0) == 0
    assert_exactly_once(run, report)


def test_out_of_memory_chunk_is_split_and_retried(tmp_path, redis_url, tiny_qwen35):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"workers.batch_tokens": 4096})
    run = Run.open(settings)
    extractor = Extractor(run, "oom-test", "cpu")
    calls = []

    def fail_big_batches(module, args, kwargs):
        rows = kwargs["hidden_states"].shape[0] if "hidden_states" in kwargs else args[0].shape[0]
        calls.append(rows)
        if rows > 2:  # a real torch.OutOfMemoryError, as the CUDA allocator raises it
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = decoder_layers(extractor.model)[0].register_forward_pre_hook(fail_big_batches, with_kwargs=True)
    rng = np.random.default_rng(0)
    samples = [Sample(rng.integers(0, 1000, 50).astype(np.int32), np.ones(50, np.uint8), i) for i in range(8)]
    try:
        result = extractor.run(Chunk("w-e0-oom-000000000-000000007", 0, samples))
        extractor.flush()
    finally:
        handle.remove()
        extractor.close()
    assert result["samples"] == 8 and max(calls) > 2 and calls[-1] <= 2
    assert stream_chunks(run.conn, run.keys) == ["w-e0-oom-000000000-000000007"]


@pytest.mark.slow
@pytest.mark.parametrize("writers", [1, 2])
def test_writers_write_blobs_at_once_and_bound_the_chunks_in_flight(tmp_path, redis_url, tiny_qwen35, writers):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"workers.writers": writers})
    run = Run.open(settings)
    extractor = Extractor(run, "writers-test", "cpu")
    write_atomic, lock, writing, most = run.store.write_atomic, threading.Lock(), [0], [0]

    def slow_write(path, data):  # the real write, held long enough for writes to overlap
        with lock:
            writing[0] += 1
            most[0] = max(most[0], writing[0])
        time.sleep(0.3)
        try:
            return write_atomic(path, data)
        finally:
            with lock:
                writing[0] -= 1

    run.store.write_atomic = slow_write
    rng = np.random.default_rng(0)
    ids = [f"w-e0-writers-{i:09d}-{i:09d}" for i in range(6)]
    in_flight = []
    try:
        for chunk_id in ids:
            extractor.run(Chunk(chunk_id, 0, [Sample(rng.integers(0, 1000, 40).astype(np.int32), np.ones(40, np.uint8), 0)]))
            in_flight.append(run.conn.scard(unannounced_key(run.keys, "writers-test")))
        extractor.flush()
    finally:
        extractor.close()
    assert most[0] == writers  # as many blobs written at once as there are writers, never more
    assert max(in_flight) == writers + 1  # and one more handed over, waiting for a writer
    assert sorted(stream_chunks(run.conn, run.keys)) == ids


@pytest.mark.slow
def test_chunk_that_keeps_failing_lands_in_failed_registry_with_reason(tmp_path, redis_url, tiny_qwen35):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    run, _ = admit_sample_data(settings, 1)
    from producers.admission import Admission

    bad = Chunk("w-e0-bad-000000001-000000001", 0, [Sample(np.array([5, 10**7, 6], np.int32), np.ones(3, np.uint8), 1)])
    Admission(run.conn, "w", run.store, 10, 10**12, 60).try_admit(bad)  # a token id beyond the vocabulary
    proc = subprocess.run(worker_cmd(settings, 0), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = FailedJobRegistry(queue=Queue(run.keys.shared_queue, connection=run.conn))
    assert failed.get_job_ids() == [bad.id]
    assert "IndexError" in Job.fetch(bad.id, connection=run.conn, serializer=JSONSerializer).latest_result().exc_string
    assert len(stream_chunks(run.conn, run.keys)) == 1  # the good chunk still went through


def test_out_of_memory_even_alone_gives_up_after_max_splits(tmp_path, redis_url, tiny_qwen35):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    extractor = Extractor(Run.open(settings), "oom-test", "cpu")

    def always_oom(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = decoder_layers(extractor.model)[0].register_forward_pre_hook(always_oom)
    samples = [Sample(np.arange(20, dtype=np.int32), np.ones(20, np.uint8), i) for i in range(4)]
    try:
        with pytest.raises(torch.OutOfMemoryError):
            extractor.run(Chunk("w-e0-oom2-000000000-000000003", 0, samples))
    finally:
        handle.remove()
        extractor.close()


@pytest.mark.slow
def test_sigterm_finishes_the_current_chunk_then_exits(tmp_path, redis_url, tiny_qwen35):
    from ops import status

    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"data.chunk_tokens": 4096, "data.max_length": 2048})
    run, report = admit_sample_data(settings, 240)
    conn, name = run.conn, f"{HOST}.cpu0"
    proc = subprocess.Popen(worker_cmd(settings, 0, burst=False), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not conn.hget(f"rq:worker:{name}", "current_job"):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    held = conn.hget(f"rq:worker:{name}", "current_job").decode()
    listed = status.collect(run)["workers"]
    assert [(w["name"], w["state"], w["current_chunk"]) for w in listed] == [(name, "busy", held)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    done = stream_chunks(conn, run.keys)
    assert held in done and len(done) < report.admitted  # finished its chunk, took no new one
    assert int(conn.get(run.keys.requeued) or 0) == 0
    assert conn.hexists(f"rq:worker:{name}", "death") or not conn.exists(f"rq:worker:{name}")


@pytest.mark.slow
def test_a_chunk_rq_cleaned_up_as_abandoned_is_requeued_not_failed(tmp_path, redis_url, tiny_qwen35):
    """Whoever cleans RQ's started registry first: here RQ's own cleanup (StartedJobRegistry.cleanup, as any RQ
    worker runs it) moves a killed worker's chunk to the failed registry as abandoned before our recovery ran; the
    next worker takes it back out and re-queues it at the front, and every chunk is extracted exactly once."""
    from rq.registry import StartedJobRegistry

    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"data.chunk_tokens": 4096, "data.max_length": 2048})
    run, report = admit_sample_data(settings, 120)
    conn = run.conn
    victim_key = f"rq:worker:{HOST}.cpu0"
    victim = subprocess.Popen(worker_cmd(settings, 0, burst=False), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not conn.hget(victim_key, "current_job"):
        assert time.monotonic() < deadline and victim.poll() is None, "worker 0 never started a chunk"
        time.sleep(0.02)
    held = conn.hget(victim_key, "current_job").decode()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    shared = Queue(run.keys.shared_queue, connection=conn, serializer=JSONSerializer)
    failed = FailedJobRegistry(queue=shared)
    deadline = time.monotonic() + 60
    while held not in failed.get_job_ids():  # once the execution's heartbeat lapses, RQ calls it abandoned
        assert time.monotonic() < deadline, "RQ never moved the killed worker's chunk to the failed registry"
        StartedJobRegistry(queue=shared).cleanup()
        time.sleep(0.5)
    assert "AbandonedJobError" in (Job.fetch(held, connection=conn, serializer=JSONSerializer).latest_result().exc_string or "")
    survivor = subprocess.run(worker_cmd(settings, 1, burst=True), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert held in stream_chunks(conn, run.keys) and int(conn.get(run.keys.requeued) or 0) >= 1
    assert_exactly_once(run, report)


@pytest.mark.slow
def test_a_chunk_popped_by_a_worker_that_lost_redis_is_requeued_once_orphaned(tmp_path, redis_url, tiny_qwen35,
                                                                              monkeypatch):
    """RQ pops from a worker's several queues with a plain BLPOP: a worker that loses Redis (or dies) right after the
    pop leaves the chunk queued in no list, which no registry shows (seen when a Redis outage stranded a rerun of
    `up` for good). Recovery re-queues it at the front once it has stayed orphaned for ORPHAN_SECONDS, never at the
    first sighting, and a worker then extracts every chunk exactly once."""
    from dflashq import defaults
    from workers import recovery

    settings = settings_for(tmp_path, redis_url, tiny_qwen35)
    run, report = admit_sample_data(settings, 120)
    conn = run.conn
    shared = Queue(run.keys.shared_queue, connection=conn, serializer=JSONSerializer)
    assert len(shared) >= 3
    orphan = conn.lpop(shared.key).decode()  # what the lost worker's BLPOP took
    monkeypatch.setattr(defaults, "ORPHAN_SECONDS", 1)
    assert recovery.recover(conn, run.keys, [shared]) == []  # first sighting: could be a live worker's pop
    deadline = time.monotonic() + 30
    while not (requeued := recovery.recover(conn, run.keys, [shared])):  # once orphaned for ORPHAN_SECONDS
        assert time.monotonic() < deadline, "the orphaned chunk was never re-queued"
        time.sleep(0.1)
    assert requeued == [orphan]
    assert shared.get_job_ids()[0] == orphan and int(conn.get(run.keys.requeued)) == 1
    assert recovery.recover(conn, run.keys, [shared]) == []  # queued again: nothing more to do
    worker = subprocess.run(worker_cmd(settings, 0, burst=True), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert_exactly_once(run, report)
