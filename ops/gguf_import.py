"""`dflashq import-gguf`: turn a llama.cpp GGUF checkpoint into a plain Transformers folder (config.json,
generation_config.json, bf16 model.safetensors, tokenizer with its chat template).

Recent Transformers keep GGUF weights quantized in memory and refuse to save them, so the tensors are dequantized
here with the `gguf` package. The tokenizer is rebuilt here too, with llama.cpp's semantics: Transformers' own
GGUF tokenizer differs between the versions the project supports (5.15 picks the wrong EOS and splits added tokens
such as `<think>`), and a target's tokenizer must not depend on the Transformers version that imported it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflashq.exceptions import InputError
from dflashq.store import new_folder

WEIGHTS_FILE = "model.safetensors"
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF general.architecture; the same name is the HF model_type

# llama.cpp tensor names (gguf-py's tensor_mapping.py) -> Transformers names; layer ones under blk.N. / model.layers.N.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent: tied embeddings
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_LAYER_TENSORS = {
    "llama": {},
    "qwen2": {  # Qwen2 always has q/k/v biases (and none on o_proj)
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "qwen3": {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
}

# tokenizer.ggml.pre -> pre-tokenizer, as llama.cpp's llama-vocab.cpp splits text for it.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("qwen2", "smollm")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert the GGUF file `gguf_path` into the new Transformers model folder `out_dir` (written atomically)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise InputError(f"there is no GGUF file at {gguf_path}; give the path of a llama.cpp .gguf checkpoint.")
    if out_dir.exists():
        raise InputError(f"output folder {out_dir} already exists; choose a new folder or delete the old one.")
    reader = _open(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise InputError(f"{gguf_path} is a GGUF of architecture {arch!r}; import-gguf converts {', '.join(ARCHITECTURES)} only.")
    # Everything that can be refused is checked before the first byte is written.
    names = _hf_names(reader, arch, _require(meta, f"{arch}.block_count", gguf_path), gguf_path)
    config = _config(meta, arch, reader, gguf_path)
    tokenizer = _tokenizer(meta, gguf_path, config.max_position_embeddings)

    with new_folder(out_dir) as tmp:
        _write_weights(reader, names, config, tmp / WEIGHTS_FILE, gguf_path, progress)
        config.save_pretrained(tmp)
        generation = _generation_config(config)
        if generation is not None:
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _open(gguf_path: Path):
    from gguf import GGUFReader

    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise InputError(f"{gguf_path} is not a GGUF file (it does not start with 'GGUF'); give a llama.cpp .gguf checkpoint.")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError, OSError) as exc:  # what the reader raises on a cut or damaged file
        raise InputError(f"{gguf_path} is a truncated or damaged GGUF file ({exc}); download or convert it again.") from None


def _metadata(reader) -> dict:
    """Every metadata key as a Python value (str, int, float, bool or a list of them)."""
    from gguf import GGUFValueType

    def scalar(part, kind):
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.FLOAT32:  # the shortest decimal of that float32: 1e-05, not 9.999999747378752e-06
            return float(str(part[0]))
        return part[0].item()

    meta = {}
    for key, field in reader.fields.items():
        if field.types[0] == GGUFValueType.ARRAY:
            meta[key] = [scalar(field.parts[i], field.types[-1]) for i in field.data]
        else:
            meta[key] = scalar(field.parts[field.data[0]], field.types[0])
    return meta


def _require(meta: dict, key: str, gguf_path: Path):
    if key not in meta:
        raise InputError(f"{gguf_path} has no metadata key {key!r}; it is not a complete llama.cpp model file.")
    return meta[key]


def _hf_names(reader, arch: str, num_layers: int, gguf_path: Path) -> dict[str, str]:
    """GGUF tensor name -> Transformers name; refuses a tensor with no counterpart and a missing one."""
    layer_names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS[arch]}
    expected = dict(_GLOBAL_TENSORS)
    expected.update({f"blk.{i}.{name}": f"model.layers.{i}.{hf}" for i in range(num_layers) for name, hf in layer_names.items()})
    found = {tensor.name for tensor in reader.tensors}
    for name in found - set(expected):
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling) or MoE experts: nothing to put them in
        raise InputError(f"{gguf_path} holds tensor {name!r}, which import-gguf cannot convert to a {arch} Transformers model.")
    missing = sorted(set(expected) - found - {"output.weight"})
    if missing:
        raise InputError(f"{gguf_path} lacks tensor(s) {missing[:3]}; it is not a complete {num_layers}-layer {arch} checkpoint.")
    return {name: expected[name] for name in found}


def _config(meta: dict, arch: str, reader, gguf_path: Path):
    from transformers import AutoConfig

    def need(name):
        return _require(meta, f"{arch}.{name}", gguf_path)

    def get(name, default):
        return meta.get(f"{arch}.{name}", default)

    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise InputError(f"{gguf_path} uses {scaling!r} rope scaling, which import-gguf does not convert; use a checkpoint without it.")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    # llama.cpp: head size is attention.key_length when given, else hidden / heads; rotary dims default to all of it
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise InputError(f"{gguf_path} rotates only part of each attention head, which a Transformers {arch} model cannot do.")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return AutoConfig.for_model(
        arch,
        architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are [columns, rows]: the rows the weights really have
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_hidden_layers=need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=need("context_length"),
        rms_norm_eps=need("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),  # llama.cpp's default
        hidden_act="silu",
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        dtype=torch.bfloat16,
    )


def _generation_config(config):
    if config.bos_token_id is None and config.eos_token_id is None:
        return None
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=config.pad_token_id)


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Transformers' rotary embedding pairs dimension i with i + d/2 of each head;
    llama.cpp's converter reorders each head's rows so the pairs sit side by side (i -> 2i, i + d/2 -> 2i + 1)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def _write_weights(reader, names: dict[str, str], config, path: Path, gguf_path: Path, progress: bool) -> None:
    from gguf.quants import dequantize
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.torch import save_file

    # llama.cpp permutes q/k only for the llama architecture (its LlamaModel converter); Qwen keeps HF's order.
    permuted = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}
    columns = (TextColumn("import-gguf"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
               TimeElapsedColumn(), TextColumn("{task.fields[tensor]}"))
    tensors = {}
    # stderr: stdout carries only the output path, for scripts
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("tensors", total=len(reader.tensors), tensor="")
        for tensor in reader.tensors:
            bar.update(task, tensor=tensor.name)
            try:
                values = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise InputError(f"{gguf_path} stores tensor {tensor.name!r} as {tensor.tensor_type.name}, which the "
                                 f"gguf package cannot dequantize; use a file with another quantization.") from None
            # np.require copies only the read-only views of the memory-mapped file (F32 tensors)
            weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
            suffix = tensor.name.split(".", 2)[-1]
            if config.model_type == "llama" and suffix in permuted:
                weight = _unpermute(weight, permuted[suffix])
            tensors[names[tensor.name]] = weight.to(torch.bfloat16)
            bar.advance(task)
    save_file(tensors, path, metadata={"format": "pt"})


def _tokenizer(meta: dict, gguf_path: Path, context_length: int):
    """A byte-level BPE tokenizer that splits, merges and adds special tokens as llama.cpp does for this file."""
    from gguf import TokenType
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise InputError(f"{gguf_path} has tokenizer {model!r} with pre-tokenizer {pre!r}; import-gguf converts "
                         f"byte-level BPE ('gpt2') tokenizers with pre-tokenizer {' or '.join(PRE_TOKENIZERS)} only.")
    tokens = _require(meta, "tokenizer.ggml.tokens", gguf_path)
    merges = [tuple(merge.split(" ", 1)) for merge in _require(meta, "tokenizer.ggml.merges", gguf_path)]
    backend = Tokenizer(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    if pre == "qwen2":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # smollm: every digit alone, then GPT-2's split (ByteLevel's built-in regex)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    # llama.cpp matches control and user-defined tokens whole before splitting; only control ones are special
    types = meta.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == TokenType.CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED])

    def token(key):
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        # for these BPE pre-tokenizers llama.cpp adds neither unless the file says so
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=context_length,
    )
