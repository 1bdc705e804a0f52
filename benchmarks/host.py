"""The host a benchmark ran on, beyond its GPU's name: the same GPU model on another host ran the launch-bound
SmolLM2 drafter step 30% slower, with the worker's CPU-only blob encode 28% slower beside it (README, the ninth
quality run), so reports name the CPU too."""

from __future__ import annotations

import os
import platform


def cpu() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count()}
