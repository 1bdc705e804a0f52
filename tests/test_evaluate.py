"""Speculative decoding against real tiny targets (hybrid Qwen3.5-style: cache replayed; Llama: cache cropped) must
equal plain greedy decoding token for token; offline blob metrics; the acceptance rule as a pure function."""

from __future__ import annotations

import json

import pytest
import torch

from dflashq.blob import decode_blob, encode_blob
from dflashq.exceptions import ConfigError, InputError
from trainer.anchors import gather_blocks, sample_anchors
from trainer.drafter import DFlashDrafter, DrafterConfig
from dflashq.capture import HiddenStateCapture
from trainer.evaluate import (accept_length, evaluate_blobs, evaluate_prompts, greedy_generate,
                              per_position_acceptance, read_prompts, speculative_generate, target_head)
from trainer.export import export_drafter
from trainer.loss import dflash_loss
from trainer.step import Batch, Blocks, backward
from dflashq.target import load_target
from workers.tiny_model import EOS_ID, write_tiny_model

MASK_ID = 151669
PROMPTS = ([1, 2, 3, 4, 5], [9000, 9001, 9002])


def make_drafter(model_dir: str, block_size: int, num_layers: int = 1, **overrides) -> DFlashDrafter:
    with open(f"{model_dir}/config.json") as f:
        target = json.load(f)
    config = DrafterConfig.default_for_target(target, num_layers=num_layers, mask_token_id=MASK_ID,
                                              block_size=block_size, **overrides)
    torch.manual_seed(0)
    return DFlashDrafter(config)


@pytest.fixture(scope="module")
def qwen35(tiny_qwen35):
    return load_target(tiny_qwen35)


def test_per_position_acceptance_counts_passes_that_accepted_each_draft_slot():
    # passes committing 3, 1 and 2 tokens: 2, 0 and 1 drafts accepted
    assert per_position_acceptance([[3, 1], [2]], draft_slots=3) == [round(2 / 3, 4), round(1 / 3, 4), 0.0]
    assert per_position_acceptance([[8] * 5], draft_slots=7) == [1.0] * 7  # every draft accepted, as vLLM counts it
    assert per_position_acceptance([[], []], draft_slots=3) == []
    # pooled over passes, 1 + the shares is the mean tokens a pass commits
    committed = [[4, 1, 2, 4], [3, 1]]
    passes = [n for one in committed for n in one]
    assert 1 + sum(per_position_acceptance(committed, 3)) == pytest.approx(sum(passes) / len(passes), abs=1e-3)


def test_accept_length():
    assert accept_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accept_length([], [4]) == 0


@pytest.mark.slow
def test_untrained_drafter_is_lossless_on_hybrid_target(qwen35, tiny_qwen35):
    assert qwen35.model.layers[0].linear_attn is not None  # really the hybrid (linear-attention) target
    drafter = make_drafter(tiny_qwen35, block_size=8).eval()
    head = target_head(qwen35)
    for prompt in PROMPTS:
        result = speculative_generate(qwen35, drafter, head, prompt, 12, {EOS_ID})
        assert result.tokens == greedy_generate(qwen35, prompt, 12, {EOS_ID})
        assert len(result.tokens) == 12 and result.tau >= 1.0
        assert sum(result.committed) == 11  # the first token comes from the prefill, not from a verification pass


def overfit(drafter: DFlashDrafter, head, target, examples: list[tuple[list[int], list[int]]], steps: int):
    """Train the drafter on the target's own continuations of (prompt, continuation) pairs until some of its drafts
    get accepted."""
    batches = []
    for prompt, continuation in examples:
        sequence = torch.tensor([prompt + continuation])  # [1, T]
        tapped = HiddenStateCapture(target, drafter.config.target_layer_ids, stop_after_deepest=False)
        with torch.no_grad():
            target(input_ids=sequence)
        context = tapped.take().flatten(2)  # [1, T, K*H]
        tapped.close()
        loss_mask = torch.zeros_like(sequence, dtype=torch.uint8)
        loss_mask[:, len(prompt) - 1:] = 1
        batches.append((sequence, context, loss_mask))
    with torch.no_grad():
        drafter.norm.weight.fill_(30.0)  # the tiny target's head has small weights: start with useful logit scale
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=2e-2)
    for _ in range(steps):
        for sequence, context, loss_mask in batches:
            anchors, valid = sample_anchors(loss_mask, 64)
            blocks = Blocks(anchors, *gather_blocks(sequence, loss_mask, anchors, valid, drafter.config.block_size,
                                                    drafter.config.mask_token_id))
            backward(drafter, head, Batch(context, sequence, loss_mask), blocks, loss_chunk_rows=2048)  # DFlash2: + selector
            optimizer.step()
            optimizer.zero_grad()
    return drafter.eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_partly_accepted_drafts_stay_lossless(arch, tiny_qwen35, tmp_path):
    """Accepted, partly accepted and rejected blocks, through both cache rollbacks (replay: hybrid; crop: Llama)."""
    model_dir = tiny_qwen35 if arch == "qwen3_5" else write_tiny_model(str(tmp_path), "llama")
    target = load_target(model_dir)
    head = target_head(target)
    prompt = [1, 2, 3, 4, 5]
    reference = greedy_generate(target, prompt, 16, set())
    drafter = overfit(make_drafter(model_dir, block_size=4), head, target, [(prompt, reference)], steps=40)
    result = speculative_generate(target, drafter, head, prompt, 16, set())
    assert result.tokens == reference
    assert max(result.committed) > 1 and min(result.committed) < 4  # some drafts accepted, some rejected
    assert result.tau == sum(result.committed) / len(result.committed)


@pytest.mark.slow
def test_evaluate_prompts_reports_tau_and_lossless(qwen35, tiny_qwen35, tmp_path):
    exported = export_drafter(make_drafter(tiny_qwen35, block_size=4), tmp_path / "drafter")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "Hello"}) + "\n\n"
                            + json.dumps({"messages": [{"role": "user", "content": "Count to 3"}]}) + "\n")
    prompts = read_prompts(prompts_file)
    assert prompts == ["Hello", [{"role": "user", "content": "Count to 3"}]]
    report = evaluate_prompts(tiny_qwen35, exported, prompts, max_new_tokens=8, device="cpu")
    assert report["lossless"] and len(report["prompts"]) == 2
    for entry in report["prompts"]:
        assert entry["lossless"] and entry["first_mismatch"] is None
        assert entry["new_tokens"] == 8 and entry["tau"] >= 1.0
    assert report["mean_tau"] == sum(e["tau"] for e in report["prompts"]) / 2 and report["lossless_checked"] == 2
    for entry in report["prompts"]:  # every pass's committed tokens, the first token (the prefill's) in none
        assert len(entry["committed"]) == entry["passes"] and sum(entry["committed"]) == 8 - 1
    assert report["per_position_acceptance"] == per_position_acceptance([e["committed"] for e in report["prompts"]], 3)
    # the greedy reference only for the first prompt: the same drafts, the second left unchecked
    partial = evaluate_prompts(tiny_qwen35, exported, prompts, max_new_tokens=8, device="cpu", lossless_prompts=1)
    assert [e["lossless"] for e in partial["prompts"]] == [True, None] and partial["lossless_checked"] == 1
    assert [e["text"] for e in partial["prompts"]] == [e["text"] for e in report["prompts"]]


@pytest.mark.slow
def test_eval_command_shows_progress_then_the_table(tiny_qwen35, tmp_path):
    from click.testing import CliRunner

    from ops.cli import main

    exported = export_drafter(make_drafter(tiny_qwen35, block_size=4), tmp_path / "drafter")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello", "Hi", "Count to 3")))
    args = ["eval", "--drafter", str(exported), "--model", tiny_qwen35, "--data", str(prompts_file), "--max-new-tokens", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "3/3 prompts" in result.stderr and "mean tau" in result.stderr  # the bar, on stderr
    assert "speculative decoding: mean tau" in result.stdout and "3/3" not in result.stdout
    assert "acceptance per draft position: [" in result.stdout
    quiet = CliRunner().invoke(main, args + ["--no-progress", "--json"])
    assert quiet.exit_code == 0 and "prompts" not in quiet.stderr and len(json.loads(quiet.stdout)["prompts"]) == 3


@pytest.mark.slow
def test_an_output_that_leaves_greedy_decoding_reports_where_and_by_what_margin(tiny_qwen35, tmp_path, monkeypatch):
    """A speculative output that differs from plain greedy decoding is not lossless; at the first difference the
    report gives the target's logit gap between greedy's pick and the speculative one (near zero: a rounding tie)."""
    import trainer.evaluate as evaluate

    exported = export_drafter(make_drafter(tiny_qwen35, block_size=4), tmp_path / "drafter")
    evaluator = evaluate.PromptEvaluator(tiny_qwen35, exported)
    real = evaluate.speculative_generate

    def one_token_off(*args, **kwargs):
        result = real(*args, **kwargs)
        result.tokens[3] = (result.tokens[3] + 1) % 512
        return result

    monkeypatch.setattr(evaluate, "speculative_generate", one_token_off)
    entry = evaluator.evaluate("Hello", max_new_tokens=8)
    assert entry["lossless"] is False and entry["first_mismatch"] == 3
    prompt = evaluator.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"]
    greedy = greedy_generate(evaluator.target, prompt, 8, evaluator.stop_ids)
    with torch.no_grad():
        logits = evaluator.target(input_ids=torch.tensor([prompt + greedy[:3]])).logits[0, -1]
    assert entry["mismatch_margin"] == pytest.approx(float(logits[greedy[3]] - logits[(greedy[3] + 1) % 512]), abs=1e-4)
    assert entry["mismatch_margin"] > 0  # greedy took the larger logit


def test_read_prompts_rejects_bad_lines(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(InputError, match="line 1"):
        read_prompts(bad)
    with pytest.raises(InputError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_evaluate_blobs_counts_every_valid_slot(qwen35, tiny_qwen35):
    drafter = make_drafter(tiny_qwen35, block_size=4, num_layers=2).eval()
    layer_ids = drafter.config.target_layer_ids
    tapped = HiddenStateCapture(qwen35, layer_ids, stop_after_deepest=False)
    samples = [torch.arange(10, 30), torch.arange(500, 512)]
    hidden, masks = [], []
    for ids in samples:
        with torch.no_grad():
            qwen35(input_ids=ids[None])
        hidden.append(tapped.take()[0])  # [T, K, H]
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[4:] = 1
        masks.append(mask)
    tapped.close()
    offsets = [0, len(samples[0]), len(samples[0]) + len(samples[1])]
    meta = {"run": "test", "chunk_id": "c0", "epoch": 0, "layer_ids": layer_ids}
    blob = decode_blob(b"".join(bytes(b) for b in encode_blob(torch.cat(hidden), torch.cat(samples), torch.cat(masks),
                                                              offsets, meta)))
    head = target_head(qwen35)
    report = evaluate_blobs(drafter, head, [blob], num_anchors=512, seed=0)
    # every candidate anchor is drawn (512 > candidates); slot k counts anchors a with a + k inside the sample
    assert report["samples"] == 2
    assert report["slots"] == [sum(max(0, len(s) - 4 - k) for s in samples) for k in (1, 2, 3)]
    assert len(report["acc"]) == 3 and 1.0 <= report["eal"] <= 4.0
    # the same numbers from the training-time loss on the first sample alone
    first = evaluate_blobs(drafter, head, [decode_blob(b"".join(bytes(b) for b in encode_blob(
        hidden[0], samples[0], masks[0], [0, len(samples[0])], meta)))], num_anchors=512, seed=0)
    anchors, valid = sample_anchors(masks[0][None], 512)
    blocks, targets, slot_valid = gather_blocks(samples[0][None].long(), masks[0][None], anchors, valid, 4, MASK_ID)
    with torch.no_grad():
        out = dflash_loss(drafter(hidden[0].reshape(1, len(samples[0]), -1), blocks, anchors, head), head.lm_head,
                          targets, slot_valid)
    assert first["acc"] == pytest.approx(out.acc.tolist()) and first["loss"] == pytest.approx(float(out.loss))
    wrong = drafter.config.target_layer_ids
    drafter.config.target_layer_ids = [0, 1]
    try:
        with pytest.raises(ConfigError, match="holds layers"):
            evaluate_blobs(drafter, head, [blob], num_anchors=512, seed=0)
    finally:
        drafter.config.target_layer_ids = wrong
