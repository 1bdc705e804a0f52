"""The benchmark scripts in their CPU modes: they run, and what they report adds up (figures only mean something
on the GPU; see docs/performance.md)."""

from __future__ import annotations

import argparse
import collections
import fcntl
import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent


def bench(script, *args):
    # its own process group: past the timeout (a hang) its children go with it
    proc = subprocess.Popen([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.slow
def test_extract_benchmark_reports_every_phase_and_every_blob():
    report, log = bench("extract.py", "--tiny", "--chunks", "2", "--profile")
    assert report["chunks"] == 2 and report["announced_blobs"] == 2
    for phase in ("warm-up", "plain", "bare", "bare, any row count", "capture", "e2e", "e2e steady state", "verify"):
        assert f"\n{phase}: " in "\n" + log
    assert report["plain_tokens_per_s"] > 0 and report["bare_tokens_per_s"] > 0 and report["e2e_tokens_per_s"] > 0
    # the unmasked worker forward's blobs agree with plain, unbatched Transformers (fp32: to 1e-4 of each layer's max)
    assert report["verify_ok"] and report["verify_samples"] == 4 and max(report["verify_max_rel_diff"].values()) < 1e-4
    assert max(report["float32_error_stored"].values()) < 1e-4 and report["e2e_steady_tokens_per_s"] > 0
    assert report["fused_kernels"] == {}  # fla's kernels are GPU only
    assert 0 < report["padding_fraction"] <= report["padding_fraction_any_row_count"] < 1  # row buckets add none
    assert report["bare_any_row_count_tokens_per_s"] > 0 and report["row_buckets_vs_any_row_count"] > 0
    # tiny model, float32 on the CPU: 3 tapped layers x hidden 64 x 4 bytes raw per token; shuffle + zstd saves some
    assert 0 < report["bytes_per_token"] < 3 * 64 * 4 and report["compression_ratio"] > 1
    assert "Self CPU" in log  # the --profile table
    # both codecs on the same states, one core each: fp8 stores fewer bytes, with its rounding error, bf16 none
    codecs = report["codecs_one_core"]
    assert codecs["tokens"] > 0 and codecs["fp8_vs_bf16_bytes"] < 0.7
    assert codecs["bf16"]["relative_error_per_layer"] == [0.0] * 3
    assert all(0 < e < 2 ** -4 for e in codecs["fp8"]["relative_error_per_layer"])
    assert min(codecs[c][k] for c in ("bf16", "fp8") for k in ("encode_mb_per_s_per_core", "decode_mb_per_s_per_core")) > 0


@pytest.mark.slow
def test_extract_benchmark_with_the_fp8_codec():
    report, _ = bench("extract.py", "--tiny", "--chunks", "2", "--codec", "fp8")
    assert report["codec"] == "fp8" and report["announced_blobs"] == 2 and report["verify_ok"]
    # float32 states to 1 byte + a scale per token and layer: well under half of the lossless blob
    assert report["compression_ratio"] > 3 and 2 ** -8 < max(report["float32_error_stored"].values()) < 2 ** -4


@pytest.mark.slow
def test_codec_benchmark_compares_both_codecs_on_the_same_states():
    report, _ = bench("codec.py", "--tiny")
    bf16, fp8 = report["bf16"], report["fp8"]
    assert report["tokens"] == 512 and report["dtype"] == "bfloat16"
    assert bf16["relative_error_per_layer"] == [0.0, 0.0]  # lossless
    assert all(0 < e < 2 ** -4 for e in fp8["relative_error_per_layer"])
    # what the encoder recorded is what the decoded blob shows (the dequantized values' bf16 rounding aside)
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(fp8["recorded_relative_error"], fp8["relative_error_per_layer"]))
    assert report["fp8_vs_bf16_bytes"] == round(fp8["bytes_per_token"] / bf16["bytes_per_token"], 3) < 0.7
    assert min(bf16["encode_mb_per_s_per_core"], fp8["encode_mb_per_s_per_core"], fp8["decode_mb_per_s_per_core"]) > 0
    # the e4m3 bytes' entropy: knowing the channel can only lower it; the bound is set against the bf16 codec's bytes
    ent = report["fp8_entropy"]
    assert 0 < ent["channel_entropy_bits"] <= ent["byte_entropy_bits"] <= 8
    assert ent["channel_entropy_vs_bf16_bytes"] == pytest.approx(ent["channel_entropy_bits"] / 8 / bf16["bytes_per_value"], abs=2e-3)


@pytest.mark.slow
def test_train_benchmark_steps():
    report, _ = bench("train.py", "--tiny", "--steps", "2", "--warmup-steps", "1")
    assert report["last_loss"] > 0 and math.isfinite(report["last_loss"])
    # both rates over the timed steps only (the warm-up step, which compiles on a GPU, left out)
    # each rate is rounded in the report (tokens/s to 0.1, samples/s to 0.001): compare within that rounding
    rounding = 0.05 + report["seq_len"] * 0.0005
    assert report["tokens_per_s"] == pytest.approx(report["seq_len"] * report["samples_per_s"], abs=rounding)
    assert report["cpu"]["model"] and report["cpu"]["cores"] >= 1 and not report["automatic_dynamic"]
    # on the CPU no region is compiled (trainer.fused: GPU training only), with or without the marking
    assert report["graphs_compiled"] == 0


@pytest.mark.slow
def test_train_benchmark_chat_lengths_leave_prompts_out_of_the_loss():
    report, _ = bench("train.py", "--tiny", "--lengths", "chat", "--steps", "3", "--warmup-steps", "0",
                      "--automatic-dynamic")
    assert report["automatic_dynamic"]
    assert report["last_loss"] > 0 and math.isfinite(report["last_loss"])
    # supervised tokens per sample: under the longest sample, as the unsupervised prompts and shorter samples take
    assert 0 < report["tokens_per_s"] < report["seq_len"] * report["samples_per_s"]


@pytest.mark.slow
def test_produce_benchmark_admits_every_conversation():
    report, _ = bench("produce.py", "--conversations", "200", "--processes", "1")
    assert report["conversations"] == 200 and report["chunks"] > 0
    assert report["tokens_per_second"] > 0 and 500 < report["tokens_per_conversation"] < 2000


@pytest.mark.slow
def test_worker_shape_buckets_cost_at_most_two_percent_in_padding_on_real_conversations():
    """The power-of-two row buckets that let kernels autotune once per host, on ShareGPT prompts with a
    target's own answers (the quality benchmark's data), as the producer packs them."""
    report, _ = bench("produce.py", "--data", "benchmarks/results/regenerated-smollm2-sharegpt-3000.jsonl.gz",
                      "--processes", "1")
    assert report["conversations"] > 2900 and report["chunks"] > 100
    assert 0 < report["padding_fraction"] < 0.5 and report["bucketing_throughput_cost"] <= 0.02


QUALITY_PHASES = ("model", "prompts", "regenerate", "up", "eval")


@pytest.fixture(scope="session")
def tiny_quality_run(tmp_path_factory) -> tuple[Path, dict]:
    """benchmarks/quality.py --tiny once for the whole test run, every phase: its folder and its report. Under
    pytest-xdist the first process that needs it makes it in the folder all processes share, and the others wait for
    it. Its users only read the folder; what they change, they change in a copy (copy_quality_run)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this test run's, above each process's own
    work, made = root / "tiny-quality-run", root / "tiny-quality-run.json"
    with open(root / "tiny-quality-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            report, _ = bench("quality.py", "--tiny", "--work", str(work))
            made.write_text(json.dumps(report))
    return work, json.loads(made.read_text())


def copy_quality_run(work: Path, to: Path, phases=QUALITY_PHASES) -> Path:
    """The run's folder as far as `phases` go (state.json keeps only those): a later run goes on from there. Its
    Redis folder stays behind: the copy's `up`, if it runs, starts one of its own."""
    done = {"model": ["model"], "prompts": ["sharegpt.jsonl"], "regenerate": ["regenerated.jsonl"],
            "up": ["runs"], "eval": ["eval"]}
    to.mkdir(parents=True)
    for phase in phases:
        for name in done[phase]:
            shutil.copytree(work / name, to / name, ignore=shutil.ignore_patterns("redis")) if (work / name).is_dir() \
                else shutil.copy(work / name, to / name)
    state = json.loads((work / "state.json").read_text())
    (to / "state.json").write_text(json.dumps({phase: state[phase] for phase in phases}))
    return to


@pytest.mark.slow
def test_quality_benchmark_runs_every_phase_and_resumes(tiny_quality_run, tmp_path):
    quality, report = tiny_quality_run
    work = str(quality)
    assert report["prompts"]["conversations"] == 24  # read object by object from the cut-off ShareGPT JSON
    from dflashq import settings as settings_module

    assert settings_module.load(Path(work) / "run.toml").backpressure.max_backlog == 512  # the extraction runs ahead
    # the recipe as run, not only as asked: --tiny overrides the command's defaults
    assert report["train"] == {"epochs": 2, "num_anchors": 8, "learning_rate": 3e-3, "micro_batch_tokens": 32768}
    assert report["regenerate"]["regenerated"] > 0 and report["regenerate"]["failed"] == 0
    assert report["up"]["records_read"] == report["regenerate"]["regenerated"] and "code_records" not in report["up"]
    assert report["up"]["steps"] > 0 and report["up"]["tokens_extracted"] > 0 and Path(report["up"]["curve"]).is_file()
    assert report["up"]["median_step_seconds"].keys() == {"between", "read", "compute"}
    up = report["up"]  # --tiny: 2 epochs
    assert len(up["wall_seconds_per_epoch"]) == len(up["train_eal_last_50_steps_per_epoch"]) == 2
    assert all(s > 0 for s in up["wall_seconds_per_epoch"]) and all(e >= 1 for e in up["train_eal_last_50_steps_per_epoch"])
    assert [w["seconds_per_chunk"]["write"] > 0 for w in report["up"]["workers"].values()] == [True]  # --tiny: 1 worker
    assert all(rate > 0 for rate in report["up"]["trainer_busy_tokens_per_second"])
    for name in ("mt_bench", "humaneval"):
        result = report["eval"][name]
        # dflashq eval and the reference dflash loop report the same tau and text on every prompt (in 2 shards; a
        # Llama target: croppable), and both prompts equal plain greedy decoding
        assert result["prompts"] == 2 and result["lossless_checked"] == result["lossless"] == 2
        assert result["per_prompt_tau_equal"] == result["per_prompt_text_equal"] == 2
        assert result["dflashq_tau"] == result["reference_tau"] >= 1.0
        shares = result["per_position_acceptance"]  # one per draft slot (block 4), never rising along the block
        assert len(shares) == 3 and all(1 >= a >= b >= 0 for a, b in zip(shares, shares[1:]))
    # the goal's verdict: every device phase's minutes (the prompts are the CPU's), their total, and the taus beside it
    e2e = report["end_to_end"]
    assert e2e["minutes"] == {p: round(report[p]["seconds"] / 60, 2) for p in ("model", "regenerate", "up", "eval")}
    assert e2e["regenerate_counted"] == "this run" and e2e["total"] == round(sum(e2e["minutes"].values()), 2)
    assert e2e["reached"] == (e2e["total"] <= 25 and report["eval"]["mt_bench"]["dflashq_tau"] >= 2.5
                              and report["eval"]["humaneval"]["dflashq_tau"] >= 3.0)
    # the same drafter's offline EAL on its own records and on the eval's prompts with the target's answers
    gen, _ = bench("generalization.py", "--work", work, "--samples", "2", "--logged-steps", "2")
    assert gen["anchors"] == 8 and gen["drafter"].startswith("drafter-step-")
    for name in ("trained", "mt_bench", "humaneval"):
        assert gen[name]["samples"] == 2 and 1.0 <= gen[name]["offline_eal"] <= 4.0 and len(gen[name]["acc"]) == 3
    for name in ("mt_bench", "humaneval"):  # the tau beside it is the eval's, on the same prompts
        assert gen[name]["tau"] == pytest.approx(report["eval"][name]["dflashq_tau"], abs=1e-3)
    # the last two steps' chunks found again by packing the data as the producer did, and measured about as logged
    steps = gen["logged_steps"]["steps"]
    assert [s["step"] for s in steps] == [report["up"]["steps"] - 1, report["up"]["steps"]]
    assert all(abs(s["measured_eal"] - s["logged_eal"]) < 1.0 for s in steps)
    again, log = bench("quality.py", "--tiny", "--work", work)
    assert all(f"{phase}: done earlier" in log for phase in QUALITY_PHASES)
    assert again["eval"] == report["eval"]
    # an eval cut short: shard 1 lost its last prompt, and its file ends in a torn line; the rerun does that prompt only
    work = str(copy_quality_run(quality, tmp_path / "cut-short"))
    state_file, shard = Path(work, "state.json"), Path(work, "eval", "shard-1.jsonl")
    state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items() if k != "eval"}))
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    resumed, log = bench("quality.py", "--tiny", "--work", work)
    assert "eval shard 1: 1 prompts done" in log and "eval shard 0:" not in log
    assert resumed["eval"].keys() == report["eval"].keys()
    for name in ("mt_bench", "humaneval"):
        assert {k: v for k, v in resumed["eval"][name].items() if "seconds" not in k} == \
            {k: v for k, v in report["eval"][name].items() if "seconds" not in k}


def quality_record(path, tokens, taus, **fields):
    evaluated = {name: {"prompts": 24, "dflashq_tau": tau} for name, tau in zip(("mt_bench", "humaneval"), taus)}
    path.write_text(json.dumps({"up": {"tokens_extracted": tokens, "seconds": tokens / 1e5}, "eval": evaluated, **fields}))


@pytest.mark.slow
def test_tau_scaling_reads_each_runs_recipe_and_fits_only_across_token_counts(tmp_path):
    # two runs from before the recipe was recorded (their flags, else that day's defaults: 512 anchors, 2 epochs)
    quality_record(tmp_path / "quality-a-h200-2026-12-01.json", 1e6, (1.2, 1.3), command="quality.py --epochs 4")
    quality_record(tmp_path / "quality-b-h200-2026-12-02.json", 4e6, (1.5, 1.7), command="quality.py --anchors 512")
    # 128 anchors: recorded recipes, one run from a card that sorts first by name but is the newest by date
    quality_record(tmp_path / "quality-s-h200-2026-12-03.json", 2e6, (2.0, 2.2), command="quality.py --anchors 128 --epochs 5")
    quality_record(tmp_path / "quality-s-h100-2026-12-06.json", 2e6, (2.4, 2.7), command="quality.py",
                   train={"epochs": 6, "num_anchors": 128, "learning_rate": 6e-4, "micro_batch_tokens": 32768})
    report, _ = bench("tau_scaling.py", "--results", str(tmp_path), "--png", str(tmp_path / "a.png"))
    rows = {r["run"]: (r["anchors"], r["trained_tokens"]) for r in report["runs"]}
    assert rows == {"a-h200-2026-12-01": (512, 4e6), "b-h200-2026-12-02": (512, 8e6),
                    "s-h200-2026-12-03": (128, 1e7), "s-h100-2026-12-06": (128, 1.2e7)}
    assert report["fit"]["mt_bench"]["exponent"] > 0 and report["fit"]["mt_bench"]["tokens_for_goal_m"] > 8
    assert math.isclose(report["seconds_per_trained_token"], 4e6 / 1e5 / 8e6)  # run b: the newest at 512
    report, _ = bench("tau_scaling.py", "--results", str(tmp_path), "--png", str(tmp_path / "b.png"), "--anchors", "128")
    assert math.isclose(report["seconds_per_trained_token"], 2e6 / 1e5 / 1.2e7)  # the H100 run, dated last
    # 10 and 12 M trained tokens: too close for a slope, so no fit and no goal read off one
    assert all(fit["fit"].startswith("none") for fit in report["fit"].values())


@pytest.mark.slow
def test_quality_benchmark_interrupted_stops_its_redis_and_compares_with_the_reference_on_the_first_prompts_only(
        tiny_quality_run, tmp_path):
    """From the shared run's regenerated records: `up` and the eval again with other flags. Ctrl-C while `up` trains
    stops `up`'s children gracefully and then the run's embedded Redis (nothing is left running); the rerun goes on."""
    import conftest
    from dflashq.keys import Keys
    from ops.redis_server import EmbeddedRedis

    work = copy_quality_run(tiny_quality_run[0], tmp_path / "q", ("model", "prompts", "regenerate"))
    flags = ["--tiny", "--work", str(work), "--reference-prompts", "1", "--code-repeats", "3"]
    before = set(conftest.started_here())
    # its own session, as a terminal's foreground job: Ctrl-C reaches quality.py and `up`, not `up`'s children
    with open(tmp_path / "interrupted.log", "w") as log:  # a file: a pipe nobody reads while polling would fill up
        interrupted = subprocess.Popen([sys.executable, "benchmarks/quality.py", *flags], cwd=ROOT,
                                       start_new_session=True, stdout=subprocess.DEVNULL, stderr=log)
    server, trainer = EmbeddedRedis(str(work / "runs" / "quality")), Keys("quality").trainer
    try:
        deadline = time.monotonic() + 600
        while not (server.url() and trainer_step(server.url(), trainer) >= 1):
            assert time.monotonic() < deadline and interrupted.poll() is None, "the trainer never stepped"
            time.sleep(0.1)
        os.killpg(interrupted.pid, signal.SIGINT)
        interrupted.wait(timeout=600)
    finally:
        if interrupted.poll() is None:
            os.killpg(interrupted.pid, signal.SIGKILL)
            interrupted.wait()
    err = (tmp_path / "interrupted.log").read_text()
    assert interrupted.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert conftest.left_running(before) == {}  # `up`, its children and the embedded redis-server all ended
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url(), socket_connect_timeout=1).ping()
    report, _ = bench("quality.py", *flags)
    # the producer read each record holding code three times: once in the regenerated file, twice after it
    up = report["up"]
    assert up["code_records"] >= 1 and up["records_read"] == report["regenerate"]["regenerated"] + 2 * up["code_records"]
    for name in ("mt_bench", "humaneval"):
        result = report["eval"][name]
        assert result["prompts"] == 2 and result["reference_prompts"] == 1
        assert result["per_prompt_tau_equal"] == result["per_prompt_text_equal"] == 1
        assert result["dflashq_tau_on_those"] == result["reference_tau"] >= 1.0


def trainer_step(url: str, key: str) -> int:
    try:
        return int(json.loads(redis.Redis.from_url(url, socket_connect_timeout=1).hget(key, "step") or "0"))
    except redis.ConnectionError:
        return 0


@pytest.mark.slow
def test_regenerate_benchmark_compares_engines_decoders_and_batch_plans_on_the_same_records():
    report, _ = bench("regenerate.py", "--tiny", "--static")
    assert report["whole"] is False
    for name in ("processes_1", "processes_2", "static"):
        result = report[name]
        assert result["regenerated"] == report["records"] == 12 and result["failed"] == result["rejected"] == 0
        assert result["generated_tokens"] > 0 and result["tokens_per_s"] > 0 and result["wall_seconds"] > 0
        # greedy in float32: one engine, two, or the static decoder write the same turns
        assert result["same_records_as_first"] == 12
    split = report["static"]["static_decoder_seconds"]  # the CPU captures no graph
    assert split["prompt"] > 0 and split["decode"] > 0 and "capture" not in split and split["row_steps"] >= 12
    # --whole keeps every turn; each --batch-fixed-tokens value is a static run: every row alone (0) or batches packed
    # full (1e12) write the same float32 greedy turns, more tokens than the first turns alone
    whole, _ = bench("regenerate.py", "--tiny", "--whole", "--batch-fixed-tokens", "0,1e12")
    alone, packed = whole["static_fixed_0"], whole["static_fixed_1000000000000"]
    assert whole["whole"] is True and alone["regenerated"] == packed["regenerated"] == whole["records"] == 12
    assert alone["same_records_as_first"] == packed["same_records_as_first"] == 12
    assert alone["generated_tokens"] == packed["generated_tokens"] > report["static"]["generated_tokens"]


@pytest.mark.slow
def test_workers_benchmark_times_one_against_two_workers_and_a_warm_restart():
    report, log = bench("workers.py", "--tiny")
    one, two, restart = report["one"], report["n"], report["restart"]
    # the same chunks drained by one real worker process and by two, each chunk once; both of the two took some
    assert one["chunks"] == two["chunks"] > 2 and one["tokens"] == two["tokens"] > 0
    assert sum(one["chunks_per_worker"].values()) == one["chunks"] and len(two["chunks_per_worker"]) == 2
    assert 0 < one["tokens_per_s"] and 0 < two["tokens_per_s"] and report["scaling"] == pytest.approx(
        two["tokens_per_s"] / (2 * one["tokens_per_s"]), abs=1e-3)
    # the rate up to the last blob's announcement beside it (on the CPU's tiny blobs a writer can finish before RQ
    # records the job's end, so it is not always the later one), each worker's chunk times beside
    assert one["seconds_to_last_announced"] > 0 and len(two["seconds_per_chunk"]) == 2
    assert one["tokens_per_s_to_last_announced"] == pytest.approx(one["tokens"] / one["seconds_to_last_announced"], rel=0.01)
    # the warm restart: the old process finished its chunks, the new one took the rest
    assert restart["chunks_before"] >= 2 and restart["chunks_after"] >= 1
    assert 0 < restart["restart_gap_seconds"] < 120 and 0 < restart["first_start_seconds"] < 120
    assert restart["first_chunk_after_restart_tokens_per_s"] > 0 and restart["steady_chunk_tokens_per_s"] > 0
    assert len(restart["chunk_seconds"]) == len(restart["chunk_tokens"]) == restart["chunks_before"] + restart["chunks_after"]
    # Triton's autotuning counted per process from its log (none on the CPU, where no Triton kernel runs)
    assert restart["autotuning_first_process"] == restart["autotuning_after_restart"] == \
        {"runs": 0, "seconds": 0, "runs_in_jobs": 0, "warm_up_seconds": None}


@pytest.mark.slow
def test_train_benchmark_on_two_ranks_reports_each_rank_and_the_scaling():
    report, _ = bench("train.py", "--tiny", "--steps", "1", "--warmup-steps", "0", "--ranks", "2")
    one, per_rank = report["one_rank"], report["per_rank"]
    assert report["ranks"] == 2 and len(per_rank) == 2 and one["samples_per_s"] > 0
    assert all(r["samples_per_s"] > 0 and math.isfinite(r["last_loss"]) and r["mfu"] is None for r in per_rank)  # MFU: GPU only
    total = sum(r["samples_per_s"] for r in per_rank)
    assert report["samples_per_s"] == round(total, 3)
    assert report["scaling_efficiency"] == round(total / (2 * one["samples_per_s"]), 3) > 0


@pytest.mark.slow
def test_attention_benchmark_checks_each_path_against_the_cpu_reference():
    report, _ = bench("attention.py", "--tiny", "--paths", "sdpa,flex")
    sdpa, flex = report["paths"]
    # on the CPU the SDPA path is the reference's own computation: equal up to float32 rounding
    assert sdpa["supported"] and sdpa["hidden_rel_error"] < 1e-5 and sdpa["grad_rel_error_max"] < 1e-5
    assert sdpa["median_ms"] > 0 and report["blocks"] == 3 * 16
    assert not flex["supported"] and "CPU" in flex["reason"]  # flex has no CPU backward: said, not a crash


@pytest.mark.slow
def test_quality_benchmark_starts_from_an_earlier_runs_regenerated_records(tiny_quality_run, tmp_path):
    a, first = tiny_quality_run  # the earlier run, which regenerated the records itself
    assert first["regenerate"]["generated_tokens"] > 0 and first["end_to_end"]["regenerate_counted"] == "this run"
    with gzip.open(tmp_path / "earlier.jsonl.gz", "wb") as f:
        f.write((a / "regenerated.jsonl").read_bytes())
    # b and c start with the same model and prompts (those phases done), without regenerated records
    b = copy_quality_run(a, tmp_path / "b", ("model", "prompts"))
    second, _ = bench("quality.py", "--tiny", "--work", str(b), "--stop-after", "regenerate",
                      "--regenerated", str(tmp_path / "earlier.jsonl.gz"))
    assert "up" not in second  # --stop-after
    # every record was done already: nothing generated, the same output
    assert second["regenerate"]["regenerated"] == first["regenerate"]["regenerated"]
    assert second["regenerate"]["generated_tokens"] == 0
    assert (b / "regenerated.jsonl").read_bytes() == (a / "regenerated.jsonl").read_bytes()
    # reuse hides the regeneration's cost: it counts as the time the file took to make, unknown unless given
    assert second["end_to_end"]["minutes"]["regenerate"] is None
    # the records may come in several files (say an earlier pass and a later one that added records)
    lines = (a / "regenerated.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "part1.jsonl").write_bytes(b"".join(lines[:5]))
    with gzip.open(tmp_path / "part2.jsonl.gz", "wb") as f:
        f.write(b"".join(lines[5:]))
    c = copy_quality_run(a, tmp_path / "c", ("model", "prompts"))
    third, _ = bench("quality.py", "--tiny", "--work", str(c), "--stop-after", "regenerate",
                     "--regenerated", str(tmp_path / "part1.jsonl"), str(tmp_path / "part2.jsonl.gz"),
                     "--regenerated-seconds", "120")
    assert third["regenerate"]["generated_tokens"] == 0
    assert (c / "regenerated.jsonl").read_bytes() == (a / "regenerated.jsonl").read_bytes()
    assert third["end_to_end"]["minutes"]["regenerate"] == 2.0
    assert third["end_to_end"]["regenerate_counted"] == "--regenerated-seconds"
    assert "total" not in third["end_to_end"]  # stopped after regenerate: the run's total is not known yet


def test_random_target_of_a_shape_is_a_folder_the_workers_load(tmp_path):
    """`benchmarks/workers.py --shape qwen3.6-27b` writes random weights of that shape (54 GB) as a Transformers folder
    with the Qwen3 tokenizer, for a restart to load from disk; checked here at the tiny shape."""
    from transformers import AutoTokenizer

    from benchmarks.extract import TINY, qwen35_text_config
    from benchmarks.workers import target_config, write_random_target
    from dflashq.target import load_target

    folder = write_random_target(tmp_path / "model", qwen35_text_config(dict(TINY, vocab_size=151936)), "cpu")
    assert list((tmp_path / "model").glob("*.safetensors"))
    model = load_target(folder)
    assert model.config.num_hidden_layers == 8 and model.config.layer_types[3::4] == ["full_attention"] * 2
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)["input_ids"]
    assert 0 < max(ids) < model.config.vocab_size
    # --shape smollm2: SmolLM2-135M's layers under a vocabulary the same tokenizer's ids fit
    smollm2 = target_config("smollm2")
    assert (smollm2.model_type, smollm2.hidden_size, smollm2.num_hidden_layers, smollm2.vocab_size) == ("llama", 576, 30, 151936)


@pytest.mark.slow
def test_tau_scaling_fit_recovers_a_known_power_law_and_its_goal(tmp_path):
    """Runs whose tau - 1 follows 0.02 * (tokens / 1e5) ** 0.75 (one other learning rate and one other anchor count off
    the curve, one fp8 run): the fit over the bf16 runs at 6e-4 and 512 anchors gives back the exponent and the tokens
    where tau reaches each goal."""
    def tau(tokens):
        return round(1 + 0.02 * (tokens / 1e5) ** 0.75, 6)

    def record(name, tokens_extracted, epochs, lr=6e-4, seconds=100.0, flags="", **extra):
        command = f"python benchmarks/quality.py --epochs {epochs} --learning-rate {lr} {flags}"
        evaluated = {b: {"prompts": 24, "dflashq_tau": tau(tokens_extracted * epochs)} for b in ("mt_bench", "humaneval")}
        (tmp_path / f"quality-{name}.json").write_text(json.dumps(
            {"command": command, "up": {"tokens_extracted": tokens_extracted, "seconds": seconds}, "eval": evaluated, **extra}))

    record("a-run1", 1_000_000, 2)
    record("a-run2", 2_000_000, 3)
    record("a-run3", 5_000_000, 4, seconds=400.0)
    record("a-run4", 5_000_000, 4, lr=2e-3)  # not fitted
    record("a-run5", 5_000_000, 4, flags="--anchors 128", seconds=1.0)  # another recipe: not fitted either
    (tmp_path / "quality-a-codec.json").write_text(json.dumps({"command": "--epochs 2", "runs": {
        "fp8": {"up": {"tokens_extracted": 1_000_000, "seconds": 1.0}, "eval": {"mt_bench": {"prompts": 24, "dflashq_tau": 9.0}}}}}))
    report, _ = bench("tau_scaling.py", "--results", str(tmp_path), "--png", str(tmp_path / "tau.png"))
    assert [r["run"] for r in report["runs"]] == ["a-run1", "a-run2", "a-run3", "a-run4", "a-run5"]  # fp8 left out
    for name, goal in (("mt_bench", 2.5), ("humaneval", 3.0)):
        fitted = report["fit"][name]
        assert fitted["runs"] == 3 and fitted["exponent"] == pytest.approx(0.75, abs=1e-3)
        tokens = 1e5 * ((goal - 1) / 0.02) ** (1 / 0.75)
        assert fitted["tokens_for_goal_m"] == pytest.approx(tokens / 1e6, rel=1e-2)
        # at the newest fitted run's rate: 400 s for its 20 M trained tokens
        assert fitted["up_minutes_for_goal"] == pytest.approx(tokens * 400.0 / 20e6 / 60, rel=1e-2)
    assert (tmp_path / "tau.png").stat().st_size > 10_000


def test_quality_counts_compiling_as_the_steps_far_above_the_median():
    from benchmarks.quality import epoch_figures

    # two epochs of 100 steps at 40 ms each, finishing one after the other; steps 1 and 3 compiled (5 s, 2 s) and
    # step 150 was slow for another reason (60 ms): only the two compiling steps count, less the median each
    steps, now = [], 1000.0
    for n in range(1, 201):
        compute = {1: 5.0, 3: 2.0, 150: 0.06}.get(n, 0.04)
        now += compute + 0.01
        steps.append({"step": n, "epoch": (n - 1) // 100, "loss": 5.0 - n / 100, "eal": 1 + n / 100, "time": now,
                      "seconds": {"between": 0.0, "read": 0.01, "compute": compute}})
    figures = epoch_figures(steps)
    assert figures["compile_seconds"] == round(5.0 + 2.0 - 2 * 0.04, 1)
    assert [s["step"] for s in figures["compiling_steps"]] == [1, 3]
    assert figures["wall_seconds_per_epoch"] == [round(7.0 + 98 * 0.04 + 100 * 0.01, 1), round(0.06 + 99 * 0.04 + 1.0, 1)]
    assert figures["train_eal_last_50_steps_per_epoch"] == [round(1 + sum(range(51, 101)) / 5000, 3),
                                                            round(1 + sum(range(151, 201)) / 5000, 3)]


def test_quality_reads_sharegpt_parts_from_their_first_human_turn_and_cuts_long_chats_at_an_exchange(tmp_path):
    from benchmarks.quality import sharegpt_records

    def turn(who, n):
        return {"from": who, "value": "x" * n}

    objects = [
        {"id": "a_0", "conversations": [turn("human", 10), turn("gpt", 10)]},  # kept whole
        # a later part of a split chat: its opening reply answers a message of the part before, so it starts after it
        {"id": "a_1", "conversations": [turn("gpt", 10), turn("human", 10), turn("gpt", 10)]},
        # too long as a whole (100 characters): cut after the last exchange within it
        {"id": "b_0", "conversations": [turn("human", 20), turn("gpt", 20), turn("human", 50), turn("gpt", 10)]},
        {"id": "c_0", "conversations": [turn("human", 90), turn("gpt", 20)]},  # its first exchange alone is too long
        {"id": "d_0", "conversations": [turn("gpt", 10)]},  # no exchange
        # four exchanges: the fourth is dropped (max_turns 3)
        {"id": "e_0", "conversations": [turn(w, 1) for _ in range(4) for w in ("human", "gpt")]},
    ]
    path = tmp_path / "sharegpt.json"
    text = "[\n" + ",\n".join(json.dumps(o) for o in objects) + ',\n{"id": "torn", "conversations": [{"fr'
    path.write_text(text)
    records = sharegpt_records(path, limit=100, max_chars=80, max_turns=3)
    assert [(r["id"], [len(t["value"]) for t in r["conversations"]]) for r in records] == [
        ("a_0", [10, 10]), ("a_1", [10, 10]), ("b_0", [20, 20]), ("e_0", [1] * 6)]
    assert records[0] == objects[0] and records[1]["conversations"][0]["from"] == "human"
    assert [r["id"] for r in sharegpt_records(path, limit=2, max_chars=80, max_turns=3)] == ["a_0", "a_1"]
    # --continuations: what the cuts left goes on from the next human turn, after every first record; the first
    # records are the same (an earlier regeneration of them still counts), each continuation has its own id
    more = sharegpt_records(path, limit=100, max_chars=80, max_turns=3, continuations=True)
    assert more[:4] == records
    assert [(r["id"], [len(t["value"]) for t in r["conversations"]]) for r in more[4:]] == [
        ("b_0@2", [50, 10]), ("e_0@6", [1, 1])]  # c_0's one exchange is over the limit on its own: left out
    assert more[4]["conversations"][0]["from"] == "human"


def test_quality_repeats_the_records_that_hold_code_in_any_turn(tmp_path):
    from benchmarks.quality import write_code_repeats

    def record(id, user, answer):
        return {"id": id, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    records = [
        record("fence", "Fix this", "Here:\n```python\nx = 1\n```"),
        record("asked", "Why does\n    def f(x):\nfail?", "It lacks a return."),  # code in the user's turn only
        record("c", "#include <stdio.h>\nint main() {}", "It prints nothing."),
        record("prose", "What is a class in school?", "A group of students; import means to bring in."),
    ]
    regenerated, out = tmp_path / "regenerated.jsonl", tmp_path / "code-repeats.jsonl"
    regenerated.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert write_code_repeats(regenerated, out, 3) == 3
    copies = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["id"] for c in copies] == ["fence#2", "fence#3", "asked#2", "asked#3", "c#2", "c#3"]
    assert copies[0]["messages"] == records[0]["messages"]
    # written again (a resumed `up`) from the same records: the file is kept, so the run's data fingerprint holds
    written = out.stat().st_mtime_ns
    assert write_code_repeats(regenerated, out, 3) == 3 and out.stat().st_mtime_ns == written
    assert not out.with_suffix(".tmp").exists()


def test_quality_eval_shards_balance_the_decoding_loops_each_shard_runs():
    """At the quality runs' settings (244 prompts, the reference loop on the first 24 of each benchmark, greedy decoding
    on the first 4, 14 shards) every shard runs 21 or 22 loops; dealt out by index, shards 0-3 ran 24 and 10-13 18."""
    from benchmarks.quality import eval_shards

    prompt_sets = {"mt_bench": ["q"] * 80, "humaneval": ["p"] * 164}
    args = argparse.Namespace(reference_prompts=24, lossless_prompts=4, eval_processes=14)
    shard_of = eval_shards(prompt_sets, args)
    assert sorted(shard_of) == sorted((name, i) for name, texts in prompt_sets.items() for i in range(len(texts)))
    load = [0] * 14
    for (_, i), shard in shard_of.items():
        load[shard] += 1 + (i < 24) + (i < 4)
    assert sum(load) == 244 + 48 + 8 and max(load) - min(load) <= 1
    # --reference-prompts left out: the reference loop on every prompt
    everywhere = eval_shards(prompt_sets, argparse.Namespace(reference_prompts=None, lossless_prompts=0, eval_processes=3))
    assert sorted(collections.Counter(everywhere.values()).values()) == [81, 81, 82]


@pytest.mark.slow
def test_quality_benchmark_trains_dflash2_on_the_same_records(tiny_quality_run, tmp_path):
    """DFlash2 against DFlash as the benchmark compares them: `--architecture dflash2` from the same model, prompts
    and regenerated records as the DFlash run, the same epochs and seed; `up` trains and exports a DFlash2 drafter,
    and its eval agrees with the reference package's DFlash2 loop on every prompt."""
    from trainer import checkpoint
    from trainer.export import export_path

    a, first = tiny_quality_run
    work = copy_quality_run(a, tmp_path / "dflash2", ("model", "prompts", "regenerate"))
    report, _ = bench("quality.py", "--tiny", "--work", str(work), "--architecture", "dflash2")
    exported = export_path(checkpoint.latest(work / "runs" / "quality" / "checkpoints"))
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert report["up"]["steps"] == first["up"]["steps"]  # the same chunks, epochs and steps as the DFlash run
    for name in ("mt_bench", "humaneval"):
        result = report["eval"][name]
        assert result["per_prompt_tau_equal"] == result["per_prompt_text_equal"] == result["prompts"] == 2
        assert result["lossless_checked"] == result["lossless"] == 2
        assert len(result["per_position_acceptance"]) == len(first["eval"][name]["per_position_acceptance"]) == 3
