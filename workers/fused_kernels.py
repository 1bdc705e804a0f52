"""flash-linear-attention's fused Triton kernels in place of Transformers' op-by-op torch code in the hybrid Qwen
targets (Qwen3.5/3.6 dense and MoE, Qwen3-Next), on a GPU.

Transformers already runs these models' gated delta rule with fla, but not the code around it: the short
convolution falls back to `F.conv1d` (plus transposes and a separate SiLU) unless the causal-conv1d package is
installed (it ships no wheels), and every RMSNorm, gated RMSNorm and SwiGLU is 4 to 10 elementwise kernels. On a
Qwen3.6-27B-shaped model they take a large share of the forward's time (docs/performance.md). Each replacement computes
the same function in fp32 and rounds once, where the torch code also rounds to bf16 in between: measured against
float32 the states come out closer than plain Transformers' (`benchmarks/extract.py` checks this on every run).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from collections import Counter
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

ZERO_CENTRED_NORMS = {"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"}  # weight w, applied as (1 + w)
GATED_NORMS = {"Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated"}  # norm(x) * w * silu(gate)
SWIGLU_MLPS = {"Qwen3_5MLP", "Qwen3_5MoeMLP", "Qwen3NextMLP"}  # down(silu(gate(x)) * up(x))


def usable(model: torch.nn.Module) -> bool:
    """fla's kernels run on a CUDA model with flash-linear-attention importable (not blocked on a CPU machine)."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    return on_gpu and sys.modules.get("fla", True) is not None and importlib.util.find_spec("fla") is not None


def _replacements() -> tuple[dict[str, types.FunctionType], types.FunctionType]:
    """The fla-backed forward of each replaced class, and the short convolution."""
    from fla.modules.activations import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm

    def zero_centred_norm(self, x):
        return rms_norm(x, 1.0 + self.weight.float(), None, eps=self.eps)  # x: [..., D]

    def gated_norm(self, hidden_states, gate):
        return rms_norm_gated(hidden_states, gate, self.weight, None, activation="silu", eps=self.variance_epsilon)

    def swiglu_mlp(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # [B, T, H] -> [B, T, I] -> [B, T, H]

    def short_convolution(hidden_states, weight, bias=None, activation=None, **kwargs):
        """Transformers' `causal_conv1d_fn`: hidden_states [B, D, T] is a transposed view of the [B, T, D]
        projection, which is what fla reads, so neither direction copies."""
        out, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)  # [B, T, D]
        return out.transpose(1, 2)  # [B, D, T]

    forwards = {name: zero_centred_norm for name in ZERO_CENTRED_NORMS}
    forwards |= {name: gated_norm for name in GATED_NORMS}
    forwards |= {name: swiglu_mlp for name in SWIGLU_MLPS}
    return forwards, short_convolution


def _replaceable(module: torch.nn.Module, hidden_size: int) -> bool:
    name = type(module).__name__
    if name in GATED_NORMS:
        return getattr(module, "activation", None) == "silu"
    if name in SWIGLU_MLPS:
        return module.config.hidden_act in ("silu", "swish")
    # Only the norms over the hidden size. fla's norm autotunes per number of 2048-row blocks; the attention's per-head
    # q/k norms have tokens x heads rows, so nearly every new batch size is a new key and autotunes again inside a
    # worker's jobs (seconds each). Left to Transformers they cost little.
    return name in ZERO_CENTRED_NORMS and module.weight.numel() == hidden_size


@contextlib.contextmanager
def fused_kernels(model: torch.nn.Module) -> Iterator[Counter]:
    """Inside the block `model` runs fla's kernels where it has the layers above; yields what was replaced, by class.

    Norms and MLPs are replaced on this model's modules only. The short convolution is a function of the
    Transformers modeling module, so other models of the same architecture in this process share it while the
    block lasts (it is left alone where causal-conv1d is installed: Transformers already uses that). A no-op where
    `usable` is false.
    """
    replaced: Counter = Counter()
    if not usable(model):
        yield replaced
        return
    from transformers.utils import is_causal_conv1d_available

    forwards, short_convolution = _replacements()
    hidden_size = model.config.get_text_config().hidden_size
    modules = [m for m in model.modules() if type(m).__name__ in forwards and _replaceable(m, hidden_size)]
    for module in modules:
        module.forward = types.MethodType(forwards[type(module).__name__], module)
        replaced[type(module).__name__] += 1
    modeling = {sys.modules[type(m).__module__] for m in modules}
    convolutions = {} if is_causal_conv1d_available() else {
        m: m.causal_conv1d_fn for m in modeling if hasattr(m, "causal_conv1d_fn")
    }
    for m in convolutions:
        m.causal_conv1d_fn = short_convolution
        replaced[f"{m.__name__.rsplit('.', 1)[-1]}.causal_conv1d_fn"] += 1
    log.info("fla kernels in use: %s", dict(replaced) or "none (no Qwen3.5/3.6 or Qwen3-Next layers)")
    try:
        yield replaced
    finally:
        for module in modules:
            del module.forward  # the class's forward again
        for m, original in convolutions.items():
            m.causal_conv1d_fn = original
