"""What the installed torch and Transformers offer, asked in one place: pyproject.toml allows a range of each, and
the code that needs a feature calls here instead of testing versions or attributes where it stands. Each check
names the release that changed what it looks for; torch and Transformers are imported only when a check runs."""

from __future__ import annotations

import dataclasses
import functools
import inspect


def inductor_options() -> dict:
    """Options of every compiled region. Inductor's mix-order reduction (one kernel for a norm backward's row and
    column reductions) is chosen by tensor size, which guards a compiled region on its rows and recompiles it as
    the rows change; its non-strict mode (newer torch) skips the size test, so no guard."""
    from torch._inductor import config

    return ({"triton.mix_order_reduction_non_strict_mode": True}
            if hasattr(config.triton, "mix_order_reduction_non_strict_mode") else {})


def launch_stop_grace(seconds: float) -> dict:
    """LaunchConfig's field for how long ranks asked to stop may take (newer torch; torch 2.11 has none, and its
    launcher's own default applies)."""
    from torch.distributed.launcher.api import LaunchConfig

    return {"shutdown_timeout": seconds} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The forward keyword (and output field) of a Transformers model's KV cache: Transformers 5.24 renamed
    `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_croppable(cache) -> bool:
    """Whether a Transformers cache can be rolled back by crop(). `is_croppable` exists from Transformers 5.17;
    before it, linear-attention layers are the ones crop() refuses. From 5.25 it also says yes for layers that could
    record their past states, yet crop() refuses them unless recording was switched on: a layer with `record_past`
    False cannot be cropped now."""
    croppable = getattr(cache, "is_croppable", None)
    if croppable is None:
        return not any(cache.is_linear)
    return croppable and not any(getattr(layer, "record_past", None) is False for layer in cache.layers)
