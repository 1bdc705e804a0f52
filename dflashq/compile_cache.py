"""Compiled kernels and autotuning results kept with the run, so a restarted worker or trainer reuses them.

torch.compile (Inductor's FX-graph and AOTAutograd caches: the trainer's flex_attention) and Triton (compiled
kernels, and with TRITON_CACHE_AUTOTUNING the autotuner's choices: flash-linear-attention's kernels in the workers)
cache on disk under /tmp by default, which a new container or machine lacks, and Triton keeps autotuning results
in memory only. Pointing them at `<store>/<run>/compile-cache/` makes a warm restart skip both. Both caches write an
entry under a temporary name and rename it, so the host's workers and trainer ranks share the folder safely; their
keys include the GPU, driver, torch and Triton versions, so on a shared file system each host finds only what fits
it. A user's own TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / TRITON_CACHE_AUTOTUNING are kept.
"""

from __future__ import annotations

import os

from dflashq.store import Store

FOLDER = "compile-cache"


def use_run_cache(store: Store) -> str | None:
    """Set the cache environment for this process and its children (call before importing kernels or compiling);
    returns the folder, or None for a remote store (the caches stay on local disk)."""
    if store.remote:
        return None
    root = store.path(FOLDER)
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return root
