"""How a quality run's drafter does on records it trained on against prompts it never saw, by one measure: the
offline EAL of `dflashq eval --blobs` (the training metric, anchors drawn as in training) on --samples of the run's
regenerated records spread evenly over its data, and on the MT-Bench and HumanEval prompts its eval answered, each
with the target's own greedy answer from the eval's shard files as the assistant turn. Beside each held-out set: the
tau the eval measured on the same prompts. A training EAL far above the held-out one is the drafter memorizing; a
held-out EAL far from tau is the metric misreading decoding.

--logged-steps N checks the training curve itself: the chunks of the train log's last N steps, packed again from
the run's data as the producer packs them and extracted here, measured the same way, beside the accuracy and EAL
the trainer logged for them (on the GPU, with its own extraction and compiled forward).

Runs after benchmarks/quality.py's eval phase, on its --work folder, on any device (the target and drafter are small).
Usage: python benchmarks/generalization.py --work DIR [--samples 164] [--logged-steps 0] [--anchors N] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.quality import eval_prompt_sets, shard_rows  # noqa: E402
from dflashq import settings as settings_module  # noqa: E402
from dflashq.blob import decode_blob, encode_blob  # noqa: E402
from dflashq.capture import HiddenStateCapture  # noqa: E402
from dflashq.chunk import Sample, pack, sample_range  # noqa: E402
from dflashq.target import load_target  # noqa: E402
from producers.loss_mask import end_of_turn_marker  # noqa: E402
from producers.produce import tokenized  # noqa: E402
from producers.tokenize import load_tokenizer, tokenize_record  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.evaluate import evaluate_blobs  # noqa: E402
from trainer.export import export_path, load_exported  # noqa: E402
from trainer.target_head import TargetHead  # noqa: E402


def trained_records(path: str, samples: int) -> list[dict]:
    """`samples` records spread evenly over the data file: its first ones alone are no fair sample (benchmarks/RESULTS.md)."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    picked = np.linspace(0, len(lines) - 1, min(samples, len(lines))).round().astype(int)
    return [json.loads(lines[i]) for i in picked]


def held_out_records(work: Path, samples: int, marker: str) -> dict[str, tuple[list[dict], list[float]]]:
    """Per benchmark: its first `samples` prompts answered by the eval, as one-exchange records (the answer cut at the
    end-of-turn marker the target emitted, which the template writes itself), and the tau measured on each."""
    rows = {}
    for shard in sorted((work / "eval").glob("shard-*.jsonl")):
        rows.update(shard_rows(shard))
    sets = {}
    for name, prompts in eval_prompt_sets(samples).items():
        done = [(prompt, rows[(name, i)]["dflashq"]) for i, prompt in enumerate(prompts) if (name, i) in rows]
        records = [{"messages": [{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": result["text"].split(marker)[0]}]}
                   for prompt, result in done]
        sets[name] = (records, [result["tau"] for _, result in done])
    return sets


class Measure:
    """The target's tapped states for samples, as a worker stores them, and the drafter's offline metrics on them."""

    def __init__(self, settings, drafter_dir: Path, anchors: int, device: str):
        self.drafter = load_exported(drafter_dir, device)
        dtype = next(self.drafter.parameters()).dtype
        self.head = TargetHead.from_pretrained(settings.model.path, dtype=dtype, device=device)
        self.target = load_target(settings.model.path, device)
        self.layer_ids = list(self.drafter.config.target_layer_ids)
        self.anchors, self.device = anchors, device

    def __call__(self, samples: list[Sample], name: str) -> dict:
        capture = HiddenStateCapture(self.target, self.layer_ids)
        hidden = [capture.capture(torch.from_numpy(s.input_ids.astype(np.int64))[None].to(self.device))[0].cpu()
                  for s in samples]  # [T, K, H] each
        capture.close()
        offsets = np.cumsum([0] + [len(s) for s in samples]).tolist()
        meta = {"run": "generalization", "chunk_id": name, "epoch": 0, "layer_ids": self.layer_ids}
        blob = decode_blob(b"".join(bytes(b) for b in encode_blob(
            torch.cat(hidden), torch.from_numpy(np.concatenate([s.input_ids for s in samples])),
            torch.from_numpy(np.concatenate([s.loss_mask for s in samples])), offsets, meta)))
        return evaluate_blobs(self.drafter, self.head, [blob], self.anchors)


def logged_chunks(settings, steps: int) -> list[tuple[dict, list[Sample]]]:
    """Of the train log's last `steps` steps those of one chunk, each with that chunk's samples packed again from the
    data (every epoch packs alike)."""
    log = [json.loads(line) for line in Path(settings.store.path, settings.run, settings.train.log_file).read_text().splitlines()]
    last = [r for r in log if "acc" in r][-steps:]
    wanted = {sample_range(r["chunks"][0]): r for r in last if len(r["chunks"]) == 1}
    samples = (Sample(result.input_ids, result.loss_mask, index)
               for index, _, result in tokenized(settings) if result.kept)
    found = []
    for group in pack(samples, settings.data.chunk_tokens, settings.data.sort_window):
        record = wanted.get((group[0].index, group[-1].index))
        if record:
            found.append((record, group))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="benchmarks/quality.py's working folder, its eval done")
    parser.add_argument("--samples", type=int, default=164, help="records of each set")
    parser.add_argument("--logged-steps", type=int, default=0, help="the train log's last steps to measure again")
    parser.add_argument("--anchors", type=int, default=None, help="anchors per sample [the run's train.num_anchors]")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    settings = settings_module.load(work / "run.toml")
    runs = Path(settings.store.path) / settings.run
    drafter_dir = export_path(checkpoint.latest(runs / "checkpoints"))
    anchors = args.anchors or settings.train.num_anchors
    measure = Measure(settings, drafter_dir, anchors, args.device)
    tokenizer = load_tokenizer(settings.model.path)
    sets = {"trained": (trained_records(settings.data.paths[0], args.samples), None),
            **held_out_records(work, args.samples, end_of_turn_marker(tokenizer))}
    report = {"benchmark": "generalization", "drafter": drafter_dir.name, "anchors": anchors, "device": args.device}
    for name, (records, taus) in sets.items():
        kept = [tokenize_record(tokenizer, record, settings.data.max_length) for record in records]
        result = measure([Sample(r.input_ids, r.loss_mask) for r in kept if r.kept], name)
        report[name] = {"samples": result["samples"], "offline_eal": round(result["eal"], 3),
                        "loss": round(result["loss"], 3), "acc": [round(a, 3) for a in result["acc"]],
                        **({"tau": round(sum(taus) / len(taus), 3)} if taus else {})}
        print(f"{name}: {json.dumps(report[name])}", file=sys.stderr, flush=True)
    if args.logged_steps:
        steps = [{"step": record["step"], "logged_eal": round(record["eal"], 3),
                  "measured_eal": round(measure(group, record["chunks"][0])["eal"], 3)}
                 for record, group in sorted(logged_chunks(settings, args.logged_steps), key=lambda found: found[0]["step"])]
        report["logged_steps"] = {"steps": steps, "logged_eal": round(float(np.mean([s["logged_eal"] for s in steps])), 3),
                                  "measured_eal": round(float(np.mean([s["measured_eal"] for s in steps])), 3)}
        print(f"logged steps: {json.dumps(report['logged_steps'])}", file=sys.stderr, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
