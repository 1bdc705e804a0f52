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
from torch._inductor import config as inductor_config


# Inductor's mix-order reduction (one kernel for a norm backward's row and column reductions) is chosen by tensor
# size, which guards every compiled region on its rows: the SmolLM2 drafter's layer recompiled at 5 and at 14 rows
# of a micro-batch (H200, torch 2.11, benchmarks/train.py --lengths chat); past Dynamo's limit of 8 compilations a
# region runs eager. The non-strict mode skips the size test, so no guard.
_OPTIONS = ({"triton.mix_order_reduction_non_strict_mode": True}
            if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode") else {})


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, options=_OPTIONS)


def fused(fn: Callable, x: Tensor, training: bool) -> Callable:
    """`fn` itself, or compiled when it runs on the GPU in training (x: a tensor it reads); inside a region being
    compiled (a drafter layer) `fn` itself, which that region's compilation takes in."""
    return compiled(fn) if x.is_cuda and training and not torch.compiler.is_compiling() else fn
