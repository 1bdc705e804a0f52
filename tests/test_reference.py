"""What we claim against what the reference computes: the z-lab `dflash` package (PyPI dflash 0.1.0) loads our
export, and its `dflash_generate` reports the same per-prompt acceptance lengths (so the same tau) and the same
text as `dflashq eval`, on prompts whose generation ends inside a block (by EOS, and by max_new_tokens).

The loop is compared on the Llama target (a croppable cache). On the tiny hybrid Qwen3.5-style target on the CPU
the reference loop itself is not lossless (seen with transformers 5.15 and 5.24: after the first partly rejected
block its output leaves plain greedy decoding, its linear-attention cache rollback being the suspect), so there it
is no yardstick; test_evaluate checks our hybrid path against plain greedy decoding."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from dflash import model as reference
from test_evaluate import make_drafter, overfit
from transformers import AutoTokenizer

from dflashq.layer_ids import default_layer_ids
from dflashq.target import load_target
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.evaluate import evaluate_prompts, greedy_generate, target_head
from trainer.export import export_drafter, load_exported
from trainer.target_head import TargetHead
from workers.tiny_model import EOS_ID, write_tiny_model

BLOCK = 8
MAX_NEW_TOKENS = 21  # 1 from the prefill + 20: no multiple of the block, so the last block is cut short
PROMPTS = ["What is two plus two?", "Count to three"]


def test_default_layer_ids_equal_the_reference_rule():
    for num_target_layers in range(8, 129):
        for num_draft_layers in (1, 2, 3, 4, 5, 8):
            assert default_layer_ids(num_target_layers, num_draft_layers) == \
                reference.build_target_layer_ids(num_target_layers, num_draft_layers), (num_target_layers, num_draft_layers)
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27] and default_layer_ids(94, 5) == [1, 24, 46, 68, 91]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33] and default_layer_ids(64, 5) == [1, 16, 31, 46, 61]


DFLASH2 = {"architecture": "dflash2", "selector_rank": 16, "selector_top_k": 16}  # rank 256 is 2 x 39M rows here
REFERENCE_MODEL = {"dflash": reference.DFlashDraftModel, "dflash2": reference.DFlash2DraftModel}


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_eval_tau_and_text_equal_the_reference_generate_loop(architecture, tmp_path, monkeypatch):
    """DFlash2: both loops draft with the candidate selector's chain (greedy)."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times with CUDA events
    model_dir = write_tiny_model(str(tmp_path / "target"), "llama")
    target = load_target(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    continuations = [greedy_generate(target, ids, MAX_NEW_TOKENS, set()) for ids in prompt_ids]
    # a token of the first continuation (new there, absent from the second) becomes an EOS id of the target:
    # the first generation ends by EOS, inside a block; the second by max_new_tokens
    eos_at = next(i for i in range(9, MAX_NEW_TOKENS) if continuations[0][i] not in continuations[0][:i]
                  and continuations[0][i] not in continuations[1])
    stop = continuations[0][eos_at]
    generation_config = json.loads((tmp_path / "target" / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [EOS_ID, stop]
    (tmp_path / "target" / "generation_config.json").write_text(json.dumps(generation_config))

    head = target_head(target)
    overrides = DFLASH2 if architecture == "dflash2" else {}
    drafter = overfit(make_drafter(model_dir, block_size=BLOCK, num_layers=2, **overrides), head, target,
                      list(zip(prompt_ids, continuations)), steps=120)
    exported = export_drafter(drafter, tmp_path / "drafter")
    report = evaluate_prompts(model_dir, exported, PROMPTS, MAX_NEW_TOKENS, device="cpu")

    target = load_target(model_dir)
    ref_drafter = REFERENCE_MODEL[architecture].from_pretrained(str(exported), dtype=torch.float32).eval()
    stop_ids = sorted({EOS_ID, stop, tokenizer.eos_token_id})
    ended_inside_a_block = []
    for ids, ours in zip(prompt_ids, report["prompts"]):
        stats = reference.dflash_generate(ref_drafter, target, torch.tensor([ids]), MAX_NEW_TOKENS, stop_ids,
                                          return_stats=True)
        theirs = stats.output_ids[0, len(ids):].tolist()
        assert ours["text"] == tokenizer.decode(theirs)
        assert ours["tau"] == pytest.approx(sum(stats.acceptance_lengths) / len(stats.acceptance_lengths))
        assert ours["passes"] == len(stats.acceptance_lengths) and ours["new_tokens"] == len(theirs)
        assert ours["lossless"]
        ended_inside_a_block.append(stats.acceptance_lengths[-1] < BLOCK)
    assert report["prompts"][0]["new_tokens"] == eos_at + 1  # ended by EOS
    assert report["prompts"][1]["new_tokens"] == MAX_NEW_TOKENS  # ended by max_new_tokens
    assert all(ended_inside_a_block)
    assert report["mean_tau"] > 2.0, report["prompts"]


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_reference_model_loads_our_export_and_drafts_the_same_logits(layer_types, tiny_qwen35, tmp_path):
    """Both layouts (the default full attention, and the released Qwen3.6-27B drafter's sliding + full) mean the
    same thing to the reference model as to ours: sliding window 8 over a 20-token context, block of 8."""
    target = json.loads((Path(tiny_qwen35) / "config.json").read_text())
    config = DrafterConfig.default_for_target(target, num_layers=2, mask_token_id=151669, block_size=BLOCK,
                                              sliding_window=8, layer_types=layer_types)
    torch.manual_seed(0)
    exported = export_drafter(DFlashDrafter(config), tmp_path / "drafter")
    ours = load_exported(exported).float()
    theirs = reference.DFlashDraftModel.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert [layer.self_attn.sliding_window for layer in theirs.layers] == \
        [8 if t == "sliding_attention" else None for t in layer_types]
    head = TargetHead.from_pretrained(tiny_qwen35)
    context = torch.randn(1, 20, config.num_tapped * config.hidden_size, generator=torch.Generator().manual_seed(1))
    last = torch.tensor([4242])
    expected = ours.draft(context, last, 20, head, attention="sdpa")  # [1, B-1, V]
    block = torch.full((1, BLOCK), config.mask_token_id)
    block[0, 0] = last
    with torch.no_grad():
        hidden = theirs(position_ids=torch.arange(20 + BLOCK)[None], noise_embedding=head.embed(block),
                        target_hidden=context)  # [1, B, H]
        logits = theirs.compute_logits(hidden[:, 1:], head.logits)  # [1, B-1, V]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_reference_dflash2_loads_our_export_and_gives_our_logits_and_chosen_path_in_float64(layer_types, tiny_qwen35,
                                                                                           tmp_path):
    """The reference DFlash2DraftModel loads our export with no missing, unexpected or mismatched tensor; in float64 its
    forward gives our logits and its propose() our greedy chain, for drafters whose convolutions and selector are far
    from their initial identity and argmax (so a swapped tap, group or codebook shows)."""
    target = json.loads((Path(tiny_qwen35) / "config.json").read_text())
    config = DrafterConfig.default_for_target(target, num_layers=2, mask_token_id=151669, block_size=BLOCK,
                                              sliding_window=8, layer_types=layer_types, **DFLASH2)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "_conv." in name or "codebook" in name:
                param.normal_(0.0, 0.5)
    exported = export_drafter(drafter, tmp_path / "drafter")
    written = json.loads((exported / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert {k: written["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                            "selector_rank": 16, "selector_top_k": 16}
    ours = load_exported(exported).double()
    theirs, loading = reference.DFlash2DraftModel.from_pretrained(str(exported), dtype=torch.float64,
                                                                 output_loading_info=True)
    assert {k: loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")} == \
        {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set()}
    theirs.eval()
    assert torch.equal(theirs.candidate_selector.successor_codebook.weight, ours.candidate_selector.successor_codebook.weight)
    head = TargetHead.from_pretrained(tiny_qwen35, dtype=torch.float64)
    context = torch.randn(3, 20, config.num_tapped * config.hidden_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    last = torch.tensor([4242, 17, 90000])
    expected = ours.draft(context, last, 20, head, attention="sdpa")  # [3, B-1, V]
    block = torch.full((3, BLOCK), config.mask_token_id)
    block[:, 0] = last
    with torch.no_grad():
        hidden = theirs(position_ids=torch.arange(20 + BLOCK)[None], noise_embedding=head.embed(block),
                        target_hidden=context)[:, 1:]  # [3, B-1, H]
        logits = theirs.compute_logits(hidden, head.logits)  # [3, B-1, V]
        path, _, _ = theirs.propose(hidden, last, head.logits, 0.0)  # [3, B-1]
    torch.testing.assert_close(logits, expected.double(), rtol=1e-5, atol=1e-5)  # draft() returns fp32
    chain = ours.propose(context, last, 20, head, attention="sdpa")  # [3, B-1]
    assert torch.equal(chain, path)
    assert not torch.equal(chain, expected.argmax(-1))  # the selector chose: not the independent argmaxes
