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

from dflashq import compat

_OPTIONS = compat.inductor_options()


# (tensor, its dims that change between calls), for tensors among a region's arguments (None: an absent one)
Varying = Callable[..., Iterable[tuple[Tensor | None, Sequence[int]]]]


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
    """Dynamo compiles a region static first, then again each time a size first changes (automatic dynamic shapes),
    which in a real run added up to minutes of recompiles. Sizes that change from one micro-batch to the next (rows,
    context length), marked dynamic on the tensors passed in before the first call, are symbolic from the first
    compilation; an int the region needs (a length) is computed inside it from these tensors' sizes."""
    for value, dims in varying(*args):
        if isinstance(value, Tensor):
            torch._dynamo.maybe_mark_dynamic(value, list(dims))
    yield


def fused(fn: Callable, x: Tensor, training: bool, varying: Varying | None = None) -> Callable:
    """`fn` itself, or compiled when it runs on the GPU in training (x: a tensor it reads; varying(*args): the
    arguments' sizes that change between calls, as (tensor, dims) pairs); inside a region being compiled (a drafter
    layer) `fn` itself, which that region's compilation takes in."""
    return compiled(fn, varying) if x.is_cuda and training and not torch.compiler.is_compiling() else fn
