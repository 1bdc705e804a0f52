"""`dflashq up` and the control commands with real processes and a real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry

from dflashq.settings import load as load_settings
from dflashq.chunk import Chunk, Sample
from dflashq.keys import TRAINER_GROUP, Keys
from dflashq.run import Run
from ops import control
from producers.admission import Admission
from test_trainer import FAST, make_settings, produce_and_extract
from test_worker import HOST

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def write_config(tmp_path, redis_url, model, **extra) -> Path:
    values = {**FAST, "data.chunk_tokens": 2048, "data.max_length": 1024, "train.num_anchors": 4,
              "data.paths": [str(tmp_path / "data.jsonl")], **extra}
    sections: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    lines = ['run = "up"', "[redis]", f'url = "{redis_url}"', *[f"{k} = {json.dumps(v)}" for k, v in sections.get("redis", {}).items()], "[store]", f'path = "{tmp_path / "store"}"', "[model]", f'path = "{model}"']
    for section, items in sections.items():
        if section in ("redis", "store", "model"):
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in items.items()]
    config = tmp_path / "run.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def start_up(config, workers: int) -> subprocess.Popen:
    """`dflashq up` with `workers` CPU workers in the background, its output captured."""
    return subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--config", str(config), "--workers", str(workers),
                             "--no-live"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition, proc, what: str, timeout=300, poll=0.2):
    """Poll `condition` until it holds; fails with `what` past `timeout` or once `proc` has exited."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and proc.poll() is None, what
        time.sleep(poll)


def wait_busy(conn, name, proc, timeout=120):
    wait_until(lambda: conn.hget(f"rq:worker:{name}", "current_job"), proc, "worker never busy", timeout, 0.02)


@pytest.mark.slow
def test_up_runs_the_pipeline_and_survives_warm_and_cold_worker_restarts(tmp_path, redis_url, tiny_qwen35):
    from producers.sample_data import write_sample_data

    # long samples: chunks that take a while, so restarts land mid-chunk; enough of them that the run is still
    # going after a few restarts that fell between chunks
    write_sample_data(tmp_path / "data.jsonl", n=320)
    # a worker reads a --now request on its in-chunk heartbeat: beat often, so every chunk has several
    config = write_config(tmp_path, redis_url, tiny_qwen35, **{"workers.heartbeat_seconds": 0.1})
    conn = redis.Redis.from_url(redis_url)
    keys = Keys("up")
    up = start_up(config, 2)
    try:
        wait_busy(conn, f"{HOST}.cpu0", up)
        assert cli("restart-worker", f"{HOST}.cpu0", "--config", str(config)).returncode == 0
        # The cold restart goes through the Python API: the CLI's start-up (seconds on two loaded cores) could
        # outlast the chunk, and a --now request read between chunks rightly has nothing to give back.
        # A chunk may end between seeing the worker busy and the worker reading the request (its heartbeat does):
        # then it rightly gives nothing back, so ask again, a few times, until one restart lands mid-chunk.
        log = Path(tmp_path / "store" / "up" / "logs" / f"{HOST}.cpu1.log")
        for attempt in range(1, 6):
            wait_busy(conn, f"{HOST}.cpu1", up)
            control.restart_worker(Run.open(load_settings(config), join=False), f"{HOST}.cpu1", now=True)
            deadline = time.monotonic() + 60
            while log.read_text().count("restart now requested") < attempt and up.poll() is None:
                assert time.monotonic() < deadline, "the --now restart was never taken"
                time.sleep(0.05)
            if int(conn.get(keys.requeued) or 0) or up.poll() is not None:
                break
        out, err = up.communicate(timeout=900)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, (out[-3000:], err[-3000:])
    admitted = conn.scard(keys.admitted(0))
    chunks = [f[b"chunk"].decode() for _, f in conn.xrange(keys.results)]
    assert len(chunks) == len(set(chunks)) == admitted > 4  # every chunk exactly one blob and one stream entry
    assert int(conn.get(keys.requeued) or 0) >= 1  # the --now restart gave its chunk back
    assert conn.scard(keys.inflight) == 0 and conn.xpending(keys.results, TRAINER_GROUP)["pending"] == 0
    assert sum(FailedJobRegistry(queue=q).count for q in [Queue(keys.shared_queue, connection=conn)]) == 0
    logs = Path(tmp_path / "store" / "up" / "logs")
    assert "restart requested" in (logs / f"{HOST}.cpu0.log").read_text()
    assert "restart now requested" in (logs / f"{HOST}.cpu1.log").read_text()
    exported = next(Path(tmp_path / "store" / "up").glob("drafter-step-*"))
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert "exported drafter" in out and "done" in out


@pytest.mark.slow
def test_pause_resume_drain_and_requeue_failed(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35)
    args = ["--run", "t", "--redis-url", redis_url, "--store", settings.store.path, "--model", tiny_qwen35,
            "-s", "train.num_layers=2", "-s", "data.max_length=256"]
    run, report = produce_and_extract(settings)  # one burst worker extracted everything
    conn, keys = run.conn, run.keys

    # a failing chunk: in the failed registry, out of the backlog; requeue puts it back in both
    bad = Chunk("t-e0-bad-000000900-000000900", 0, [Sample(np.array([5, 10**7, 6], np.int32), np.ones(3, np.uint8), 900)])
    Admission(conn, "t", run.store, 100, 10**12, 60).try_admit(bad)
    assert cli("pause", *args).returncode == 0
    worker = subprocess.Popen([sys.executable, "-m", "ops.cli", "worker", "--device", "cpu", *args], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # paused: the worker, up and asking for work, waits and leaves the chunk queued
        wait_until(lambda: conn.hget(f"rq:worker:{HOST}.cpu0", "state") == b"suspended", worker, "never waited", 600)
        assert Queue(keys.shared_queue, connection=conn).count == 1
        assert cli("resume", *args).returncode == 0
        failed = FailedJobRegistry(queue=Queue(keys.shared_queue, connection=conn))
        deadline = time.monotonic() + 60
        while failed.count == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert not conn.sismember(keys.inflight, bad.id)
        status = json.loads(cli("status", "--json", *args).stdout)
        assert status["chunks"]["failed"] == 1
        assert status["failed"] == [{"chunk": bad.id, "reason": status["failed"][0]["reason"]}]
        assert "IndexError" in status["failed"][0]["reason"]
        assert cli("requeue", "--failed", *args).stdout.strip() == "re-queued 1 failed chunk(s)"
        assert conn.sismember(keys.inflight, bad.id) or failed.count == 1  # back in flight (or failed again already)
    finally:
        worker.terminate()
        worker.wait(timeout=60)

    # drain: the producer admits nothing more
    assert cli("drain", *args).returncode == 0
    from producers.produce import produce
    from producers.records import data_fingerprint

    again = produce(Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths)), epochs=2, progress=False)
    assert again.admitted == 0


@pytest.mark.slow
def test_restart_worker_cli_asks_a_known_worker_and_names_an_unknown_one(tmp_path, conn, redis_url):
    from rq import Worker

    args = ["--run", "t", "--redis-url", redis_url, "--store", str(tmp_path)]
    result = cli("restart-worker", "nohost.gpu7", *args)
    assert result.returncode == 2 and "No worker named nohost.gpu7" in result.stderr and "Traceback" not in result.stderr
    Worker([Queue(Keys("t").shared_queue, connection=conn)], name="host.gpu3", connection=conn).register_birth()
    for flags, request in [((), b"restart"), (("--now",), b"restart-now")]:
        assert cli("restart-worker", "host.gpu3", *flags, *args).returncode == 0
        assert conn.get(Keys("t").worker_control("host.gpu3")) == request


def test_status_flags_a_worker_whose_heartbeat_is_late(tmp_path, conn, redis_url):
    from rq import Worker
    from rq.serializers import JSONSerializer
    from rq.utils import utcformat

    from dflashq import settings as S
    from ops import status

    settings = S.load(None, [("run", "s"), ("redis.url", redis_url), ("store.path", str(tmp_path))], environ={})
    run = Run.open(settings, join=False)
    queue = Queue(Keys("s").shared_queue, connection=conn, serializer=JSONSerializer)
    for name in ("node.gpu0", "node.gpu1"):
        Worker([queue], name=name, connection=conn).register_birth()
    import datetime

    stale = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=settings.workers.worker_ttl)
    conn.hset("rq:worker:node.gpu1", "last_heartbeat", utcformat(stale))
    flags = {w["name"]: w["stuck"] for w in status.collect(run)["workers"]}
    assert flags == {"node.gpu0": False, "node.gpu1": True}


@pytest.mark.slow
def test_up_stops_on_a_repeated_user_error_with_the_childs_sentence(tmp_path, redis_url, tiny_qwen35):
    from producers.sample_data import write_sample_data

    write_sample_data(tmp_path / "data.jsonl", n=8)
    config = write_config(tmp_path, redis_url, tiny_qwen35, **{"train.mask_token_id": 10**9})
    started = time.monotonic()
    up = cli("up", "--config", str(config), "--workers", "1", "--no-live", timeout=300)
    assert up.returncode == 2, (up.stdout[-2000:], up.stderr[-2000:])
    assert "trainer stopped the run: mask_token_id 1000000000 is not a row" in up.stderr
    assert "Traceback" not in up.stderr and time.monotonic() - started < 120
    log = (tmp_path / "store" / "up" / "logs" / "trainer.log").read_text()
    assert log.count("mask_token_id 1000000000 is not a row") == 2  # tried twice, not restarted for ever


def test_children_keep_the_users_pythonpath():
    from ops.supervisor import child_environment

    env = child_environment({"PYTHONPATH": os.pathsep.join(["/opt/site-a", "/opt/site-b"]), "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/opt/site-a", "/opt/site-b"] and env["HOME"] == "/root"
    assert child_environment({})["PYTHONPATH"] == str(ROOT)


@pytest.mark.slow
def test_up_rides_through_a_killed_embedded_redis(tmp_path, tiny_qwen35):
    """The embedded redis-server SIGKILLed mid-run (two CPU workers and the trainer busy): every command of the run
    rides the outage through, the server is started again from its AOF on its old port, and the run finishes with
    every admitted chunk trained exactly once."""
    from ops.redis_server import EmbeddedRedis
    from producers.sample_data import write_sample_data

    write_sample_data(tmp_path / "data.jsonl", n=160)
    config = write_config(tmp_path, "", tiny_qwen35, **{"redis.outage_seconds": 120})
    server = EmbeddedRedis(str(tmp_path / "store" / "up"))
    up = start_up(config, 2)
    try:
        wait_until(lambda: server.url() and redis.Redis.from_url(server.url()).xlen(Keys("up").results) >= 3, up,
                   "no blob announced")
        port = server.url()
        server.kill()
        out, err = up.communicate(timeout=900)
    finally:
        if up.poll() is None:
            up.kill()
    conn = redis.Redis.from_url(server.url())
    try:
        assert up.returncode == 0, (out[-3000:], err[-3000:])
        assert server.url() == port  # restarted on its old port, so every client reconnected
        keys = Keys("up")
        chunks = [f[b"chunk"].decode() for _, f in conn.xrange(keys.results)]
        assert len(chunks) == len(set(chunks)) == conn.scard(keys.admitted(0)) > 4
        assert conn.scard(keys.inflight) == 0 and conn.xpending(keys.results, TRAINER_GROUP)["pending"] == 0
        assert FailedJobRegistry(queue=Queue(keys.shared_queue, connection=conn)).count == 0
        state = json.loads(next(Path(tmp_path / "store" / "up" / "checkpoints").glob("step-*/state.json")).read_text())
        assert sorted(state["train_state"]["consumed"]["0"]) == sorted(chunks)  # each chunk trained once
        logs = "".join(p.read_text() for p in (tmp_path / "store" / "up" / "logs").glob("*.log"))
        assert "is unreachable" in logs and "is back after" in logs
    finally:
        server.stop()


@pytest.mark.slow
def test_up_gives_up_past_outage_seconds_and_a_rerun_finishes_the_run(tmp_path, redis_server, redis_url, tiny_qwen35):
    """A Redis of the user's own (no healing) stopped for longer than redis.outage_seconds: `up` ends with the one
    sentence (exit 2); once Redis is back, running `up` again finishes the run with every chunk trained exactly
    once and nothing in the failed registry (no `requeue --failed`)."""
    from producers.sample_data import write_sample_data

    write_sample_data(tmp_path / "data.jsonl", n=160)
    config = write_config(tmp_path, redis_url, tiny_qwen35, **{"redis.outage_seconds": 3})
    conn, keys = redis.Redis.from_url(redis_url), Keys("up")
    up = start_up(config, 2)
    try:
        wait_until(lambda: conn.xlen(keys.results) >= 3, up, "no blob announced")
        redis_server.kill()  # and it stays down: nothing heals a Redis of the user's own
        out, err = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 2, (out[-2000:], err[-2000:])
    assert "for longer than redis.outage_seconds" in err and "Traceback" not in err
    status = cli("status", "--config", str(config), timeout=60)  # says what is going on, at once
    assert status.returncode == 2 and "is unreachable since" in " ".join(status.stdout.split()), status.stdout + status.stderr
    redis_server.ensure()  # back, from its AOF
    again = cli("up", "--config", str(config), "--workers", "2", "--no-live", timeout=900)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    conn = redis.Redis.from_url(redis_url)
    chunks = [f[b"chunk"].decode() for _, f in conn.xrange(keys.results)]
    assert len(chunks) == len(set(chunks)) == conn.scard(keys.admitted(0)) > 4
    assert conn.scard(keys.inflight) == 0 and conn.xpending(keys.results, TRAINER_GROUP)["pending"] == 0
    assert FailedJobRegistry(queue=Queue(keys.shared_queue, connection=conn)).count == 0
    state = json.loads(next(Path(tmp_path / "store" / "up" / "checkpoints").glob("step-*/state.json")).read_text())
    assert sorted(state["train_state"]["consumed"]["0"]) == sorted(chunks)


@pytest.mark.slow
def test_up_stopped_by_a_signal_says_stopped_exports_nothing_and_a_rerun_finishes(tmp_path, redis_url, tiny_qwen35):
    """SIGTERM (what Ctrl-C does too) mid-training: the trainer checkpoints and exits 0, and `up` must still report
    the run as stopped (exit 130, no drafter exported as if it were final); `up` again trains the rest and exports."""
    from producers.sample_data import write_sample_data

    write_sample_data(tmp_path / "data.jsonl", n=160)
    config = write_config(tmp_path, redis_url, tiny_qwen35, **{"train.epochs": 3})
    conn, keys = redis.Redis.from_url(redis_url), Keys("up")
    up = start_up(config, 1)
    try:
        wait_until(lambda: int(json.loads(conn.hget(keys.trainer, "step") or "0")) >= 2, up, "the trainer never stepped",
                   poll=0.1)
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 130, (out[-2000:], err[-2000:])
    assert "stopped" in out and "Traceback" not in err
    run_dir = tmp_path / "store" / "up"
    assert not list(run_dir.glob("drafter-step-*"))
    assert json.loads(conn.hget(keys.trainer, "done")) is False and list((run_dir / "checkpoints").glob("step-*"))
    again = cli("up", "--config", str(config), "--workers", "1", "--no-live", timeout=900)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    assert json.loads(conn.hget(keys.trainer, "done")) is True and list(run_dir.glob("drafter-step-*"))
    state = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
                        / "state.json").read_text())
    assert all(len(state["train_state"]["consumed"][str(e)]) == conn.scard(keys.admitted(0)) for e in range(3))


@pytest.mark.slow
def test_up_splits_the_gpus_between_workers_and_trainer_ranks(tmp_path, conn, redis_url):
    from dflashq import settings as S
    from dflashq.exceptions import ConfigError
    from ops.placement import place
    from ops.supervisor import Supervisor

    settings = S.load(None, [("run", "p"), ("redis.url", redis_url), ("store.path", str(tmp_path))], environ={})
    run = Run.open(settings, join=False)
    # a first start: the default ratio, 4 of 8 GPUs train
    first = place(run, 8, None, None, None, environ={})
    assert first.workers == [("cuda", i) for i in range(4)] and first.trainer_args == ["--device", "cuda", "--ranks", "4"]
    assert first.trainer_env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"} and "default ratio" in first.note
    trainer = Supervisor(run, first.workers, first.trainer_args, tmp_path / "logs", trainer_env=first.trainer_env).children[-1]
    assert trainer.argv[-5:] == ["--device", "cuda", "--ranks", "4", "--no-progress"] and trainer.env == first.trainer_env
    # the user's own CUDA_VISIBLE_DEVICES: the trainer's are its last entries
    assert place(run, 4, None, None, 1, environ={"CUDA_VISIBLE_DEVICES": "2,3,6,7"}).trainer_env == {"CUDA_VISIBLE_DEVICES": "7"}
    # rates an earlier run measured: a GPU worker extracts 3x what a rank trains, so 6 ranks keep up with 2 workers
    conn.hset(run.keys.workers, "node.gpu0", json.dumps({"busy_tokens_per_second": 3000.0}))
    conn.hset(run.keys.workers, "node.cpu0", json.dumps({"busy_tokens_per_second": 1.0}))  # not a GPU's rate
    conn.hset(run.keys.trainer_ranks, "0", json.dumps({"rank": 0, "device": "cuda:0", "busy_tokens_per_second": 1000.0}))
    measured = place(run, 8, None, None, None, environ={})
    assert measured.trainer_args[-1] == "6" and "rates earlier runs of this run measured" in measured.note
    shared = place(run, 1, None, None, None, environ={})  # one GPU: both on it, and said so
    assert shared.workers == [("cuda", 0)] and shared.trainer_args == ["--device", "cuda:0"] and "share cuda:0" in shared.note
    with pytest.raises(ConfigError, match="from 1 to 7"):
        place(run, 8, None, None, 8, environ={})
    with pytest.raises(ConfigError, match="leaves no GPU for a worker"):
        place(run, 1, None, None, 2, environ={})
    result = cli("up", "--trainer-gpus", "1", "--run", "p", "--redis-url", redis_url, "--store", str(tmp_path))
    assert result.returncode == 2 and "--trainer-gpus splits" in result.stderr and "Traceback" not in result.stderr
