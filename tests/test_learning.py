"""Learning works end to end on the CPU: prompts -> the target's own greedy responses -> produce -> worker ->
trainer -> export -> real speculative decoding on held-out prompts, with tau well above 1 and lossless output.

The target is workers.tiny_model.make_learnable's copying one (a tiny random Qwen3.5-style hybrid whose layers write
nothing into the residual stream and whose LM head is its scaled-up embedding, so that its logits are confident the
way a trained model's are: a drafter that agrees with it then keeps agreeing after the bf16 export): its greedy
continuation repeats the prompt's last token. A drafter can only accept
drafts by learning, through the whole pipeline, what the target emits after each token. Held-out prompts are new
token sequences (other bodies, other lengths) ending in tokens the training prompts ended in: a drafter this small
trained for seconds learns the continuations of the tokens it saw, not a general copy rule (measured here: with
held-out prompts ending in unseen tokens, tau stayed 1.0 while training prompts reached 8.0). An untrained drafter
gets tau = 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from dflashq import settings as S
from dflashq.run import Run
from dflashq.target import load_target
from producers.produce import produce
from producers.records import data_fingerprint
from trainer.daemon import Trainer
from trainer.evaluate import greedy_generate, speculative_generate, target_head
from trainer.export import export_checkpoint, load_exported
from workers.tiny_model import make_learnable, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
RESPONSE_TOKENS = 24


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100000, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.mark.slow
def test_pipeline_learns_a_drafter_that_speeds_up_decoding(tmp_path, redis_url):
    model_dir = make_learnable(write_tiny_model(str(tmp_path / "target"), "qwen3_5"))
    target = load_target(model_dir)
    eos = {int(target.config.get_text_config().eos_token_id or 0)}
    records = []
    for ids in prompts(200, seed=0):
        response = greedy_generate(target, ids, RESPONSE_TOKENS, eos)
        records.append({"input_ids": ids + response, "loss_mask": [0] * len(ids) + [1] * len(response)})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    values = {"run": "learn", "redis.url": redis_url, "store.path": str(tmp_path / "store"), "model.path": model_dir,
              "data.paths": str(data), "data.tokenize_processes": 1, "data.max_length": 64, "data.chunk_tokens": 256,
              "train.num_layers": 2, "train.block_size": 8, "train.num_anchors": 8, "train.micro_batch_tokens": 1024,
              "train.epochs": 4, "train.learning_rate": 3e-3, "train.warmup_ratio": 0.05, "store.retention": "keep",
              "train.checkpoint_every_steps": 1000}
    settings = S.load(None, list(values.items()), environ={})
    run = Run.open(settings, data_fingerprint=data_fingerprint(settings.data.paths))
    produced = produce(run, epochs=1, progress=False)
    assert produced.kept == 200
    worker = subprocess.run([sys.executable, "-m", "ops.cli", "worker", "--device", "cpu", "--burst", "--run", "learn",
                             "--redis-url", redis_url, "--store", settings.store.path, "--model", model_dir,
                             "-s", "train.num_layers=2", "-s", "data.max_length=64"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stderr[-3000:]

    report = Trainer(Run.open(settings), "cpu", progress=False).run_until_done()
    assert not report.stopped and report.consumed == {e: produced.admitted for e in range(4)}
    exported = export_checkpoint(report.checkpoint, tmp_path / "drafter")
    drafter = load_exported(exported).float()
    head = target_head(target)

    seen_last_tokens = [r["input_ids"][len(r["input_ids"]) - RESPONSE_TOKENS - 1] for r in records]
    taus = []
    for i, body in enumerate(prompts(6, seed=1)):  # held out: new prompts ending in tokens seen in training
        ids = body + [seen_last_tokens[7 * i]]
        result = speculative_generate(target, drafter, head, ids, RESPONSE_TOKENS, eos)
        assert result.tokens == greedy_generate(target, ids, RESPONSE_TOKENS, eos)  # lossless
        taus.append(result.tau)
    mean_tau = sum(taus) / len(taus)
    print(f"held-out tau per prompt {[round(t, 2) for t in taus]}, mean {mean_tau:.2f}, last train EAL {report.last_eal:.2f}")
    assert mean_tau >= 3.0, taus
