"""The host a benchmark ran on, beyond its GPU's name: the same GPU model on another host can run a launch-bound
step markedly slower, CPU-only work beside it too (benchmarks/RESULTS.md), so reports name the CPU too."""

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
