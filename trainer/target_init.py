"""Starting the drafter from the target's own last decoder layers (`train.init = "target"`).

A drafter trained from scratch on a few thousand conversations learns its layers from what little it sees; the
target's last layers already map its hidden states to what the LM head reads. Every drafter tensor whose name and
shape match the target's (drafter layer i <- target layer L - n + i, the final norm <- the target's) is copied;
the rest (fc, hidden_norm, and whatever the target lays out otherwise: linear-attention or gated layers, MoE
experts, another head shape) keeps its random start. Copied attention only makes sense under the RoPE base it was
trained with, so such a drafter takes the target's (daemon).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.drafter import DFlashDrafter
from trainer.target_head import EMBED_KEYS, _key_files, _pick, _read

# model types whose RMSNorm scales by (1 + weight): their stored norms are offsets from one, the drafter's are scales
ZERO_CENTRED_NORMS = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                "gemma", "gemma2", "gemma3", "gemma3_text"})


def target_rope_theta(target_config: dict[str, Any]) -> float | None:
    """The target's RoPE base (transformers 5 keeps it under rope_parameters), None where it gives none."""
    text = target_config.get("text_config") or target_config
    theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
    return float(theta) if theta else None


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, model_dir: str | Path, target_config: dict[str, Any]) -> list[str]:
    """Copies the target's matching tensors into `drafter` in place; returns the drafter's names that were copied."""
    files = _key_files(Path(model_dir))
    # the text model's prefix ("model.", "model.language_model.", ...), read off its embedding: a multimodal or MTP
    # checkpoint also holds other `layers.{i}` tensors
    prefix = _pick(files, EMBED_KEYS, "embed_tokens.weight", model_dir).removesuffix("embed_tokens.weight")
    text = target_config.get("text_config") or target_config
    zero_centred = {text.get("model_type"), target_config.get("model_type")} & ZERO_CENTRED_NORMS
    first = drafter.config.num_target_layers - drafter.config.num_layers
    copied = []
    for name, tensor in drafter.state_dict().items():
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            key = f"{prefix}layers.{first + int(index)}.{rest}"
        elif name == "norm.weight":
            key = f"{prefix}norm.weight"
        else:
            continue
        if key not in files:
            continue
        source = _read(files[key], key, torch.float32, tensor.device)  # the target's tensor, as the drafter's
        if source.shape != tensor.shape:
            continue
        if zero_centred and name.endswith("norm.weight"):
            source += 1.0
        tensor.copy_(source)
        copied.append(name)
    return copied
