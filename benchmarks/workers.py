"""Long-lived workers on the real queue and store: N workers against one, and a warm restart.

Real `dflashq worker` processes (`--gpu i`, or `--device cpu --index i`) against a private redis-server and a store
in a temporary folder, on chunks the real producer admitted (every chunk before the workers start; no trainer, the
byte budget and backlog set high enough for all of them). Times come from RQ's own job records (started_at and
ended_at of each chunk), so process start-up counts only where it is what is measured: in phases one and n the
workers start paused and are let go together once every one of them is up and every chunk is admitted.

  one      one worker drains every chunk of --data (at least --chunks x N): tokens/s from its first chunk's start to
           its last chunk's end
  n        --workers N workers drain the same chunks, each on its own GPU; scaling = n's tokens/s / (N x one's)
  restart  one long-lived worker, `dflashq restart-worker` (warm) after --restart-after chunks; this script restarts
           the process when it exits for it (as `dflashq up` does): first start (process spawned -> first chunk
           started), restart gap (old process exited -> new process's first chunk started), and the new process's
           first chunk's tokens/s against the median chunk before the restart

Each phase is its own run (its own chunks) in the same Redis and store; the model is loaded by every worker process
from --model (a Transformers folder), as a user's workers load it.
--shape qwen3.6-27b writes a random-weight Qwen3.6-27B-shaped text model (54 GB of bf16 shards, the Qwen3 tokenizer)
under --tmp first and measures with it: a restart then loads that size from disk. --shape smollm2 writes a random
SmolLM2-135M-shaped Llama (its vocabulary widened to the Qwen3 tokenizer's): a target whose forward is so cheap that
the worker's blob writers (`--writers`, `--writer-threads`) bound extraction. Phases one and n also report the rate
up to the last blob's announcement (the results stream's own timestamp): a worker's last writes can outlast its
last job.
Usage: python benchmarks/workers.py [--tiny] [--model DIR | --shape qwen3.6-27b|smollm2] [--data FILE] [--workers 2]
                                    [--chunks 8] [--phases one,n,restart] [--writers 2] [--writer-threads 4]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rq import Worker  # noqa: E402
from rq.job import Job  # noqa: E402

from dflashq import defaults, settings as settings_module  # noqa: E402
from dflashq.run import Run  # noqa: E402
from ops import control  # noqa: E402
from ops.launch import settings_args  # noqa: E402
from ops.redis_server import EmbeddedRedis  # noqa: E402
from ops.supervisor import child_environment  # noqa: E402
from producers.produce import produce  # noqa: E402
from producers.records import data_fingerprint  # noqa: E402
from producers.sample_data import write_sample_data  # noqa: E402
from workers.worker import EXIT_RESTART, worker_name  # noqa: E402
from benchmarks.extract import QWEN36_27B, qwen35_text_config  # noqa: E402
from benchmarks.train import SMOLLM2  # noqa: E402

PHASES = ("one", "n", "restart")


def target_config(shape: str):
    """The config of a --shape; the Qwen3 tokenizer's ids fit a vocabulary of at least its 151,936 rows."""
    if shape == "smollm2":
        from transformers import LlamaConfig

        return LlamaConfig(**{**SMOLLM2, "vocab_size": 151936}, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=8192)
    return qwen35_text_config(QWEN36_27B)


def write_random_target(folder: Path, config, device: str) -> str:
    """A random-weight model of `config` saved as a Transformers folder (bf16 safetensors shards) with the Qwen3
    tokenizer, so that workers load real weights from disk, as a user's do (the 27B shape: 54 GB). Built on
    `device`."""
    from transformers import AutoModelForCausalLM

    from workers.tiny_model import copy_tokenizer_files

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    copy_tokenizer_files(str(folder))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # this process keeps no 54 GB on the GPU beside the workers' own copies
    return str(folder)


def seconds(moment: datetime.datetime) -> float:
    """RQ's timestamps are UTC; some versions leave them naive."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)).timestamp()


class Bench:
    def __init__(self, args, url: str, store: Path):
        self.args, self.url, self.store = args, url, store
        self.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"

    def settings(self, run: str):
        args = self.args
        return settings_module.load(None, [
            ("run", run), ("redis.url", self.url), ("store.path", str(self.store)), ("model.path", args.model),
            ("data.paths", args.data), ("data.max_length", args.max_length), ("data.chunk_tokens", args.chunk_tokens),
            ("data.tokenize_processes", 1), ("store.codec", args.codec),
            ("backpressure.max_backlog", 1_000_000), ("backpressure.max_store_bytes", 1 << 50),
            ("workers.heartbeat_seconds", 0.5), ("workers.writers", args.writers),
            ("workers.writer_threads", args.writer_threads),
        ], environ={})

    def new_run(self, run_name: str) -> Run:
        settings = self.settings(run_name)
        return Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))

    def admit(self, run: Run, chunks: int):
        """Every chunk of the data admitted to `run`, at least `chunks` of them."""
        report = produce(run, epochs=1, progress=False)
        if report.admitted < chunks:
            sys.exit(f"{self.args.data} makes {report.admitted} chunks of {self.args.chunk_tokens} tokens, {chunks} "
                     f"needed: pass a larger --data or more --conversations")
        return report

    def spawn(self, run: Run, index: int, burst: bool) -> subprocess.Popen:
        where = ["--device", "cpu", "--index", str(index)] if self.device == "cpu" else ["--gpu", str(index)]
        argv = [sys.executable, "-m", "ops.cli", "worker", *settings_args(run.settings), *where]
        # Triton then logs every autotuning it runs (not those answered from the persisted cache): counted per process
        # (unbuffered: its lines and the worker's log lines interleave in the order they happened)
        env = {**child_environment(os.environ), "TRITON_PRINT_AUTOTUNING": "1", "PYTHONUNBUFFERED": "1"}
        path = self.store / f"{run.settings.run}-worker{index}-{time.time_ns()}.log"
        with open(path, "w") as log:
            proc = subprocess.Popen(argv + (["--burst"] if burst else []), cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        proc.log_path = path
        return proc

    def jobs(self, run: Run) -> list[dict]:
        """Every finished chunk of the run: worker, started, ended (epoch seconds) and real tokens."""
        tokens = {f[b"chunk"].decode(): int(f[b"tokens"]) for _, f in run.conn.xrange(run.keys.results)}
        rows = []
        for job in Job.fetch_many(list(tokens), connection=run.conn):
            if job is None or job.started_at is None or job.ended_at is None:
                continue
            rows.append({"id": job.id, "worker": job.worker_name, "started": seconds(job.started_at),
                         "ended": seconds(job.ended_at), "tokens": tokens[job.id]})
        return sorted(rows, key=lambda r: r["started"])

    def drain(self, run_name: str, workers: int) -> dict:
        """`workers` workers started paused, their chunks admitted, then all let go at once: no worker's model
        loading overlaps another's chunks, so the wall time is the workers' alone."""
        run = self.new_run(run_name)
        control.pause(run)
        procs = [self.spawn(run, i, burst=False) for i in range(workers)]
        names = {worker_name(self.device, i) for i in range(workers)}
        while not names <= {w.name for w in Worker.all(connection=run.conn)}:
            self.alive(procs, run_name)
            time.sleep(0.1)
        report = self.admit(run, workers * self.args.chunks)
        control.resume(run)
        while run.conn.xlen(run.keys.results) < report.admitted:
            self.alive(procs, run_name)
            time.sleep(0.05)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # a warm stop: each finishes its chunk (none is left)
        for proc in procs:
            proc.wait(timeout=300)
        jobs = self.jobs(run)
        first = min(j["started"] for j in jobs)
        wall = max(j["ended"] for j in jobs) - first
        # the stream entry id's first part is the Redis server's clock in ms at the announcement (same host)
        announced = int(run.conn.xrevrange(run.keys.results, count=1)[0][0].split(b"-")[0]) / 1000
        to_announced = announced - first
        tokens = sum(j["tokens"] for j in jobs)
        progress = [json.loads(v) for v in run.conn.hvals(run.keys.workers)]
        return {"workers": workers, "chunks": len(jobs), "tokens": tokens, "seconds": round(wall, 2),
                "tokens_per_s": round(tokens / wall, 1),
                "seconds_to_last_announced": round(to_announced, 2),
                "tokens_per_s_to_last_announced": round(tokens / to_announced, 1),
                "seconds_per_chunk": [w.get("seconds_per_chunk") for w in progress],
                "chunks_per_worker": dict(collections.Counter(j["worker"] for j in jobs))}

    def alive(self, procs: list[subprocess.Popen], phase: str) -> None:
        if any(proc.poll() is not None for proc in procs):
            sys.exit(f"a worker of phase {phase} exited early; see the logs in {self.store}")

    def restart(self) -> dict:
        args = self.args
        run = self.new_run("restart")
        report = self.admit(run, args.restart_after + 2)
        name = worker_name(self.device, 0)
        spawned = time.time()
        proc = self.spawn(run, 0, burst=False)
        while run.conn.xlen(run.keys.results) < args.restart_after:
            if proc.poll() is not None:
                sys.exit(f"the worker exited with {proc.returncode} before the restart; see the logs in {self.store}")
            time.sleep(0.05)
        control.restart_worker(run, name)
        if proc.wait() != EXIT_RESTART:
            sys.exit(f"the worker exited with {proc.returncode} on a warm restart, not {EXIT_RESTART}")
        exited = time.time()
        # read now: a finished chunk's job hash expires 10 minutes after it ends (admission.FINISHED_JOB_TTL), and on a
        # slow machine the second worker can outlast that. (A loaded VM once counted one too few, with no chunk finished
        # but uncounted: the restart had stopped the worker between RQ's pop and the chunk's start; fixed in the worker,
        # tests/test_worker.py sends the request at that point.)
        before = self.jobs(run)
        second = self.spawn(run, 0, burst=True)  # at once, as `dflashq up` restarts it
        if second.wait() != 0:
            sys.exit(f"the restarted worker exited with {second.returncode}; see the logs in {self.store}")
        done_before = {j["id"] for j in before}
        later = [j for j in self.jobs(run) if j["started"] > exited]
        redone = sorted(j["id"] for j in later if j["id"] in done_before)
        after = [j for j in later if j["id"] not in done_before]
        if redone:  # a warm stop hands over only chunks it has not finished: none may run twice
            sys.exit(f"restart phase: chunks {redone} ran before the restart and again after it")
        if not before or not after or len(before) + len(after) != report.admitted:
            missing = sorted(set(run.conn.smembers(run.keys.finished)) - {j["id"].encode() for j in before + after})
            sys.exit(f"restart phase: {len(before)} chunks before and {len(after)} after the restart, "
                     f"{report.admitted} admitted; finished but not counted: {[m.decode() for m in missing]}")

        def rate(job):
            return job["tokens"] / max(job["ended"] - job["started"], 1e-9)

        def autotunings(proc) -> dict:
            """Triton's autotuning runs in a worker's log (each names the kernel and the seconds it took): all of
            them, and those after the worker's warm-up (GPU only), i.e. inside jobs."""
            text = proc.log_path.read_text(errors="replace")
            warmed = re.search(r"batch shapes warmed up in ([0-9.]+) s", text)
            took = [float(m) for m in re.findall(r"finished after ([0-9.]+)\s*s", text)]
            return {"runs": text.count("Triton autotuning for function"), "seconds": round(sum(took), 2),
                    "runs_in_jobs": text[warmed.end() if warmed else 0:].count("Triton autotuning for function"),
                    "warm_up_seconds": float(warmed.group(1)) if warmed else None}

        # each process's first chunk may carry warm-up: the steady state is every other chunk, before and after
        steady = statistics.median(rate(j) for j in before[1:] + after[1:] or before)
        return {"chunks_before": len(before), "chunks_after": len(after),
                "first_start_seconds": round(before[0]["started"] - spawned, 2),
                "restart_gap_seconds": round(after[0]["started"] - exited, 2),
                "steady_chunk_tokens_per_s": round(steady, 1),
                "first_chunk_after_restart_tokens_per_s": round(rate(after[0]), 1),
                "first_chunk_after_restart_vs_steady": round(rate(after[0]) / steady, 3),
                "autotuning_first_process": autotunings(proc), "autotuning_after_restart": autotunings(second),
                "chunk_seconds": [round(j["ended"] - j["started"], 2) for j in before + after],
                "chunk_tokens": [j["tokens"] for j in before + after],
                "where_a_chunk_went_after_restart": json.loads(run.conn.hget(run.keys.workers, name) or "{}").get("seconds_per_chunk")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and CPU workers (checks the script)")
    parser.add_argument("--model", default=None, help="the target's Transformers folder (or --shape, or --tiny)")
    parser.add_argument("--shape", choices=["qwen3.6-27b", "smollm2"], default=None,
                        help="instead of --model: a random-weight model of that shape written to --tmp with the Qwen3 tokenizer")
    parser.add_argument("--tmp", default=None, help="folder for the model, Redis and the store [a new temporary folder]")
    parser.add_argument("--data", default=None, help="conversations JSONL [the built-in samples]")
    parser.add_argument("--conversations", type=int, default=2000, help="built-in sample conversations without --data")
    parser.add_argument("--workers", type=int, default=None, help="workers of phase n [every GPU; 2 on the CPU]")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per worker in phases one and n")
    parser.add_argument("--restart-after", type=int, default=4, help="chunks done before the warm restart")
    parser.add_argument("--chunk-tokens", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--codec", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--writers", type=int, default=defaults.WRITERS, help="workers.writers")
    parser.add_argument("--writer-threads", type=int, default=defaults.WRITER_THREADS,
                        help="workers.writer_threads (zstd's threads per blob)")
    parser.add_argument("--logs", default=None, help="copy the workers' logs into this folder before --tmp is removed")
    args = parser.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        sys.exit(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    tmp = Path(tempfile.mkdtemp(prefix="dflashq-workers-", dir=args.tmp))
    server = None
    try:
        if args.shape:
            started = time.perf_counter()
            args.model = write_random_target(tmp / "model", target_config(args.shape), "cuda" if torch.cuda.is_available() else "cpu")
            written = time.perf_counter()
            # the page cache would otherwise write the shards back for minutes while the workers run, and every blob's
            # fsync would queue behind it: a user's model has long been on disk
            os.sync()
            print(f"{args.shape} written to {args.model} in {written - started:.1f} s, flushed to disk in "
                  f"{time.perf_counter() - written:.1f} s", file=sys.stderr, flush=True)
        elif args.tiny:
            from workers.tiny_model import write_tiny_model

            args.model = write_tiny_model(str(tmp / "model"), "qwen3_5")
            args.chunk_tokens, args.max_length, args.chunks, args.restart_after = 512, 256, 2, 2
            args.conversations = 200
        elif not args.model:
            sys.exit("pass --model DIR (a Transformers folder), --shape qwen3.6-27b|smollm2, or --tiny")
        if not args.data:
            args.data = str(write_sample_data(tmp / "data.jsonl", n=args.conversations))
        if args.workers is None:
            args.workers = torch.cuda.device_count() if torch.cuda.is_available() and not args.tiny else 2
        server = EmbeddedRedis(str(tmp))
        bench = Bench(args, server.ensure(), tmp / "store")
        bench.store.mkdir(parents=True, exist_ok=True)
        result = {"benchmark": "workers", "device": torch.cuda.get_device_name(0) if bench.device == "cuda" else
                  f"cpu ({os.cpu_count()} cores)", "model": "tiny qwen3_5" if args.tiny else
                  f"{args.shape} (random weights)" if args.shape else args.model}
        for phase in phases:
            started = time.perf_counter()
            result[phase] = bench.restart() if phase == "restart" else bench.drain(phase, 1 if phase == "one" else args.workers)
            print(f"{phase}: {json.dumps(result[phase])} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
        if "one" in result and "n" in result:
            result["scaling"] = round(result["n"]["tokens_per_s"] / (args.workers * result["one"]["tokens_per_s"]), 3)
    finally:
        if server is not None:
            server.stop()
        if args.logs:
            for log in (tmp / "store").glob("*.log"):
                shutil.copy(log, args.logs)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed benchmark still stops its redis-server
    main()
