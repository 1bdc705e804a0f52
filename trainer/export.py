"""Export a drafter in the z-lab DFlash format (config.json + bf16 model.safetensors) that vLLM, SGLang and the
reference `dflash` package load, and read such a folder back into the project's DFlashDrafter.

Target layer ids in `dflash_config.target_layer_ids` are in the z-lab convention (id t = output of target decoder
layer t); the safetensors metadata says so too, since config.json has no field for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflashq import defaults
from dflashq.exceptions import ConfigError, InputError
from dflashq.layer_ids import CONVENTION
from dflashq.store import new_folder
from trainer.checkpoint import load_drafter
from trainer.drafter import DFLASH2_FIELDS, DFlashDrafter, DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


# DFlash2's codebooks are stored as bare tensors: the reference's from_pretrained maps these names onto its
# nn.Embedding weights (and would map a `.weight` name to `.weight.weight`)
EXPORT_NAMES = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                for name in ("predecessor_codebook", "successor_codebook")}
MODULE_NAMES = {exported: name for name, exported in EXPORT_NAMES.items()}


def export_config(config: DrafterConfig) -> dict:
    """The config.json of an exported drafter: a Qwen3 decoder config plus the DFlash fields (and DFlash2's)."""
    sliding = "sliding_attention" in config.layer_types
    dflash2 = {name: getattr(config, name) for name in DFLASH2_FIELDS} if config.dflash2 else {}
    return {
        "architectures": ["DFlash2DraftModel" if config.dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "layer_types": list(config.layer_types),
        # no window at all without sliding layers: a server must not read one into full-attention layers
        "sliding_window": config.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
            "block_size": config.block_size,
            **dflash2,
        },
        "torch_dtype": "bfloat16",
    }


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write `drafter` to the new folder `out_dir` (temporary folder + rename: never a half-written export)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise InputError(f"export folder {out_dir} already exists; choose a new folder or delete the old export.")
    tensors = {EXPORT_NAMES.get(name, name): t.detach().to(torch.bfloat16).contiguous().cpu()
               for name, t in drafter.state_dict().items()}
    with new_folder(out_dir) as tmp:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt", "target_layer_ids_convention": CONVENTION})
        (tmp / CONFIG_FILE).write_text(json.dumps(export_config(drafter.config), indent=2) + "\n")
    return out_dir


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the drafter of a trainer checkpoint folder (`<run>/checkpoints/step-N`)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "state.json").is_file() or not (checkpoint_dir / "drafter.safetensors").is_file():
        raise InputError(
            f"{checkpoint_dir} is not a trainer checkpoint (needs state.json and drafter.safetensors); "
            "point it at a <run>/checkpoints/step-N folder."
        )
    return export_drafter(load_drafter(checkpoint_dir), out_dir)


def export_path(checkpoint_dir: str | Path) -> Path:
    """Where `up` and the demo export a checkpoint `<run>/checkpoints/step-N`: `<run>/drafter-step-N`."""
    checkpoint_dir = Path(checkpoint_dir)
    return checkpoint_dir.parent.parent / f"drafter-{checkpoint_dir.name}"


def export_once(checkpoint_dir: str | Path) -> Path:
    """The checkpoint's export at export_path, written by the first call (a rerun of `up` or the demo reuses it)."""
    target = export_path(checkpoint_dir)
    return target if target.exists() else export_checkpoint(checkpoint_dir, target)


def config_from_export(config: dict) -> DrafterConfig:
    """DrafterConfig of an exported config.json; configs without layer_types (older releases) are all full attention."""
    dflash = config["dflash_config"]
    num_layers = config["num_hidden_layers"]
    dflash2 = "DFlash2DraftModel" in config.get("architectures", [])
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        block_size=dflash.get("block_size", config.get("block_size")),
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=dflash["mask_token_id"],
        layer_types=config.get("layer_types") or ["full_attention"] * num_layers,
        sliding_window=config.get("sliding_window") or defaults.SLIDING_WINDOW,
        num_target_layers=config["num_target_layers"],
        **({"architecture": "dflash2", **{name: dflash[name] for name in DFLASH2_FIELDS}} if dflash2 else {}),
    )


def load_exported(export_dir: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter of an exported folder, with its bf16 weights, in eval mode on `device`."""
    export_dir = Path(export_dir)
    config_file, weights_file = export_dir / CONFIG_FILE, export_dir / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise InputError(f"{export_dir} is not an exported drafter (needs {CONFIG_FILE} and {WEIGHTS_FILE}).")
    try:
        config = config_from_export(json.loads(config_file.read_text()))
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise InputError(f"{config_file} is not a valid DFlash drafter config ({type(exc).__name__}: {exc}).") from None
    try:
        tensors = {MODULE_NAMES.get(name, name): t for name, t in load_file(weights_file, device=str(device)).items()}
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{weights_file} cannot be read as safetensors ({exc}); re-export the drafter.") from None
    with torch.device("meta"):  # no random init of weights that are replaced at once
        drafter = DFlashDrafter(config)
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        wrong = sorted(set(expected.items()) ^ set(found.items()))[:4]
        raise InputError(f"{weights_file} does not match its config.json (tensor names/shapes differ: {wrong}).")
    drafter.load_state_dict(tensors, assign=True)
    return drafter.eval()
