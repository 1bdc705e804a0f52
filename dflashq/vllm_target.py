"""The target as vLLM loads it: the optional `vllm` extra, the wrap a text-only hybrid folder needs, and the engine
settings that every dflashq use of vLLM shares (regenerate --engine vllm, eval --engine vllm).

Written against vLLM 0.26.0 (VLLM_VERSION), the release the benchmarks ran; nothing here imports vLLM at module
level, so the rest of dflashq works without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

from dflashq.exceptions import InputError

VLLM_VERSION = "0.26.0"
INSTALL_HINT = f"pip install 'dflashq[vllm]' (vLLM {VLLM_VERSION})"

# Text-only Qwen3.5 folders (as `dflashq tiny-model` writes them) are no vLLM 0.26 architecture; released
# checkpoints are the multimodal class, which loads the language model alone with language_model_only=True.
HYBRID_TEXT_WRAPS = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
}
WRAPPED_PREFIX = "model.language_model."  # where the multimodal class keeps the text model's weights
OUTER_KEYS = ("eos_token_id", "pad_token_id", "bos_token_id", "dtype", "torch_dtype", "tie_word_embeddings")


def require_vllm() -> None:
    """One sentence naming the extra to install, where vLLM is missing (checked without importing it)."""
    if importlib.util.find_spec("vllm") is None:
        raise InputError(f"vLLM is not installed: {INSTALL_HINT}, on a machine with a CUDA GPU.")


def import_vllm():
    require_vllm()
    return importlib.import_module("vllm")


def read_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise InputError(f"model folder {path} has no config.json; give a local Transformers model folder.")
    return json.loads(config_file.read_text())


def is_hybrid(config: dict) -> bool:
    """Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next): their prefill kernel needs a backend choice in vLLM."""
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or []) or config.get("model_type", "").startswith("qwen3_next")


def wrapped_config(config: dict) -> dict | None:
    """The multimodal config vLLM registers, around a text-only hybrid config; None when none is needed."""
    wrap = HYBRID_TEXT_WRAPS.get(config.get("model_type"))
    if wrap is None:
        return None
    model_type, architecture = wrap
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    outer = {"architectures": [architecture], "model_type": model_type, "text_config": text}
    outer.update({key: config[key] for key in OUTER_KEYS if key in config})
    outer.setdefault("tie_word_embeddings", False)
    return outer


def wrapped_name(name: str) -> str:
    """A text-only checkpoint's tensor name as the multimodal class loads it (newer Transformers already save the
    text model under the multimodal names)."""
    if name.startswith(WRAPPED_PREFIX) or not name.startswith("model."):
        return name
    return WRAPPED_PREFIX + name.removeprefix("model.")


def prepare_target(path: str | Path, workdir: str | Path) -> tuple[str, dict]:
    """(the folder vLLM should load, the LLM keyword arguments it needs). A text-only hybrid folder is rewritten
    into `workdir` (config wrapped, weights renamed; everything else linked), as vLLM has no text-only class."""
    config = read_config(path)
    kwargs: dict = {}
    if is_hybrid(config) and importlib.util.find_spec("flashinfer") is None:
        kwargs["additional_config"] = {"gdn_prefill_backend": "triton"}  # vLLM's Hopper default is FlashInfer's
    outer = wrapped_config(config)
    if outer is None:
        if "vision_config" in config:  # a released multimodal checkpoint: its language model alone
            kwargs["language_model_only"] = True
        return str(path), kwargs
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = Path(workdir) / "target"
    target.mkdir(parents=True, exist_ok=True)
    for item in Path(path).iterdir():
        if item.name == "config.json" or item.name.endswith(".safetensors.index.json"):
            continue
        if item.suffix == ".safetensors":
            with safe_open(str(item), framework="pt") as f:
                save_file({wrapped_name(k): f.get_tensor(k) for k in f.keys()}, str(target / item.name),
                          metadata={"format": "pt"})
        elif not (target / item.name).exists():
            os.symlink(item.resolve(), target / item.name)
    index = next(Path(path).glob("*.safetensors.index.json"), None)
    if index is not None:
        data = json.loads(index.read_text())
        data["weight_map"] = {wrapped_name(k): v for k, v in data["weight_map"].items()}
        (target / index.name).write_text(json.dumps(data))
    (target / "config.json").write_text(json.dumps(outer, indent=2))
    return str(target), {**kwargs, "language_model_only": True}


def engine_environment() -> dict[str, str]:
    """Environment for a process that starts vLLM: without FlashInfer, vLLM's sampler must not import it."""
    env = {}
    if importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env
