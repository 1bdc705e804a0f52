"""The trainer on two ranks (gloo on the CPU) against a real Redis and real blobs: the same weights as one rank
taking the same chunks two per step, exactly once per epoch across a rank's SIGKILL and restarts (also with fewer
ranks), and status listing every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dflashq.keys import TRAINER_GROUP
from dflashq.run import Run
from ops import status as status_view
from test_trainer import ROOT, assert_backlog_drained, cli_args, final_state, make_settings, produce_and_extract, stream_chunk_ids
from trainer import checkpoint
from trainer.daemon import Trainer
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.ranks import consumer_name


def train_command(settings, *extra):
    return [sys.executable, "-m", "ops.cli", "train", "--device", "cpu", "--no-progress", *cli_args(settings),
            "-s", f"train.parallel={settings.train.parallel}", *extra]


def step_records(run) -> list[dict]:
    lines = Path(run.store.path("train_log.jsonl")).read_text().splitlines()
    return [r for r in map(json.loads, lines) if "chunks" in r]


def wait_for_step(run, proc, step, timeout=300):
    deadline = time.monotonic() + timeout
    while json.loads(run.conn.hget(run.keys.trainer, "step") or b"0") < step:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the ranks never got that far"
        time.sleep(0.05)


def rank_pid(run, rank) -> int:
    return json.loads(run.conn.hget(run.keys.trainer_ranks, str(rank)))["pid"]


def assert_each_chunk_trained_once(settings, run, admitted):
    state = final_state(settings)
    trained = state.consumed[0]
    assert len(trained) == len(set(trained)) == admitted and sorted(trained) == stream_chunk_ids(run.conn, run.keys, 0)
    assert state.epoch == 1
    assert_backlog_drained(run)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_give_the_weights_of_one_rank_taking_two_chunks_per_step(tmp_path, redis_url, tiny_qwen35, parallel):
    # keep: both runs read the same blobs
    extra = {"store.retention": "keep", "train.checkpoint_every_steps": 1000, "train.parallel": parallel}
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **extra)
    run, report = produce_and_extract(settings, conversations=40)
    assert report.admitted >= 5 and report.admitted % 2 == 1  # odd: the last step leaves rank 1 without a chunk
    # Deal the entries as pending, alternately, to trainer-rank0 and trainer-rank1: each rank re-reads its own first
    # (as after a restart), so step i trains entries 2i and 2i+1 on two ranks, as one rank reading two at a time.
    run.conn.xgroup_create(run.keys.results, TRAINER_GROUP, id="0")
    for i in range(report.admitted):
        run.conn.xreadgroup(TRAINER_GROUP, consumer_name(i % 2), {run.keys.results: ">"}, count=1)
    two = subprocess.run(train_command(settings, "--ranks", "2"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "ranks" in two.stdout and f"{report.admitted} chunks trained" in two.stdout
    status = json.loads(subprocess.run([sys.executable, "-m", "ops.cli", "status", "--json", *cli_args(settings)],
                                       cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)
    assert status["trainer"]["ranks"] == 2 and status["trainer"]["parallel"] == parallel and status["trainer"]["done"] is True
    ranks = status["trainer_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["consumer"] for r in ranks] == ["trainer-rank0", "trainer-rank1"]
    assert [r["chunks"] for r in ranks] == [(report.admitted + 1) // 2, report.admitted // 2]
    assert all(r["busy_tokens_per_second"] > 0 for r in ranks)
    assert status["rates"]["training_tokens_per_second"] == sum(r["busy_tokens_per_second"] for r in ranks)
    console = Console(width=200, record=True)
    console.print(status_view.render(status_view.collect(run), redis_url))
    view = console.export_text()
    assert "trainer ranks" in view and "trainer-rank0" in view and "trainer-rank1" in view
    records_two = step_records(run)
    steps_two = [r["chunks"] for r in records_two]
    assert [len(chunks) for chunks in steps_two] == [2] * (report.admitted // 2) + [1]

    ckpts = Path(run.store.path("checkpoints"))
    two_ranks = checkpoint.read(checkpoint.latest(ckpts.rename(ckpts.with_name("checkpoints-two-ranks"))))
    run.conn.xgroup_destroy(run.keys.results, TRAINER_GROUP)  # the same entries again, from the start
    one = make_settings(tmp_path, redis_url, tiny_qwen35, **extra, **{"train.chunks_per_step": 2})
    result = Trainer(Run.open(one), "cpu", progress=False).run_until_done()
    assert result.consumed == {0: report.admitted}
    records_one = step_records(run)[len(records_two):]
    assert [r["chunks"] for r in records_one] == steps_two  # the same chunks, step by step
    # the same averaged gradient (AdamW would hide a wrong scale of it; its norm does not) and the same loss, to fp32
    # precision at the first step: FSDP's reduce-scatter sums in another order than one rank does (seen: 1.6e-7
    # relative). Later steps carry that noise through AdamW at the full rate (seen: 1.3e-5 relative at the third).
    for field in ("grad_norm", "loss", "tokens", "lr"):
        torch.testing.assert_close(records_two[0][field], records_one[0][field], rtol=1e-5, atol=0)
        torch.testing.assert_close([r[field] for r in records_two], [r[field] for r in records_one], rtol=1e-4, atol=0)
    one_rank = checkpoint.read(checkpoint.latest(ckpts))
    assert one_rank.state.step == two_ranks.state.step == len(steps_two)
    torch.manual_seed(settings.train.seed)
    initial = DFlashDrafter(DrafterConfig(**one_rank.drafter_config)).state_dict()
    assert any(not torch.allclose(initial[k], one_rank.weights[k]) for k in initial)  # it trained
    # AdamW's normalised update moves a weight whose gradient is near zero by up to the whole rate either way, so the
    # reduction-order noise can show in a few weights (seen: 6.6e-5 in 1 of 8,192); a wrong step would move most of them
    # by the order of the rate (6e-4), three times this tolerance
    torch.testing.assert_close(two_ranks.weights, one_rank.weights, rtol=1.3e-6, atol=2e-4)
    for name, slots in one_rank.optimizer["state"].items():
        torch.testing.assert_close(two_ranks.optimizer["state"][name], slots)
    assert sorted(two_ranks.rng) == [0, 1]  # both ranks' RNG states


@pytest.mark.slow
def test_sigkill_of_one_rank_restarts_the_group_and_trains_every_chunk_once(tmp_path, redis_url, tiny_qwen35):
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"data.chunk_tokens": 256, "train.checkpoint_every_steps": 2})
    run, report = produce_and_extract(settings)
    assert report.admitted >= 8
    proc = subprocess.Popen(train_command(settings, "--ranks", "2", "--max-restarts", "1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(run, proc, 3)  # past the first checkpoint (step 2)
    killed = rank_pid(run, 1)
    os.kill(killed, signal.SIGKILL)
    killed_at = final_state(settings)
    assert 0 < len(killed_at.consumed[0]) < report.admitted
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert rank_pid(run, 1) != killed  # the launcher started the group again
    state = assert_each_chunk_trained_once(settings, run, report.admitted)
    assert f"{report.admitted} chunks trained, {state.duplicates_skipped.get(0, 0)} duplicates skipped" in out.decode()
    log = [json.loads(line) for line in Path(run.store.path("train_log.jsonl")).read_text().splitlines()]
    assert any(r.get("event") == "resumed" and r["ranks"] == 2 for r in log)


@pytest.mark.slow
def test_sigterm_stops_the_group_cleanly_and_a_restart_on_fewer_ranks_claims_the_missing_ranks_entries(
        tmp_path, redis_url, tiny_qwen35):
    # no checkpoint but the one at a stop: every entry trained since stays pending for the rank that read it
    settings = make_settings(tmp_path, redis_url, tiny_qwen35, **{"data.chunk_tokens": 256, "train.checkpoint_every_steps": 1000})
    run, report = produce_and_extract(settings)
    assert report.admitted >= 10
    # SIGTERM to the launcher: every rank finishes its step, one checkpoint, acknowledgements, exit 0
    proc = subprocess.Popen(train_command(settings, "--ranks", "2"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(run, proc, 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "(stopped)" in out.decode(), err.decode()[-3000:]
    stopped = final_state(settings)
    assert 0 < len(stopped.consumed[0]) <= report.admitted - 6
    # all it trained is acknowledged; what stays pending is each rank's read-ahead for the next step, untrained
    held = run.conn.xpending_range(run.keys.results, TRAINER_GROUP, "-", "+", 100)
    assert len(held) <= 2 * settings.train.chunks_per_step
    held_chunks = {f[b"chunk"].decode() for p in held for _, f in run.conn.xrange(run.keys.results, p["message_id"], p["message_id"])}
    assert not held_chunks & set(stopped.consumed[0])
    # SIGKILL of rank 1: the launcher stops rank 0 and exits with the death
    proc = subprocess.Popen(train_command(settings, "--ranks", "2"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    wait_for_step(run, proc, stopped.step + 2)
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    assert proc.wait(timeout=120) == 128 + signal.SIGKILL
    pending = {c["name"].decode(): c["pending"] for c in run.conn.xinfo_consumers(run.keys.results, TRAINER_GROUP)}
    assert pending["trainer-rank1"] >= 2 and pending["trainer-rank0"] >= 2
    result = Trainer(Run.open(settings), "cpu", progress=False).run_until_done()  # one rank now
    assert not result.stopped and result.duplicates_skipped == {}
    assert_each_chunk_trained_once(settings, run, report.admitted)
    pending = {c["name"].decode(): c["pending"] for c in run.conn.xinfo_consumers(run.keys.results, TRAINER_GROUP)}
    assert pending == {"trainer-rank0": 0, "trainer-rank1": 0}  # the missing rank's entries were claimed
