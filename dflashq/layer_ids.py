"""Tapped target layers, always in the z-lab convention: id t = the OUTPUT of decoder layer t (0-based),
which is `hidden_states[t + 1]` in Transformers' `output_hidden_states` tuple. vLLM and speculators count one higher."""

from __future__ import annotations

CONVENTION = "z-lab (id t = output of decoder layer t, 0-based = hidden_states[t+1])"


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFLASH.md's rule: n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)). L=36 -> [1, 9, 17, 25, 33]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    # int(x + 0.5), not round(): Python's round() is banker's rounding and the rule means round-half-up.
    return [int(1 + i * (num_target_layers - 4) / (num_draft_layers - 1) + 0.5) for i in range(num_draft_layers)]
