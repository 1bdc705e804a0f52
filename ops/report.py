"""`dflashq report`: one PNG of a run's curves, from the trainer's JSONL log and the results stream.

Panels: training loss and EAL per step, per-slot accuracy of the last steps, training throughput, extraction
throughput (tokens of announced blobs per second, binned over the stream entries' timestamps) and a summary.
A panel without data says so, so the report works from the first minute of a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend or state, renders with Agg

from dflashq.run import Run

LAST_STEPS = 20  # steps averaged in the per-slot accuracy panel
SMOOTH_POINTS = 50  # curves are smoothed over about 1/SMOOTH_POINTS of their length
BINS = 60  # extraction throughput bins over the stream's time span
XRANGE_PAGE = 10_000


def read_train_log(run: Run) -> list[dict]:
    """The step records of the trainer log, one per step (a step re-run after a resume keeps its latest record)."""
    path = run.store.path(run.settings.train.log_file)
    if not run.store.exists(path):
        return []
    steps = {}
    for line in run.store.read(path).decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash mid-write
            continue
        if isinstance(record, dict) and "step" in record and "event" not in record:
            steps[record["step"]] = record
    return [steps[s] for s in sorted(steps)]


def read_extractions(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Seconds since the epoch and tokens of every announced blob in the results stream."""
    times, tokens = [], []
    start = "-"
    while True:
        entries = run.conn.xrange(run.keys.results, min=start, max="+", count=XRANGE_PAGE)
        for entry_id, fields in entries:
            times.append(int(entry_id.split(b"-")[0]) / 1000)
            tokens.append(int(fields[b"tokens"]))
        if len(entries) < XRANGE_PAGE:
            return np.array(times, dtype=float), np.array(tokens, dtype=float)
        start = b"(" + entries[-1][0]  # exclusive: after the last entry read


def _moving_average(values: np.ndarray) -> np.ndarray:
    window = max(1, len(values) // SMOOTH_POINTS)
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _no_data(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _curve(ax, title: str, steps: np.ndarray, values: np.ndarray) -> None:
    ax.set_title(title)
    ax.plot(steps, values, alpha=0.3, color="C0")
    smooth = _moving_average(values)
    ax.plot(steps[len(steps) - len(smooth):], smooth, color="C0")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def step_time_medians(records: list[dict]) -> dict[str, float]:
    """Where a step's wall time goes, as the trainer logs it (between steps, reading blobs, computing): the median
    seconds of each part over the steps that record it (none before the trainer logged them)."""
    timed = [r["seconds"] for r in records if "seconds" in r]
    return {part: float(np.median([t[part] for t in timed])) for part in timed[0]} if timed else {}


def write_report(run: Run, out_png: str | Path) -> Path:
    """Write the run's report PNG to `out_png` and return its path."""
    records = read_train_log(run)
    ext_times, ext_tokens = read_extractions(run)
    fig = Figure(figsize=(14, 12), layout="constrained")
    fig.suptitle(f"dflashq run '{run.settings.run}'")
    (loss_ax, eal_ax), (acc_ax, train_ax), (ext_ax, text_ax) = fig.subplots(3, 2)

    train_times = np.array([r["time"] for r in records], dtype=float)
    starts = [t[0] for t in (train_times, ext_times) if len(t)]
    t0 = min(starts) if starts else 0.0  # both throughput panels share one clock: minutes since the run's start

    if records:
        steps = np.array([r["step"] for r in records])
        _curve(loss_ax, "training loss", steps, np.array([r["loss"] for r in records], dtype=float))
        _curve(eal_ax, "expected acceptance length (EAL)", steps, np.array([r["eal"] for r in records], dtype=float))
        acc = np.array([r["acc"] for r in records[-LAST_STEPS:]], dtype=float).mean(axis=0)
        slots = np.arange(1, len(acc) + 1)
        acc_ax.bar(slots, acc)
        acc_ax.set(xticks=slots, title=f"accuracy per draft slot (last {min(LAST_STEPS, len(records))} steps)", xlabel="slot",
                   ylim=(0, 1))
    else:
        for ax, title in ((loss_ax, "training loss"), (eal_ax, "expected acceptance length (EAL)"),
                          (acc_ax, "accuracy per draft slot")):
            _no_data(ax, title)

    if len(records) >= 2:
        # tokens trained between step i-window and step i over the wall time between them
        window = max(1, len(records) // SMOOTH_POINTS)
        cumulative = np.cumsum([r["tokens"] for r in records], dtype=float)
        elapsed = np.maximum(train_times[window:] - train_times[:-window], 1e-9)
        train_ax.plot((train_times[window:] - t0) / 60, (cumulative[window:] - cumulative[:-window]) / elapsed)
        train_ax.set(title="training throughput", xlabel="minutes since start", ylabel="tokens/s")
        train_ax.grid(alpha=0.3)
    else:
        _no_data(train_ax, "training throughput")

    if len(ext_times):
        span = max(ext_times[-1] - ext_times[0], 1.0)
        edges = ext_times[0] + np.linspace(0, span, BINS + 1)
        sums, _ = np.histogram(ext_times, bins=edges, weights=ext_tokens)
        ext_ax.stairs(sums / (span / BINS), (edges - t0) / 60, fill=True, alpha=0.6)
        ext_ax.set(title="extraction throughput (all workers)", xlabel="minutes since start", ylabel="tokens/s")
        ext_ax.grid(alpha=0.3)
    else:
        _no_data(ext_ax, "extraction throughput")

    lines = [f"chunks extracted: {len(ext_times):,}", f"tokens extracted: {int(ext_tokens.sum()):,}",
             f"training steps: {len(records):,}"]
    if records:
        last = records[-1]
        lines += [f"epoch: {last['epoch']}", f"last loss: {last['loss']:.4f}", f"last EAL: {last['eal']:.3f}",
                  f"tokens trained: {int(sum(r['tokens'] for r in records)):,}"]
        medians = step_time_medians(records)
        if medians:
            lines.append("median step s: " + ", ".join(f"{part} {v:.3f}" for part, v in medians.items()))
    text_ax.axis("off")
    text_ax.set_title("summary")
    text_ax.text(0.05, 0.95, "\n".join(lines), va="top", family="monospace", transform=text_ax.transAxes)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
