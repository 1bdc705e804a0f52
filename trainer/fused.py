"""Memory-bound regions of a GPU training step compiled into single kernels; everywhere else the eager code runs.

Why: at small hidden sizes, and in the loss at any size, a step's time after attention went to chains of
elementwise kernels over the same tensor (fp32 norms, rotations, SwiGLU; the head's softmax gradient over [rows, V]).
Inference keeps the eager code: `draft` sees a new context length every call, and eval is short.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def fused(fn: Callable, x: Tensor, training: bool) -> Callable:
    """`fn` itself, or compiled when it runs on the GPU in training (x: a tensor it reads)."""
    return compiled(fn) if x.is_cuda and training else fn
