"""Tapped target layers, always in the z-lab convention: id t = the OUTPUT of decoder layer t (0-based),
which is `hidden_states[t + 1]` in Transformers' `output_hidden_states` tuple. vLLM and speculators count one higher."""

from __future__ import annotations

CONVENTION = "z-lab (id t = output of decoder layer t, 0-based = hidden_states[t+1])"


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule (docs/architecture.md): n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)) with Python's
    round() (half to even), as z-lab's `build_target_layer_ids`, SpecForge and SGLang compute it: a server that derives the ids
    itself must get the ones the drafter was trained on. L=36 -> [1, 9, 17, 25, 33]; L=30 -> [1, 8, 14, 20, 27]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def target_num_layers(model_path: str) -> int:
    """Decoder layers of a local target checkpoint (its text model's, for multimodal checkpoints)."""
    import json
    import os

    from dflashq.exceptions import InputError

    config_file = os.path.join(model_path, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InputError(f"Model folder {model_path} has no config.json: set model.path to a local Transformers checkpoint.") from None
    config = config.get("text_config", config)
    return int(config["num_hidden_layers"])


def resolve_layer_ids(model_path: str, configured: list[int], num_draft_layers: int) -> list[int]:
    """The configured ids, else the DFlash default for the target's depth; checked against that depth."""
    from dflashq.exceptions import ConfigError

    depth = target_num_layers(model_path)
    ids = list(configured) or default_layer_ids(depth, num_draft_layers)
    bad = [i for i in ids if not 0 <= i < depth]
    if bad:
        raise ConfigError(f"model.layer_ids {bad} are outside the target's {depth} layers (z-lab convention, 0-based): fix model.layer_ids.")
    if ids != sorted(set(ids)):
        raise ConfigError(f"model.layer_ids {ids} must be strictly increasing: fix model.layer_ids.")
    return ids
