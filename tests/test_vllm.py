"""The vLLM engines' parts that need no GPU: tau and the report from vLLM's per-step outputs and counters, the wrap a
text-only hybrid folder needs, the regenerate engine's request/result mapping under the regenerate contract, and the
sentence a user without vLLM gets. vLLM itself has no CPU wheel; `benchmarks/quality.py --serve` runs it on a GPU.

The regenerate tests drive VllmEngine through its one seam to vLLM (TokenGenerator: token ids in, generated ids
out) with the real tiny target decoding greedily behind it, and check the records against that target's own turns."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from dflashq import settings as S
from dflashq.exceptions import InputError
from dflashq.target import load_target
from dflashq.vllm_target import INSTALL_HINT, prepare_target, wrapped_name
from producers.conversation import normalize
from producers.regenerate import record_key, regenerate
from producers.vllm_engine import VllmEngine
from trainer.evaluate import SpeculativeResult, greedy_generate
from trainer.vllm_eval import pass_counts, summarize, tau
from workers.tiny_model import EOS_ID, copy_tokenizer_files, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 6


# --- tau as dflashq eval counts it -----------------------------------------------------------------------------
def test_the_prefill_token_is_no_pass_and_a_pass_counts_only_up_to_eos_and_max_new_tokens():
    # vLLM's deltas for one request: the prefill's token, three full passes of a block of 8, then a pass whose
    # accepted drafts ran past EOS (vLLM stops the request there: 3 tokens reach the output)
    assert pass_counts([1, 8, 8, 5, 3]) == [8, 8, 5, 3]
    assert tau(pass_counts([1, 8, 8, 5, 3])) == SpeculativeResult(list(range(25)), [8, 8, 5, 3]).tau == 6.0
    # max_new_tokens 10: the last pass is cut to the 2 tokens left
    assert pass_counts([1, 7, 2]) == [7, 2] and tau([7, 2]) == 4.5
    assert tau(pass_counts([1])) == SpeculativeResult([5], []).tau == 0.0  # ended at the prefill token (EOS)
    assert pass_counts([]) == [] and pass_counts([3, 2]) == [2, 2]  # a first delta of more than one token


def test_report_counts_per_prompt_and_keeps_vllms_pooled_figure_apart():
    def level(concurrency, tokens, wall, deltas=None, steps=None):
        entry = {"concurrency": concurrency, "prompts": 2, "tokens": tokens, "wall_s": wall, "steps": steps}
        if deltas is not None:
            entry.update(token_ids=[[0] * sum(d) for d in deltas], deltas=deltas)
        return entry

    target = {"init_s": 1.0, "levels": [level(1, 30, 3.0, steps=30), level(8, 30, 1.0, [[1] * 15, [1] * 15])]}
    # prompt 0: passes 8, 8 (tau 8); prompt 1: a pass of 8 and a last one cut at EOS after 3 of its 8 (tau 5.5)
    dflash = {"init_s": 2.0, "vllm_version": "0.26.0", "device": "test", "levels": [
        level(1, 30, 1.0, steps=8), level(8, 30, 0.5, [[1, 8, 8], [1, 8, 3]])],
        # four drafts of 7 tokens, all accepted: vLLM also counts the 5 accepted past EOS
        "counters": {"drafts": 4, "draft_tokens": 28, "accepted": 28, "accepted_per_pos": [4] * 7}}
    report = summarize(target, dflash, (["a", "b"], ["a", "c"]))
    assert report["mean_tau"] == (8 + 5.5) / 2 and report["tau_pooled"] == 27 / 4
    assert report["vllm_mean_acceptance_length"] == 8.0 and report["per_position_acceptance"] == [1.0] * 7
    assert report["identical_text"] == 1 and [p["identical"] for p in report["per_prompt"]] == [True, False]
    assert [(s["concurrency"], s["speedup"]) for s in report["speed"]] == [(1, 3.0), (8, 2.0)]
    assert [p["passes"] for p in report["per_prompt"]] == [2, 2]
    # c=1: 100 ms a decode step alone, 125 ms a step with the drafter: at most a fifth of a pass is the drafter's
    one = report["speed"][0]
    assert (one["target_ms_per_step"], one["dflash_ms_per_step"], one["drafter_share_of_pass_at_most"]) == (100.0, 125.0, 0.2)
    assert "target_ms_per_step" not in report["speed"][1]  # steps not counted there: nothing made up


# --- the target as vLLM loads it -------------------------------------------------------------------------------
def test_a_text_only_hybrid_folder_is_wrapped_as_the_class_vllm_registers(tmp_path, tiny_qwen35):
    # the multimodal checkpoint, as released: loaded as it is, its language model alone
    assert prepare_target(tiny_qwen35, tmp_path / "as-is")[1]["language_model_only"] is True
    assert not (tmp_path / "as-is").exists()
    # saved back through AutoModelForCausalLM (as `make_learnable` and a fine-tune do): text-only, model.layers.*
    text_only = tmp_path / "text-only"
    load_target(tiny_qwen35).save_pretrained(text_only)
    copy_tokenizer_files(str(text_only))
    assert json.loads((text_only / "config.json").read_text())["model_type"] == "qwen3_5_text"
    tiny_qwen35 = str(text_only)
    path, kwargs = prepare_target(tiny_qwen35, tmp_path / "work")
    assert kwargs["language_model_only"] is True
    if importlib.util.find_spec("flashinfer") is None:
        assert kwargs["additional_config"] == {"gdn_prefill_backend": "triton"}
    outer = json.loads((Path(path) / "config.json").read_text())
    inner = json.loads((Path(tiny_qwen35) / "config.json").read_text())
    assert outer["architectures"] == ["Qwen3_5ForConditionalGeneration"] and outer["model_type"] == "qwen3_5"
    assert outer["text_config"] == {k: v for k, v in inner.items() if k not in ("architectures", "transformers_version")}
    loaded = AutoConfig.from_pretrained(path)  # Transformers reads it as the multimodal config, text inside
    assert loaded.model_type == "qwen3_5" and loaded.text_config.layer_types == inner["layer_types"]
    ours = {}
    for file in Path(tiny_qwen35).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            ours.update({k: f.get_tensor(k) for k in f.keys()})
    theirs = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            theirs.update({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(theirs) == sorted(map(wrapped_name, ours))
    assert any(k.startswith("model.language_model.layers.") for k in theirs) and "lm_head.weight" in theirs
    assert all((theirs[wrapped_name(k)] == v).all() for k, v in ours.items())
    assert AutoTokenizer.from_pretrained(path).chat_template  # the tokenizer files came along


def test_tensor_names_move_under_the_language_model_once():
    assert wrapped_name("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    assert wrapped_name("model.language_model.norm.weight") == "model.language_model.norm.weight"
    assert wrapped_name("lm_head.weight") == "lm_head.weight"


def test_an_attention_only_folder_loads_as_it_is(tmp_path):
    llama = write_tiny_model(str(tmp_path / "llama"), "llama")
    assert prepare_target(llama, tmp_path / "work") == (llama, {})
    assert not (tmp_path / "work").exists()


# --- regenerate --engine vllm -----------------------------------------------------------------------------------
class GreedyTarget:
    """The TokenGenerator seam with the real tiny target behind it, decoding each row greedily with its cache and
    honouring what VllmEngine asks for (max_tokens, stop_token_ids)."""

    def __init__(self, path: str, max_model_len: int = 4096):
        self.model = load_target(path, "cpu")
        self.max_model_len = max_model_len
        self.calls: list[tuple[int, dict]] = []

    def generate(self, rows, sampling):
        self.calls.append((len(rows), sampling))
        assert sampling["temperature"] == 0.0
        return [greedy_generate(self.model, row, sampling["max_tokens"], set(sampling["stop_token_ids"])) for row in rows]

    def close(self):
        pass


def chat(*turns: str, **extra) -> dict:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)], **extra}


def own_turns(generator: GreedyTarget, tokenizer, record: dict) -> list[dict]:
    """The target's own turns the plain way: each assistant turn from the regenerated history before it."""
    messages = []
    for message in normalize(record).messages:
        if message["role"] == "assistant":
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens = greedy_generate(generator.model, ids, MAX_NEW, {EOS_ID, tokenizer.eos_token_id})
            message = {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}
        messages.append(message)
    return messages


def test_vllm_engine_keeps_the_regenerate_contract(tmp_path, tiny_qwen35):
    records = [chat(f"Question {i} " + "about the sea " * (i % 3), "old", id=f"r{i}") for i in range(6)]
    records[1] = chat("First", "old 1", "Second?", "old 2", id="r1")
    records.append(chat("tell me " + "much more " * 40, "old", id="long"))  # over the engine's max_model_len
    lines = [json.dumps(r) for r in records] + ['{"messages": [', json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]})]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    settings = S.load(None, [("model.path", tiny_qwen35), ("regenerate.max_new_tokens", MAX_NEW)], environ={})
    generator = GreedyTarget(tiny_qwen35, max_model_len=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen35)
    out = tmp_path / "out.jsonl"
    with VllmEngine(settings, generator=generator) as engine:
        assert engine.eos_ids >= {EOS_ID}
        report = regenerate(settings, [str(data)], str(out), engine, progress=False)
    assert (report.regenerated, report.failed, report.rejected) == (6, 1, 2)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["id"] for w in written].count("r1") == 1 and len(written) == 6
    for record, line in zip(records, sorted(written, key=lambda w: int(w["id"][1:]))):
        assert line["messages"] == own_turns(generator, tokenizer, record), record["id"]
        assert line["source"] == f"{data}:{records.index(record) + 1}"
    (failed,) = [json.loads(line) for line in (tmp_path / "out.failed.jsonl").read_text().splitlines()]
    assert failed["id"] == "long" and "max_model_len 64" in failed["reason"]
    rejects = [json.loads(line) for line in (tmp_path / "out.rejects.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{data}:{len(records) + 1}", f"{data}:{len(records) + 2}"]
    assert generator.calls[0][1]["max_tokens"] == MAX_NEW and EOS_ID in generator.calls[0][1]["stop_token_ids"]

    # a rerun after a crash mid-line: the torn line is redone, nothing done is asked for again
    keys = [record_key(r) for r in records[:6]]
    whole = [w for w in written if w["id"] != "r0"]
    out.write_text("".join(json.dumps(w) + "\n" for w in whole) + json.dumps(written[0])[:20])
    generator.calls.clear()
    generator.max_model_len = 4096
    with VllmEngine(settings, generator=generator) as engine:
        rerun = regenerate(settings, [str(data)], str(out), engine, progress=False)
    assert rerun.torn_line_dropped and (rerun.already_done, rerun.regenerated) == (5, 2)
    assert sum(n for n, _ in generator.calls) == 2  # the torn record and the long one: one turn each
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == sorted(keys + ["long"])


# --- without vLLM -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_both_commands_name_the_extra(tmp_path, tiny_qwen35):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(chat("hi", "old")) + "\n")
    for args in (["eval", "--engine", "vllm", "--model", tiny_qwen35, "--drafter", str(tmp_path), "--data", str(prompts)],
                 ["regenerate", "--engine", "vllm", "--model", tiny_qwen35, str(data), "--out", str(tmp_path / "o.jsonl")]):
        done = subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == f"dflashq: vLLM is not installed: {INSTALL_HINT}, on a machine with a CUDA GPU."
    with pytest.raises(InputError, match="dflashq\\[vllm\\]"):
        VllmEngine(S.load(None, [("model.path", tiny_qwen35)], environ={}))
