"""Tau against trained tokens over the quality benchmark's recorded runs (benchmarks/results/quality-*.json), with a
power-law fit of tau - 1 per benchmark over the runs of one recipe (learning rate, anchors), and what the fit asks
for the quality benchmark's bar: the trained tokens for tau 2.5 on MT-Bench and 3.0 on HumanEval, and the GPU-minutes they take
at the trainer's measured rate. Writes a PNG and prints one JSON line.

Only like is compared with like: drafters trained on bf16 blobs, tau on the first 24 prompts of each set (every run
measured those) in bf16 on the GPU.
Usage: python benchmarks/tau_scaling.py [--results benchmarks/results] [--png FILE] [--learning-rate 6e-4] [--anchors 512]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from matplotlib.figure import Figure

GOALS = {"mt_bench": 2.5, "humaneval": 3.0}
PROMPTS = 24
MIN_SPREAD = 2.0  # the fewest-to-most trained tokens a fit needs across its runs


def flag(command: str, name: str, default: float) -> float:
    found = re.search(rf"--{name} (\S+)", command)
    return float(found.group(1)) if found else default


def runs(results: Path) -> list[dict]:
    """One row per trained drafter: its label, learning rate, trained tokens, seconds of `up`, tau per benchmark on
    the first PROMPTS prompts (None where it was not measured on the GPU for all of them)."""
    rows = []
    for path in sorted(results.glob("quality-*.json")):
        record = json.loads(path.read_text())
        command = record.get("command", "")
        # the codec comparison holds two runs of one command; the others are a run each
        for label, run in (record["runs"].items() if "runs" in record else [(None, record)]):
            up, evaluated = run.get("up"), run.get("eval") or run.get("eval_partial") or {}
            if not up or (label or record.get("codec", "bf16")) != "bf16":  # drafters trained on bf16 blobs
                continue
            taus = {}
            for name in GOALS:
                e = evaluated.get(name) or {}
                if e.get("reference_prompts") == PROMPTS:
                    taus[name] = e["dflashq_tau_on_those"]
                elif e.get("prompts") == PROMPTS:
                    taus[name] = e["dflashq_tau"]
            # runs before the recipe was recorded: the command's flags, else the defaults of their day
            recipe = record.get("train") or {"learning_rate": flag(command, "learning-rate", 6e-4),
                                             "num_anchors": flag(command, "anchors", 512), "epochs": flag(command, "epochs", 2)}
            rows.append({
                "run": path.stem.removeprefix("quality-") + (f"-{label}" if label else ""),
                "learning_rate": recipe["learning_rate"], "anchors": int(recipe["num_anchors"]),
                "trained_tokens": up["tokens_extracted"] * recipe["epochs"],  # retention keep: extracted once
                "up_seconds": up["seconds"], **taus})
    return rows


def run_order(row: dict) -> tuple[str, str]:
    """Runs by the date in their name, whatever card comes before it (quality-smollm2-h100-2026-12-06-run10)."""
    dated = re.search(r"\d{4}-\d\d-\d\d.*", row["run"])
    return (dated.group() if dated else "", row["run"])


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of log(tau - 1) on log(tokens): tau = 1 + exp(a) * tokens ** b."""
    xs, ys = [math.log(t) for t, _ in points], [math.log(tau - 1) for _, tau in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--png", default="tau-scaling.png")
    parser.add_argument("--learning-rate", type=float, default=6e-4, help="the runs the fit is drawn through")
    parser.add_argument("--anchors", type=int, default=512, help="... and their train.num_anchors")
    args = parser.parse_args()
    rows = runs(Path(args.results))
    fitted = [r for r in rows if math.isclose(r["learning_rate"], args.learning_rate) and r["anchors"] == args.anchors]
    # the trainer's rate in the newest fitted run: seconds of `up` per trained token
    newest = max(fitted, key=run_order)
    seconds_per_token = newest["up_seconds"] / newest["trained_tokens"]
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    summary = {}
    for name, goal in GOALS.items():
        points = [(r["trained_tokens"], r[name]) for r in fitted if r.get(name)]
        line = axes.plot([t / 1e6 for t, _ in points], [tau for _, tau in points], "o",
                         label=f"{name} (lr {args.learning_rate:g}, {args.anchors} anchors)")[0]
        tokens = [t for t, _ in points]
        if max(tokens) < MIN_SPREAD * min(tokens):
            # runs that trained about as many tokens differ in what else changed (data, schedule): no slope to read
            summary[name] = {"runs": len(points), "fit": f"none: the runs trained {min(tokens) / 1e6:.1f}-"
                                                         f"{max(tokens) / 1e6:.1f} M tokens, less than {MIN_SPREAD}x apart"}
        else:
            a, b = fit(points)
            needed = math.exp((math.log(goal - 1) - a) / b)
            summary[name] = {"runs": len(points), "exponent": round(b, 3), "goal": goal,
                             "tokens_for_goal_m": round(needed / 1e6, 1),
                             "up_minutes_for_goal": round(needed * seconds_per_token / 60, 1)}
            grid = [10 ** (6 + 2.2 * i / 100) for i in range(101)]
            axes.plot([t / 1e6 for t in grid], [1 + math.exp(a) * t ** b for t in grid], "--", color=line.get_color(), alpha=0.6)
        axes.axhline(goal, color=line.get_color(), linestyle=":", alpha=0.6)
        others = [(r["trained_tokens"] / 1e6, r[name]) for r in rows if r.get(name) and r not in fitted]
        if others:
            axes.plot(*zip(*others), "x", color=line.get_color(), label=f"{name}, other recipes")
    axes.set_xscale("log")
    axes.set_xlabel("trained tokens (millions)")
    axes.set_ylabel(f"tau (first {PROMPTS} prompts)")
    axes.set_title("SmolLM2-135M drafter: tau against trained tokens, power-law fit of tau - 1")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.png, dpi=120)
    print(json.dumps({"benchmark": "tau_scaling", "runs": rows, "seconds_per_trained_token": seconds_per_token,
                      "fit": summary, "png": args.png}))


if __name__ == "__main__":
    main()
