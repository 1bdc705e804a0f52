"""The target's frozen token embedding and LM head, read alone from its safetensors (the rest is never loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from dflashq.exceptions import InputError

# Known names first (plain causal LMs, multimodal checkpoints whose text model sits under `language_model`).
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")


class TargetHead(nn.Module):
    """Frozen embed_tokens [V, H] and lm_head [V, H] as non-persistent buffers: they follow .to() but are never
    saved with, or trained in, the drafter."""

    def __init__(self, embed_tokens: Tensor, lm_head: Tensor):
        super().__init__()
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)  # [V, H]
        self.register_buffer("lm_head", lm_head, persistent=False)  # [V, H]

    def embed(self, token_ids: Tensor) -> Tensor:
        return nn.functional.embedding(token_ids, self.embed_tokens)  # [..., H]

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.lm_head.T  # [..., V]

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> TargetHead:
        """Load from a checkpoint folder (model.safetensors, a sharded index, or loose *.safetensors files);
        a checkpoint without an LM head (tied embeddings) reuses the embedding."""
        files = _key_files(Path(model_dir))
        embed_key = _pick(files, EMBED_KEYS, "embed_tokens.weight", model_dir)
        head_key = _pick(files, LM_HEAD_KEYS, "lm_head.weight", model_dir, required=False)
        embed = _read(files[embed_key], embed_key, dtype, device)  # [V, H]
        head = embed if head_key is None else _read(files[head_key], head_key, dtype, device)  # [V, H]
        if head.shape != embed.shape:
            raise InputError(
                f"{model_dir}: lm_head {tuple(head.shape)} and embed_tokens {tuple(embed.shape)} differ in shape; "
                "point the model path at a causal LM checkpoint."
            )
        return cls(embed, head)


def _key_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, read from the shard index or from the files' headers only."""
    if not model_dir.is_dir():
        raise InputError(f"Target model folder {model_dir} does not exist; set model.path to a local checkpoint.")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"{model_dir} holds no *.safetensors file; save the target with safetensors weights.")
    key_files = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            key_files.update(dict.fromkeys(f.keys(), path))
    return key_files


def _pick(files: dict[str, Path], known: tuple[str, ...], suffix: str, model_dir, required: bool = True) -> str | None:
    for key in known:
        if key in files:
            return key
    matches = [key for key in files if key.endswith(suffix)]
    if len(matches) == 1:
        return matches[0]
    if not required and not matches:
        return None
    raise InputError(
        f"{model_dir}: expected exactly one tensor named like {suffix!r}, found {len(matches)} ({matches[:4]}); "
        "point the model path at a text causal LM checkpoint."
    )


def _read(path: Path, key: str, dtype: torch.dtype | None, device) -> Tensor:
    with safe_open(path, framework="pt", device=str(device)) as f:
        tensor = f.get_tensor(key)  # [V, H]
    return tensor if dtype is None else tensor.to(dtype)  # [V, H]
