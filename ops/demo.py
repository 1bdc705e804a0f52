"""`dflashq demo`: the whole pipeline on a tiny random hybrid model and built-in conversations, on the CPU."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from dflashq import settings as settings_module
from dflashq.exceptions import DflashqError
from dflashq.run import Run
from ops import redis_server, status
from ops.supervisor import Supervisor
from producers.sample_data import sample_conversations, write_sample_data
from trainer import checkpoint
from trainer.evaluate import evaluate_prompts
from trainer.export import export_checkpoint
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
num_anchors = 16
block_size = 8
checkpoint_every_steps = 4
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
    """prepare -> `up` (producer, CPU workers, trainer, supervised) -> export -> speculative decoding with tau."""
    config = prepare(out)
    settings = settings_module.load(config)
    embedded = not settings.redis.url  # REDIS_URL may name the user's own server: that one stays up
    settings.redis.url = redis_server.resolve_url(settings)
    try:
        return _run(settings, workers)
    finally:
        if embedded:  # a later command of the demo's run starts it again from its AOF
            redis_server.EmbeddedRedis(settings.run_dir).stop()


def _run(settings, workers: int) -> dict:
    console = Console()
    run = Run.open(settings)
    console.print(f"[bold]dflashq demo[/]: tiny random Qwen3.5-style model, 200 built-in conversations, "
                  f"{workers} CPU workers, Redis at {settings.redis.url}")
    supervisor = Supervisor(run, [("cpu", i) for i in range(workers)], "cpu", Path(run.store.path("logs")), console)
    if not supervisor.run_until_done():
        raise DflashqError("The demo was stopped before training finished; run `dflashq demo` again to resume it.")
    latest = checkpoint.latest(run.store.path("checkpoints"))
    exported = Path(run.store.path(f"drafter-{latest.name}"))
    if not exported.exists():
        export_checkpoint(latest, exported)
    prompts = [conv["messages"][0]["content"] for conv in sample_conversations(4, seed=99)]
    report = evaluate_prompts(settings.model.path, exported, prompts, max_new_tokens=32)
    summary = supervisor.summary(str(exported))
    console.print(status.render(status.collect(run), settings.redis.url))
    console.print(f"exported drafter: {exported}")
    console.print(f"speculative decoding on {len(prompts)} held-out prompts: mean tau {report['mean_tau']:.2f} "
                  f"(lossless: {report['lossless']}). A random tiny target has no structure to learn in one epoch, so "
                  "tau near 1 is expected here; see the README for real models.")
    return {**summary, "mean_tau": report["mean_tau"], "lossless": report["lossless"]}
