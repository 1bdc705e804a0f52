"""The trainer daemon against a real Redis and real blobs: exactly once per epoch across crashes, retention,
status, and backpressure end to end."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from dflashq import defaults
from dflashq import settings as S
from dflashq.exceptions import ConfigError, TrainerOutOfMemory
from dflashq.budget import used_bytes
from dflashq.keys import TRAINER_GROUP
from dflashq.run import Run
from producers.produce import produce
from producers.records import data_fingerprint
from producers.sample_data import write_sample_data
from trainer import checkpoint
from trainer.daemon import Trainer
from trainer.step import WarmupCosine

ROOT = Path(__file__).resolve().parent.parent

FAST = {"data.tokenize_processes": 1, "data.max_length": 256, "data.chunk_tokens": 512, "train.num_layers": 2,
        "train.num_anchors": 16, "train.block_size": 4, "train.micro_batch_tokens": 1024, "train.epochs": 1,
        "train.checkpoint_every_steps": 3, "workers.heartbeat_seconds": 0.5, "workers.worker_ttl": 3,
        "backpressure.poll_seconds": 0.05, "train.claim_idle_seconds": 1}


def make_settings(tmp_path, redis_url, model, **extra):
    values = {"run": "t", "redis.url": redis_url, "store.path": str(tmp_path / "store"), "model.path": model,
              "data.paths": str(tmp_path / "data.jsonl"), **FAST, **extra}
    return S.load(None, list(values.items()), environ={})


def cli_args(settings, extra=()):
    args = ["--run", settings.run, "--redis-url", settings.redis.url, "--store", settings.store.path,
            "--model", settings.model.path]
    for key in [*FAST, "store.retention", "store.codec", "train.epochs", "backpressure.max_store_bytes",
                "backpressure.max_backlog"]:
        section, name = key.split(".")
        args += ["-s", f"{key}={getattr(getattr(settings, section), name)}"]
    return args + list(extra)


def produce_and_extract(settings, conversations=48, epochs=1):
    write_sample_data(settings.data.paths[0], n=conversations)
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))
    report = produce(run, epochs=epochs, progress=False)
    worker = subprocess.run([sys.executable, "-m", "ops.cli", "worker", "--device", "cpu", "--burst", *cli_args(settings)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert worker.returncode == 0, worker.stderr[-3000:]
    return run, report


def final_state(settings) -> checkpoint.TrainState:
    root = Path(settings.run_dir) / "checkpoints"
    meta = json.loads((checkpoint.latest(root) / "state.json").read_text())["train_state"]
    return checkpoint.TrainState(meta["step"], meta["epoch"], {int(k): v for k, v in meta["consumed"].items()},
                                 {int(k): v for k, v in meta["duplicates_skipped"].items()}, meta["tokens"])


def stream_chunk_ids(conn, keys, epoch):
    return sorted({f[b"chunk"].decode() for _, f in conn.xrange(keys.results) if int(f[b"epoch"]) == epoch})


def assert_backlog_drained(run):
    conn, keys = run.conn, run.keys
    assert conn.scard(keys.inflight) == 0
    assert int(conn.get(keys.store_bytes) or 0) == 0 and int(conn.get(keys.reserved_bytes) or 0) == 0
    assert conn.xpending(keys.results, TRAINER_GROUP)["pending"] == 0


@pytest.mark.slow
def test_sigkill_mid_run_then_restart_trains_every_chunk_exactly_once(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35)
    run, report = produce_and_extract(settings)
    assert report.admitted >= 6
    cmd = [sys.executable, "-m", "ops.cli", "train", "--device", "cpu", "--no-progress", *cli_args(settings)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while json.loads(run.conn.hget(run.keys.trainer, "step") or b"0") < 4:  # past the first checkpoint (step 3)
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "slow"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = final_state(settings)
    assert 0 < len(killed_at.consumed[0]) < report.admitted
    restarted = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    state = final_state(settings)
    trained = state.consumed[0]
    assert len(trained) == len(set(trained)) == report.admitted  # each chunk once in the surviving model
    assert sorted(trained) == stream_chunk_ids(run.conn, run.keys, 0)
    assert state.step == report.admitted and state.epoch == 1
    assert_backlog_drained(run)
    assert not list(Path(run.store.path("blobs", "e0")).glob("*.dfq"))  # retention delete: trained blobs removed
    status = {k.decode(): json.loads(v) for k, v in run.conn.hgetall(run.keys.trainer).items()}
    assert status["done"] is True and status["consumed_total"] == report.admitted and status["epoch"] == 1
    assert "chunks trained" in restarted.stdout and "duplicates skipped" in restarted.stdout
    log = [json.loads(line) for line in Path(run.store.path("train_log.jsonl")).read_text().splitlines()]
    assert any(r.get("event") == "resumed" for r in log)
    assert all(len(r["acc"]) == settings.train.block_size - 1 and r["eal"] >= 1 for r in log if "step" in r and "acc" in r)


@pytest.mark.slow
def test_crash_between_checkpoint_and_ack_skips_duplicates(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.checkpoint_every_steps": 1000})
    run, report = produce_and_extract(settings)
    first = Trainer(run, "cpu", progress=False)
    first.run_until_done(max_steps=3)  # stops with a final checkpoint and ack
    trained_before = list(first.state.consumed[0])
    first.chunks.ack = lambda entries: None  # two more steps and their checkpoint, then a "crash" before the ack
    first.run_until_done(max_steps=2)
    del first  # never acknowledged: those two entries stay pending for this consumer
    second = Trainer(Run.open(settings), "cpu", progress=False)
    result = second.run_until_done()
    assert len(trained_before) == 3 and result.duplicates_skipped == {0: 2}
    trained = final_state(settings).consumed[0]
    assert len(trained) == len(set(trained)) == report.admitted
    assert_backlog_drained(run)


@pytest.mark.slow
def test_retention_keep_reads_later_epochs_from_the_store(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"store.retention": "keep", "train.epochs": 2})
    run, report = produce_and_extract(settings)  # retention keep: the producer admits one epoch only
    result = Trainer(run, "cpu", progress=False).run_until_done()
    assert result.consumed == {0: report.admitted, 1: report.admitted} and not result.stopped
    state = final_state(settings)
    assert sorted(state.consumed[0]) == sorted(state.consumed[1]) and state.consumed[0] != state.consumed[1]
    order = sorted(state.consumed[0])
    random.Random(settings.train.seed + 1).shuffle(order)
    assert state.consumed[1] == order  # the epoch's seeded shuffle, so a restart resumes the same order
    assert len(list(Path(run.store.path("blobs", "e0")).glob("*.dfq"))) == report.admitted  # kept
    assert_backlog_drained(run)


@pytest.mark.slow
def test_retention_keep_reads_the_blobs_of_later_steps_ahead_and_leaves_none_unread(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"store.retention": "keep", "train.epochs": 2})
    run, report = produce_and_extract(settings)
    trainer = Trainer(run, "cpu", progress=False)
    asked, ahead = [], trainer.prefetch.ahead
    trainer.prefetch.ahead = lambda paths: (asked.append(list(paths)), ahead(paths))[1]
    result = trainer.run_until_done()
    assert result.consumed == {0: report.admitted, 1: report.admitted} and report.admitted >= 4
    paths = [run.store.blob_path(chunk, 0) for chunk in final_state(settings).consumed[1]]  # epoch 1's training order
    depth = 1 + trainer.prefetch.threads
    for i in range(len(paths) - 1):  # while step i trained, the next `depth` steps' blobs were asked for, in order
        assert paths[i + 1:i + 1 + depth] in asked
    assert not trainer.prefetch.pending  # every blob read ahead was trained


@pytest.mark.slow
def test_fp8_blobs_train_like_bf16_blobs_in_about_half_the_bytes(tmp_path, redis_url, tiny_qwen35):
    results = {}
    for codec in ("bf16", "fp8"):
        settings = make_settings(tmp_path / codec, redis_url, tiny_qwen35, run=f"c-{codec}",
                                 **{"store.codec": codec, "store.retention": "keep"})
        run, report = produce_and_extract(settings)
        stored = int(run.conn.get(run.keys.store_bytes))
        result = Trainer(run, "cpu", progress=False).run_until_done()  # same data, same seed
        assert result.consumed == {0: report.admitted} and not result.stopped
        results[codec] = (stored, result.last_loss, result.last_eal)
    (bf16_bytes, bf16_loss, bf16_eal), (fp8_bytes, fp8_loss, fp8_eal) = results["bf16"], results["fp8"]
    # the tiny target's fp32 states: fp8 stores 1 byte of 4 (plus a scale per token and layer)
    assert fp8_bytes < 0.4 * bf16_bytes, results
    assert abs(fp8_loss - bf16_loss) <= 0.02 * bf16_loss and abs(fp8_eal - bf16_eal) <= 0.02 * bf16_eal, results


@pytest.mark.slow
def test_retention_delete_re_extracts_each_epoch(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.epochs": 2})
    run, report = produce_and_extract(settings, conversations=24, epochs=2)
    result = Trainer(run, "cpu", progress=False).run_until_done()
    per_epoch = report.admitted // 2
    assert result.consumed == {0: per_epoch, 1: per_epoch}
    assert [c.split("-e")[1][0] for c in final_state(settings).consumed[1]] == ["1"] * per_epoch
    assert_backlog_drained(run)


@pytest.mark.slow
def test_slow_trainer_keeps_the_store_within_its_byte_budget(tmp_path, redis_url, tiny_qwen35):
    """Producer, two workers and a deliberately slow trainer run together; the store never exceeds its budget."""
    probe = make_settings(tmp_path / "probe", redis_url, tiny_qwen35, run="probe")
    probe_run, _ = produce_and_extract(probe, conversations=8)
    blob = max(int(v) for v in probe_run.conn.hvals(probe_run.keys.blob_bytes))
    # a chunk's reservation is its uncompressed size: about 1.2x a blob here; the budget fits about 3 chunks
    budget = int(blob * 4)
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"backpressure.max_store_bytes": budget,
                                                                  "backpressure.max_backlog": 100})
    write_sample_data(settings.data.paths[0], n=64)
    conn = redis.Redis.from_url(redis_url)
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))
    seen = {"used": 0, "disk": 0}
    stop = threading.Event()

    def disk_bytes(blobs: Path) -> int:
        total = 0
        for blob_path in blobs.glob("*.dfq") if blobs.exists() else []:
            try:
                total += blob_path.stat().st_size
            except FileNotFoundError:
                pass  # trained and deleted between the listing and the stat
        return total

    def watch():
        blobs = Path(run.store.path("blobs", "e0"))
        try:
            while not stop.is_set():
                seen["used"] = max(seen["used"], used_bytes(conn, run.keys))
                seen["disk"] = max(seen["disk"], disk_bytes(blobs))
                time.sleep(0.01)
        except Exception as exc:  # a watcher that died would stop checking the budget without failing the test
            seen["error"] = exc

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [subprocess.Popen([sys.executable, "-m", "ops.cli", "worker", "--device", "cpu", "--index", str(i),
                                 *cli_args(settings)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for i in range(2)]
    try:
        producer = threading.Thread(target=produce, args=(run,), kwargs={"epochs": 1, "progress": False})
        producer.start()
        trainer = Trainer(Run.open(settings), "cpu", progress=False)
        original = trainer._train_chunk

        def slow(*args):
            time.sleep(0.5)  # a trainer slower than the workers: the budget must hold them back
            return original(*args)

        trainer._train_chunk = slow
        trainer.cfg.checkpoint_every_steps = 2
        result = trainer.run_until_done()
        producer.join(timeout=120)
    finally:
        stop.set()
        watcher.join()
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(timeout=60)
    assert not result.stopped and result.consumed[0] == int(conn.get(run.keys.epoch_total(0)))
    assert "error" not in seen, seen
    assert 0 < seen["disk"] <= budget and 0 < seen["used"] <= budget, (seen, budget)


def test_drafter_shape_comes_from_train_settings_and_must_match_the_checkpoint(tmp_path, redis_url, tiny_qwen35):
    shape = {"train.num_attention_heads": 8, "train.num_key_value_heads": 2, "train.head_dim": 8,
             "train.intermediate_size": 32, "train.layer_types": "sliding_attention,full_attention",
             "train.sliding_window": 64}
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **shape)
    trainer = Trainer(Run.open(settings), "cpu", progress=False)
    config = trainer.drafter.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.layer_types, config.sliding_window) == (8, 2, 8, 32, ["sliding_attention", "full_attention"], 64)
    trainer.checkpoint_and_ack()
    with pytest.raises(ConfigError, match="head_dim = 8 but the config now gives 16"):
        Trainer(Run.open(make_settings(tmp_path, redis_url, tiny_qwen35)), "cpu", progress=False)
    with pytest.raises(ConfigError, match="train.layer_types lists 1 layers"):
        make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.layer_types": "full_attention"})
    with pytest.raises(ConfigError, match="train.attention must be"):
        make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.attention": "dense"})


@pytest.mark.slow
def test_learning_rate_holds_its_peak_until_the_producer_has_counted_the_epoch(tmp_path, redis_url, tiny_qwen35):
    """A producer still reading a large dataset has not counted epoch 0: the horizon is unknown, and the rate must
    warm up and hold rather than decay to zero after one step (found in a GPU run: lr 0 from step 2 on); once the
    total is known the cosine decays towards zero."""
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.warmup_ratio": 0.1})
    run, report = produce_and_extract(settings, conversations=48)
    total = run.conn.get(run.keys.epoch_total(0))
    # as if the producer had not reached the end of an input whose size it cannot tell (gzipped JSONL)
    run.conn.delete(run.keys.epoch_total(0), run.keys.epoch_estimate)
    peak = settings.train.learning_rate
    trainer = Trainer(run, "cpu", progress=False)
    trainer.run_until_done(max_steps=3)
    run.conn.set(run.keys.epoch_total(0), total)
    result = trainer.run_until_done()
    log = [json.loads(line) for line in Path(run.store.path(settings.train.log_file)).read_text().splitlines()]
    lrs = [r["lr"] for r in log if "lr" in r]
    assert result.consumed[0] == report.admitted and len(lrs) == report.admitted >= 6
    unknown = [peak * (step + 1) / defaults.UNKNOWN_HORIZON_WARMUP_STEPS for step in range(3)]
    assert lrs[:3] == pytest.approx(unknown)
    # the total is read after step 3: from step 4 on the cosine over the known horizon, falling towards zero
    decaying = lrs[4:]
    assert len(decaying) >= 2 and all(a > b for a, b in zip(decaying, decaying[1:])) and decaying[-1] < 0.1 * peak
    # every step says where its wall time went; the parts add up to the time between two step records
    steps = [r for r in log if "lr" in r]
    assert all(r["seconds"].keys() == {"between", "read", "compute"} for r in steps)
    assert all(r["seconds"]["read"] > 0 and r["seconds"]["compute"] > 0 and r["seconds"]["between"] >= 0 for r in steps)
    gaps = [b["time"] - a["time"] - sum(b["seconds"].values()) for a, b in zip(steps[4:], steps[5:])]
    assert all(-0.01 < gap < 0.5 for gap in gaps), gaps


@pytest.mark.slow
def test_learning_rate_follows_the_producers_estimate_before_the_count(tmp_path, redis_url, tiny_qwen35):
    """An input whose record count is known (JSONL): the producer's running estimate of epoch 0 sets the horizon
    from the first step, so the rate warms up over warmup_ratio of the run and decays along one cosine, with no jump
    when the count arrives (found in a GPU run: held at its peak for 228 of 278 steps, then 8% of it)."""
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"train.warmup_ratio": 0.1})
    run, report = produce_and_extract(settings, conversations=48)
    total = run.conn.get(run.keys.epoch_total(0))
    run.conn.delete(run.keys.epoch_total(0))  # the producer still reading: only its estimate is there
    assert int(run.conn.get(run.keys.epoch_estimate)) == report.admitted >= 6
    trainer = Trainer(run, "cpu", progress=False)
    trainer.run_until_done(max_steps=3)
    run.conn.set(run.keys.epoch_total(0), total)  # the count, which ends the epoch
    trainer.run_until_done()
    log = [json.loads(line) for line in Path(run.store.path(settings.train.log_file)).read_text().splitlines()]
    lrs = [r["lr"] for r in log if "lr" in r]
    cosine = WarmupCosine(0.1, report.admitted)
    assert lrs == pytest.approx([settings.train.learning_rate * cosine(step) for step in range(report.admitted)])


@pytest.mark.slow
def test_out_of_memory_is_one_sentence_and_loses_nothing(tmp_path, redis_url, tiny_qwen35, monkeypatch):
    """A micro-batch that does not fit ends the trainer with the settings to lower; what it had not checkpointed is
    trained by the next start, every chunk once."""
    import trainer.daemon as daemon

    settings = make_settings(tmp_path, redis_url, tiny_qwen35)
    run, report = produce_and_extract(settings)
    real_backward, calls = daemon.backward, []

    def fits_four_times(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(daemon, "backward", fits_four_times)
    with pytest.raises(TrainerOutOfMemory, match=r"ran out of memory on cpu with \d+ samples, \d+ padded tokens of chunk "
                                          r".*lower train.micro_batch_tokens \(now 1024\) or train.num_anchors"):
        Trainer(run, "cpu", progress=False).run_until_done()
    monkeypatch.setattr(daemon, "backward", real_backward)
    result = Trainer(Run.open(settings), "cpu", progress=False).run_until_done()
    assert result.consumed[0] == report.admitted
    trained = final_state(settings).consumed[0]
    assert sorted(trained) == sorted(set(trained)) == stream_chunk_ids(run.conn, run.keys, 0)
    assert_backlog_drained(run)


@pytest.mark.slow
def test_the_next_steps_blobs_are_read_while_a_step_trains(tmp_path, redis_url, tiny_qwen35, monkeypatch):
    """Reading a blob (file, zstd) overlaps the step before it: with every read and every step slowed, only the first
    step waits for its blob; every chunk is still trained once."""
    import trainer.daemon as daemon

    settings = make_settings(tmp_path, redis_url, tiny_qwen35)
    run, report = produce_and_extract(settings)
    real_read, real_backward = run.store.read, daemon.backward

    def slow_read(path):
        time.sleep(0.4)
        return real_read(path)

    def slow_backward(*args, **kwargs):
        time.sleep(0.6)
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(run.store, "read", slow_read)
    monkeypatch.setattr(daemon, "backward", slow_backward)
    result = Trainer(run, "cpu", progress=False).run_until_done()
    assert result.consumed[0] == report.admitted >= 4
    log = [json.loads(line) for line in Path(run.store.path(settings.train.log_file)).read_text().splitlines()]
    reads = [r["seconds"]["read"] for r in log if "lr" in r]
    assert reads[0] >= 0.35 and max(reads[1:]) < 0.2, reads
    trained = final_state(settings).consumed[0]
    assert sorted(trained) == sorted(set(trained)) == stream_chunk_ids(run.conn, run.keys, 0)
    assert_backlog_drained(run)


def test_a_resumed_optimizer_keeps_the_live_machines_adamw_implementation():
    # a checkpoint of a GPU trainer (fused AdamW) resumed where AdamW runs multi-tensor, and the other way round:
    # the moments carry over, the implementation stays the one the resuming machine picked
    from trainer.parallel import full_state, load_full_state
    from trainer.ranks import Ranks
    from trainer.step import build_optimizer

    def trained(fused):
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    for saved_fused in (True, None):
        model, optimizer = trained(saved_fused)
        weights, state = full_state(model, optimizer)
        live = torch.nn.Linear(4, 3)
        live_optimizer, _ = build_optimizer(live.parameters(), 1e-2, 0.0, WarmupCosine(0.0, 10))
        live_optimizer.param_groups[0]["fused"] = not saved_fused or None  # what the resuming machine chose
        load_full_state(live, live_optimizer, Ranks(), weights, state)
        assert live_optimizer.param_groups[0]["fused"] == (not saved_fused or None)
        for p, q in zip(optimizer.param_groups[0]["params"], live_optimizer.param_groups[0]["params"]):
            assert torch.equal(optimizer.state[p]["exp_avg_sq"], live_optimizer.state[q]["exp_avg_sq"])
        live(torch.ones(2, 4)).sum().backward()
        live_optimizer.step()  # the loaded state suits the implementation (fused keeps its step as a tensor)
        assert float(live_optimizer.state[live.weight]["step"]) == 2.0
