"""`dflashq demo`: the whole pipeline on a tiny random hybrid model and built-in conversations, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from dflashq import settings as settings_module
from dflashq.run import Run
from ops import redis_server, status
from producers.produce import produce
from producers.records import data_fingerprint
from producers.sample_data import write_sample_data
from workers.tiny_model import write_tiny_model

DEMO_CONFIG = """\
# written by `dflashq demo`; run any dflashq command with --config {config}
run = "demo"

[store]
path = "runs"

[model]
path = "model"

[data]
paths = ["conversations.jsonl"]
max_length = 512
chunk_tokens = 2048
tokenize_processes = 1

[backpressure]
max_backlog = 8

[workers]
heartbeat_seconds = 2
worker_ttl = 10

[train]
num_layers = 2
epochs = 1
"""


def prepare(out: str) -> Path:
    """Write the tiny model, the sample data and the run config into `out`; return the config path."""
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").exists():
        write_tiny_model(str(root / "model"), "qwen3_5")
    write_sample_data(root / "conversations.jsonl", n=200)
    config = root / "run.toml"
    config.write_text(DEMO_CONFIG.format(config=config))
    return config


def run_demo(out: str, workers: int = 2) -> dict:
    console = Console()
    config = prepare(out)
    settings = settings_module.load(config)
    settings.redis.url = redis_server.resolve_url(settings)
    console.print(f"[bold]1/3 produce[/]: 200 built-in conversations -> chunks in {settings.redis.url}")
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths), with_layers=False)
    produce(run, epochs=1)
    console.print(f"[bold]2/3 extract[/]: {workers} CPU workers (burst mode) write hidden-state blobs")
    cmd = [sys.executable, "-m", "ops.cli", "worker", "--config", str(config), "--device", "cpu", "--burst"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen(cmd + ["--index", str(i)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(workers)]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"demo worker failed: {err.decode()[-2000:]}")
    console.print("[bold]3/3 status[/]")
    data = status.collect(Run.open(settings))
    console.print(status.render(data, settings.redis.url))
    console.print(f"Next: train a drafter on these blobs with `dflashq train --config {config}` (see README).")
    return data
