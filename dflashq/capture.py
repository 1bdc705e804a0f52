"""Tapping the target: forward hooks on the configured decoder layers (z-lab convention: id t = the output of
decoder layer t). Shared by the workers (extraction, verification) and the trainer (speculative evaluation).

With `stop_after_deepest` (extraction) the forward ends right after the deepest tapped layer: no later layer,
final norm or logits run; the deepest layer's hook raises a private exception that `capture` catches.
"""

from __future__ import annotations

import torch

from dflashq.exceptions import ConfigError


class _StopForward(Exception):
    """Raised by the deepest tapped layer's hook to end the forward pass early."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM, wherever the architecture keeps it (model.layers,
    model.language_model.layers, transformer.h, ...): the shallowest ModuleList with num_hidden_layers entries."""
    count = model.config.get_text_config().num_hidden_layers
    found = [
        (name.count("."), name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == count
    ]
    if not found:
        name = type(model).__name__
        raise ConfigError(f"cannot find the {count} decoder layers of {name}; it is not a supported target model.")
    return min(found, key=lambda item: item[:2])[2]


class HiddenStateCapture:
    """Captures the outputs of decoder layers `layer_ids` (z-lab convention), in that order, as [B, T, K, H].

    stop_after_deepest=False lets the forward run on (for a caller that also needs the logits, and calls the
    model itself, then `take()`)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], stop_after_deepest: bool = True):
        self.model = model
        self.stop_after_deepest = stop_after_deepest
        self.layer_ids = [int(i) for i in layer_ids]
        layers = decoder_layers(model)
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad or not self.layer_ids:
            raise ConfigError(
                f"layer ids {self.layer_ids} must be non-empty and within the target's {len(layers)} decoder layers "
                f"(0..{len(layers) - 1}, z-lab convention); fix model.layer_ids."
            )
        self.deepest = max(self.layer_ids)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output
            if self.stop_after_deepest and layer_id == self.deepest:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (right-padded; attention_mask 1 on real tokens) -> hidden states [B, T, K, H]."""
        self._outputs.clear()
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise RuntimeError("the forward pass never reached the deepest tapped layer")
        return self.take()

    def take(self) -> torch.Tensor:
        """The tapped states of the last forward: [B, T, K, H]."""
        try:
            return torch.stack([self._outputs[i] for i in self.layer_ids], dim=2)
        finally:
            self._outputs.clear()

    def close(self) -> None:
        """Remove the hooks; the model runs normally again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
