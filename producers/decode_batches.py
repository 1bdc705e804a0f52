"""How a respond() call's prompts are cut into decode batches: consecutive runs of the length-sorted prompts that cost
the least in all.

Why: every row of a batch is padded to its longest prompt, and every decode step reads each row's whole cache (longest
prompt + max_new_tokens columns). Filling each batch up to the KV budget, longest first, put a few long multi-turn
histories and hundreds of short ones in one batch, and that batch took a large share of the run
(docs/performance.md). Each extra batch costs too (its decode steps' fixed work, a graph capture, a prompt forward), so the
cut is a trade-off: a batch of R rows whose longest prompt is L costs `fixed + R x (L + max_new_tokens)` cached tokens
(defaults.REGENERATE_BATCH_FIXED_TOKENS), and the plan minimizing the sum over batches is found exactly by dynamic
programming over the sorted prompts.
"""

from __future__ import annotations

import numpy as np


def plan(lengths: list[int], new_tokens: int, budget: int, max_rows: int, fixed: int) -> list[tuple[int, int]]:
    """[start, end) runs of `lengths` (sorted longest first) that cover them in order, each within `max_rows` rows and
    `budget` cached tokens (rows x (longest + new_tokens); a lone prompt always goes), of least total cost."""
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("lengths must be sorted longest first")
    count = len(lengths)
    width = np.asarray(lengths, dtype=np.float64) + new_tokens  # [n]: a batch starting at i is this wide
    best = np.full(count + 1, np.inf)  # [n + 1]: least cost of the first j prompts
    best[0] = 0.0
    start = [0] * (count + 1)  # where the last batch of that least-cost plan starts
    for end in range(1, count + 1):
        first = max(0, end - max_rows)
        rows = np.arange(end - first, 0, -1)  # [k]: rows if the batch starts at first + k
        cached = rows * width[first:end]  # [k]
        cost = best[first:end] + fixed + cached  # [k]
        cost[:-1][cached[:-1] > budget] = np.inf  # within the budget; a lone prompt (the last) always goes
        at = int(np.argmin(cost))
        best[end] = cost[at]
        start[end] = first + at
    runs = []
    end = count
    while end:
        runs.append((start[end], end))
        end = start[end]
    return runs[::-1]
