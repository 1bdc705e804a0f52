"""Memory-bound regions of a GPU training step compiled into single kernels; everywhere else the eager code runs.

Why: at small hidden sizes, and in the loss at any size, a step's time after attention went to chains of
elementwise kernels over the same tensor (fp32 norms, rotations, SwiGLU; the head's softmax gradient over [rows, V]).
Inference keeps the eager code: `draft` sees a new context length every call, and eval is short.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch._inductor import config as inductor_config


# Inductor's mix-order reduction (one kernel for a norm backward's row and column reductions) is chosen by tensor
# size, which guards every compiled region on a micro-batch's rows, so a small drafter's layer recompiled as its rows
# changed (docs/performance.md); past Dynamo's limit of 8 compilations a region runs eager. The non-strict mode
# skips the size test, so no guard.
_OPTIONS = ({"triton.mix_order_reduction_non_strict_mode": True}
            if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode") else {})


# (tensor, its dims that change between calls), or (the Dynamo source name of an int argument, ())
Varying = Callable[..., Iterable[tuple[Tensor | str | None, Sequence[int]]]]


@functools.cache
def compiled(fn: Callable, varying: Varying | None = None) -> Callable:
    region = torch.compile(fn, options=_OPTIONS)
    if varying is None:
        return region

    def call(*args):
        with varying_sizes(varying, args):
            return region(*args)

    return call


@contextlib.contextmanager
def varying_sizes(varying: Varying, args: tuple):
    """Dynamo compiles a region static first, then again each time a size first changes (automatic dynamic shapes):
    a real run's log showed 11 recompiles, 75 s. Sizes that change from one micro-batch to the next (rows, context
    length), marked dynamic before the first call, are symbolic from the first compilation: tensors' dims marked here,
    ints named in torch.compiler.config.dynamic_sources while the region runs (where torch has it)."""
    ints = []
    for value, dims in varying(*args):
        if isinstance(value, Tensor):
            torch._dynamo.maybe_mark_dynamic(value, list(dims))
        elif isinstance(value, str) and hasattr(torch.compiler.config, "dynamic_sources"):
            ints.append(value)
    with torch.compiler.config.patch(dynamic_sources=",".join(ints)) if ints else contextlib.nullcontext():
        yield


def fused(fn: Callable, x: Tensor, training: bool, varying: Varying | None = None) -> Callable:
    """`fn` itself, or compiled when it runs on the GPU in training (x: a tensor it reads; varying(*args): the
    arguments' sizes that change between calls, as (tensor, dims) pairs); inside a region being compiled (a drafter
    layer) `fn` itself, which that region's compilation takes in."""
    return compiled(fn, varying) if x.is_cuda and training and not torch.compiler.is_compiling() else fn
