"""The target model: loaded once per worker from a local folder, safetensors weights only, text model only."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from dflashq.exceptions import InputError


def block_unusable_kernels() -> None:
    """Keep Transformers off flash-linear-attention / causal-conv1d where their kernels cannot run.

    Transformers' linear-attention layers (qwen3_5, qwen3_next) import `fla` and `causal_conv1d` when their modeling
    module is first imported and use them whenever the import succeeds; both are Triton/CUDA only and crash on a
    CPU-only machine. A None entry in sys.modules makes that import fail, so the reference torch path is chosen.
    Must run before the modeling module is imported; where an accelerator is usable this does nothing.
    """
    from transformers.utils import is_causal_conv1d_available, is_flash_linear_attention_available

    if not is_flash_linear_attention_available():
        sys.modules.setdefault("fla", None)
    if not is_causal_conv1d_available():
        sys.modules.setdefault("causal_conv1d", None)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on an accelerator, float32 on the CPU; else the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise InputError(f"unknown model dtype {dtype!r}; use auto, bfloat16, float16 or float32.")
    return names[dtype]


def load_target(
    path: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto", trust_remote_code: bool = False
) -> torch.nn.Module:
    """AutoModelForCausalLM from the local folder `path`, in eval mode on `device`.

    Multimodal checkpoints (a config with `text_config`, e.g. Qwen3.5/3.6 with vision) load their language model
    only: Transformers maps such a config to the text-only *ForCausalLM class and drops the vision weights.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"model folder {path!r} has no config.json; set model.path to a local Transformers model.")
    block_unusable_kernels()
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    # device_map loads the weights straight onto the GPU (no full copy in host memory) but needs accelerate.
    placement = {"device_map": str(device)} if device.type != "cpu" and importlib.util.find_spec("accelerate") else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype, device),
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            **placement,
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load the target model from {path!r} ({first}); it must be a causal LM with "
                         f"safetensors weights (set model.trust_remote_code for custom code).") from None
    return model.to(device).eval()


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a turn: the generation config's (often several) and the tokenizer's. Generation
    (regenerate) and evaluation (eval) must stop on the same ids."""
    return _turn_ends(model.generation_config, tokenizer)


def eos_ids_of_folder(path: str, tokenizer) -> set[int]:
    """eos_ids without loading the weights (for engines that load the target themselves, as vLLM does): the folder's
    generation_config.json, else the one Transformers derives from its config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path).get_text_config())
    return _turn_ends(generation_config, tokenizer)


def _turn_ends(generation_config, tokenizer) -> set[int]:
    configured = generation_config.eos_token_id
    ids = set(configured if isinstance(configured, (list, tuple)) else [configured]) | {tokenizer.eos_token_id}
    return {int(i) for i in ids if i is not None}

