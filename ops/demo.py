"""`dflashq demo`: the whole supported path on the CPU in a few minutes: prompts -> `regenerate` (the target's own
responses) -> `up` (producer, CPU workers, trainer) -> export -> speculative decoding, printing tau.

The target is a tiny Qwen3.5-style hybrid made learnable (workers.tiny_model.make_learnable with its CHAIN_WORDS):
whatever it is asked, it answers " apple river stone cloud ...", text a drafter can learn and that survives
regenerate's decoding and produce's re-tokenizing; an untrained drafter gets tau about 1 on it.
The drafter is DFlash's unless the environment asks for DFlash2 (DFLASHQ_TRAIN_ARCHITECTURE=dflash2, read with the
run's config like every DFLASHQ_* setting, and inherited by `up`'s children).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from dflashq import settings as settings_module
from dflashq.exceptions import DflashqError
from ops import redis_server, status
from ops.supervisor import Supervisor
from producers.engines import TransformersEngine
from producers.regenerate import regenerate
from producers.sample_data import sample_conversations, write_sample_data
from trainer import checkpoint
from trainer.evaluate import evaluate_prompts
from trainer.export import export_once
from workers.tiny_model import CHAIN_WORDS, make_learnable, write_tiny_model

RESPONSE_TOKENS = 24

DEMO_CONFIG = """\
# written by `dflashq demo`; run any dflashq command with --config {config}
run = "demo"

[store]
path = "runs"

[model]
path = "model"

[data]
paths = ["regenerated.jsonl"]
max_length = 256
chunk_tokens = 256
tokenize_processes = 1

[regenerate]
max_new_tokens = {response_tokens}

[backpressure]
max_backlog = 8

[workers]
heartbeat_seconds = 2
worker_ttl = 10

[train]
num_layers = 2
epochs = 4
num_anchors = 16
block_size = 8
learning_rate = 3e-3
checkpoint_every_steps = 50
selector_rank = 8  # DFLASHQ_TRAIN_ARCHITECTURE=dflash2 only: two 151936-row codebooks of this rank train on the CPU
"""


def prepare(out: str) -> Path:
    """Write the learnable tiny model, the sample prompts and the run config into `out`; return the config path."""
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").exists():
        make_learnable(write_tiny_model(str(root / "model"), "qwen3_5"), CHAIN_WORDS)
    write_sample_data(root / "prompts.jsonl", n=200)
    config = root / "run.toml"
    config.write_text(DEMO_CONFIG.format(config=config, response_tokens=RESPONSE_TOKENS))
    return config


def run_demo(out: str, workers: int = 2) -> dict:
    """prepare -> regenerate -> `up` -> export -> speculative decoding with tau; stops its embedded Redis at the end."""
    config = prepare(out)
    settings = settings_module.load(config)
    with redis_server.stopped_at_end(settings):  # REDIS_URL may name the user's own server: that one stays up
        settings.redis.url = redis_server.resolve_url(settings)
        return _run(settings, Path(config).parent, workers)


def _run(settings, root: Path, workers: int) -> dict:
    console = Console()
    console.print("[bold]dflashq demo[/]: a tiny Qwen3.5-style hybrid target made learnable (whatever it is asked, it "
                  f"answers \"{' '.join(CHAIN_WORDS[:4])} ...\"), 200 built-in conversations, the CPU")
    console.print(f"1/4 regenerate: the target answers every user turn itself ({RESPONSE_TOKENS} tokens each)")
    regenerated = regenerate(settings, [str(root / "prompts.jsonl")], settings.data.paths[0],
                             TransformersEngine(settings, "cpu"), progress=True)
    console.print(f"    {regenerated.regenerated} conversations regenerated, {regenerated.already_done} already done")
    console.print(f"2/4 up: producer, {workers} CPU workers and the trainer ({settings.train.architecture}, "
                  f"{settings.train.epochs} epochs), Redis at {settings.redis.url}")
    run = redis_server.open_run(settings)
    supervisor = Supervisor(run, [("cpu", i) for i in range(workers)], ["--device", "cpu"], Path(run.store.path("logs")), console)
    if not supervisor.run_until_done():
        raise DflashqError("The demo was stopped before training finished; run `dflashq demo` again to resume it.")
    latest = checkpoint.latest(run.store.path("checkpoints"))
    exported = export_once(latest)
    console.print(f"3/4 export: {exported}")
    prompts = [conv["messages"][0]["content"] for conv in sample_conversations(4, seed=99)]
    report = evaluate_prompts(settings.model.path, exported, prompts, max_new_tokens=RESPONSE_TOKENS, progress=True)
    summary = supervisor.summary(str(exported))
    console.print(status.render(status.collect(run), settings.redis.url))
    console.print(f"4/4 eval: speculative decoding on {len(prompts)} held-out prompts: mean tau {report['mean_tau']:.2f} "
                  f"(lossless: {report['lossless']}; an untrained drafter gets about 1, block size "
                  f"{settings.train.block_size} is the most). This target gives every prompt the same reply, so here the "
                  "drafter learned one chain of words: the demo shows the path and that it learns, not how far a real "
                  "drafter generalises.")
    return {**summary, "mean_tau": report["mean_tau"], "lossless": report["lossless"]}
