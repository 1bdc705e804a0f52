"""Extraction throughput on one GPU: bare forward vs the worker's real path, with MFU and bytes per token.

A random-initialised Qwen3.6-27B-shaped text model (64 layers, every 4th full attention, H 5120, intermediate
17408, vocab 248320, 24/4 heads of 256, linear attention 16 key / 48 value heads of 128), tapping
[1, 16, 31, 46, 61] (z-lab convention). Chunks of `--chunk-tokens` tokens made of samples with random lengths in
[--min-len, --max-len], right-padded, length-sorted micro-batches of at most `--batch-tokens` padded tokens.

Measured, on the same chunks, in one run:
  matmul   bf16 8192^3 matrix products: the ceiling MFU is computed against
  plain    Transformers as shipped: the decoder forward of all layers with an attention mask (no hooks, no logits)
  bare     the same forward as the worker runs it: fla's fused kernels (workers/fused_kernels.py), no mask
  any rows the bare forward with samples batched greedily, any row count, instead of the worker's power-of-two row
           buckets (what the bucketing costs or saves; padding_fraction_any_row_count beside padding_fraction)
  capture  the worker's hook capture that stops after the deepest tapped layer (no copy, no write)
  e2e      workers.extract.Extractor.run: capture + byte-shuffle + copy to pinned memory + zstd + fsynced write +
           announce on the results stream of a real Redis (private redis-server), until every blob is announced;
           also its steady state, from the first to the last announcement (a long-lived worker drains only once)
  codecs   both blob codecs (bf16, fp8) on one core each over the verified samples' plain states: bytes per token,
           encode / decode throughput, relative error (as benchmarks/codec.py on a real model's states)
  verify   `dflashq verify`'s comparison of --verify-samples stored samples with a plain, unbatched forward, and
           their error against the same forward in float32: the benchmark exits 1 if a stored layer is all-zero or
           non-finite, or is further from float32 than plain Transformers in the model's dtype (by over 10%, and
           beyond verify's tolerance)
Usage: python benchmarks/extract.py [--tiny] [--chunks 10] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflashq import settings as settings_module  # noqa: E402
from dflashq.chunk import Chunk, Sample, micro_batches, pack, padding_fraction  # noqa: E402
from dflashq.run import Run  # noqa: E402
from ops.redis_server import EmbeddedRedis  # noqa: E402
from dflashq.capture import HiddenStateCapture, decoder_layers  # noqa: E402
from workers.capture import PAD_MULTIPLE, extraction_batches, padded_batches  # noqa: E402
from workers.extract import Extractor  # noqa: E402
from workers.fused_kernels import fused_kernels  # noqa: E402
from dflashq.blob import CODEC_RELATIVE_ERROR  # noqa: E402
from workers.verify import TOLERANCE, pick_stored, reference_hidden, verify_samples  # noqa: E402
from dflashq.target import block_unusable_kernels  # noqa: E402
from benchmarks.codec import both_codecs  # noqa: E402

QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4)


def qwen35_text_config(shape: dict):
    """A Qwen3.5/3.6 text model config of `shape`, every 4th layer full attention as in the released models."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape["num_hidden_layers"])]
    return Qwen3_5TextConfig(**shape, layer_types=layer_types, max_position_embeddings=32768)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def make_chunks(n, chunk_tokens, min_len, max_len, vocab, sort_window, seed=0):
    """About n chunks packed the way the producer packs them (dflashq.chunk.pack) from random-length samples."""
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < n * chunk_tokens:
        length = int(rng.integers(min_len, max_len + 1))
        samples.append(Sample(rng.integers(0, vocab, length).astype(np.int32), np.ones(length, np.uint8), len(samples)))
        total += length
    groups = list(pack(samples, chunk_tokens, sort_window))[:n]
    return [Chunk(f"bench-e0-{c:06d}", 0, group) for c, group in enumerate(groups)]


def model_flops(model, chunks, deepest: int | None, config) -> float:
    """2 * parameters * tokens over the decoder layers that run, plus causal attention of full-attention layers
    (linear-attention recurrences, norms and activations are not counted)."""
    layers = decoder_layers(model)
    ran = range(len(layers) if deepest is None else deepest + 1)
    params = sum(p.numel() for i in ran for p in layers[i].parameters())
    full = sum(1 for i in ran if config.layer_types[i] == "full_attention")
    flops = 0.0
    for chunk in chunks:
        for s in chunk.samples:
            t = len(s)
            flops += 2 * params * t + full * 2 * 2 * config.num_attention_heads * config.head_dim * t * (t + 1) / 2
    return flops


def timed(device, fn, phase: str, tokens: int):
    """Seconds `fn` takes; each phase is also printed as it ends, so a run cut short still reports what it got."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    seconds = time.perf_counter() - start
    print(f"{phase}: {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s", file=sys.stderr, flush=True)
    return seconds


def print_profile(device, fn, rows=30) -> None:
    """The operators and kernels that take the most time in `fn`: where a forward's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=rows), file=sys.stderr, flush=True)


def float32_reference(model, layer_ids, samples) -> list[torch.Tensor]:
    """Each sample's tapped states [T, K, H] from `model` converted to float32 in place (layer by layer, so the GPU
    never holds both copies), with Transformers' torch linear-attention code: fla's kernels multiply in tf32."""
    layers = decoder_layers(model)
    for module in [*layers, model]:
        module.float()
        if next(model.parameters()).is_cuda:
            torch.cuda.empty_cache()
    modeling = sys.modules[type(layers[0]).__module__]
    rule = getattr(modeling, "torch_chunk_gated_delta_rule", None)
    if rule is not None:
        modeling.torch_chunk_gated_delta_rule = getattr(rule, "__wrapped__", rule)
    try:
        return [reference_hidden(model, layer_ids, s.input_ids).float() for s in samples]
    finally:
        if rule is not None:
            modeling.torch_chunk_gated_delta_rule = rule


def mean_relative_error(states, reference) -> list[float]:
    """Per tapped layer, the worst sample's mean|state - reference| / mean|reference|."""
    worst = [0.0] * reference[0].shape[1]
    for got, want in zip(states, reference, strict=True):
        got = got.float().to(want.device)
        for k in range(len(worst)):
            error = (got[:, k] - want[:, k]).abs().mean() / want[:, k].abs().mean().clamp_min(1e-30)
            worst[k] = max(worst[k], error.item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script, measures nothing useful)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible, the CPU with --tiny)")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=16384)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--writer-threads", type=int, default=8)
    parser.add_argument("--sort-window", type=int, default=256, help="the producer's data.sort_window (1: dataset order)")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--codec", choices=["bf16", "fp8"], default="bf16", help="store.codec of the blobs")
    parser.add_argument("--verify-samples", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="also print where one bare pass over the first chunk spends its time")
    parser.add_argument("--out", default=None, help="folder for the blobs (default: a temporary folder)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cpu":
        block_unusable_kernels()
    from transformers import AutoModelForCausalLM

    shape = TINY if args.tiny else QWEN36_27B
    config = qwen35_text_config(shape)
    layer_ids = [1, 16, 31, 46, 61] if not args.tiny else [1, 3, 5]
    tmp = Path(args.out or tempfile.mkdtemp(prefix="dflashq-bench-"))
    model_dir = tmp / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)  # the manifest reads the target's depth from config.json; weights stay in memory
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    init_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    ceiling = matmul_tflops(device)
    chunks = make_chunks(args.chunks, args.chunk_tokens, args.min_len if not args.tiny else 16,
                         args.max_len if not args.tiny else 128, shape["vocab_size"], args.sort_window)
    tokens = sum(c.tokens for c in chunks)
    groups = [c.samples for c in chunks]
    padding = padding_fraction(groups, args.batch_tokens, PAD_MULTIPLE, power_of_two_rows=True)
    padding_any_rows = padding_fraction(groups, args.batch_tokens, PAD_MULTIPLE)
    print(f"{len(chunks)} chunks, {tokens:,} tokens, {padding:.1%} padding; matmul {ceiling:.0f} TFLOP/s", file=sys.stderr, flush=True)

    def batches(chunk, masked, batching=extraction_batches):
        for batch, ids in padded_batches(chunk.samples, args.batch_tokens, batching):  # the worker's batches by default
            lengths = torch.tensor([len(chunk.samples[i]) for i in batch])
            mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()  # [B, W], 1 on real tokens
            yield ids.to(device), mask.to(device) if masked else None

    @torch.inference_mode()
    def forward(selected=chunks, masked=False, batching=extraction_batches):
        for chunk in selected:
            for ids, mask in batches(chunk, masked, batching):
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)

    def capture_only():
        for chunk in chunks:
            for ids, _ in batches(chunk, masked=False):
                capture.capture(ids)

    def plain():
        forward(masked=True)

    warmup_s = timed(device, plain, "warm-up", tokens)  # one untimed pass: Triton autotuning and kernel caches for every batch shape
    plain_s = timed(device, plain, "plain", tokens)
    with fused_kernels(model) as replaced:
        timed(device, forward, "warm-up (fused kernels)", tokens)
        bare_s = timed(device, forward, "bare", tokens)

        def any_rows():
            forward(batching=micro_batches)

        timed(device, any_rows, "warm-up (any row count)", tokens)
        any_rows_s = timed(device, any_rows, "bare, any row count", tokens)
        if args.profile:
            print_profile(device, lambda: forward(chunks[:1]))
        capture = HiddenStateCapture(model, layer_ids)  # hooks on: from here on the forward stops after the deepest layer
        capture_s = timed(device, capture_only, "capture", tokens)
        capture.close()

    server = EmbeddedRedis(str(tmp))
    url = server.ensure()
    try:
        settings = settings_module.load(None, [
            ("run", "bench"), ("redis.url", url), ("store.path", str(tmp / "store")), ("model.path", str(model_dir)),
            ("model.layer_ids", ",".join(map(str, layer_ids))), ("data.max_length", args.max_len if not args.tiny else 128),
            ("data.chunk_tokens", args.chunk_tokens), ("workers.batch_tokens", args.batch_tokens),
            ("workers.writer_threads", args.writer_threads), ("workers.compress_level", args.level),
            ("store.codec", args.codec),
        ], environ={})
        run = Run.open(settings)
        extractor = Extractor(run, "bench.gpu0", str(device), model=model)
        extractor.run(chunks[0])  # warm-up: pinned buffers, zstd contexts
        extractor.flush()
        run.conn.delete(run.keys.finished)
        before = run.conn.xlen(run.keys.results)

        def e2e():
            for chunk in chunks:
                extractor.run(chunk)
            extractor.flush()

        e2e_s = timed(device, e2e, "e2e", tokens)
        entries = run.conn.xrange(run.keys.results)[before:]
        announced_ms = [int(entry_id.split(b"-")[0]) for entry_id, _ in entries]
        steady_tokens = sum(int(fields[b"tokens"]) for _, fields in entries[1:])
        steady = steady_tokens / max((announced_ms[-1] - announced_ms[0]) / 1000, 1e-3) if len(entries) > 1 else None
        print(f"e2e steady state: {f'{steady:,.0f} tokens/s' if steady else 'needs 2 chunks'}", file=sys.stderr, flush=True)
        extractor.close()  # the model is plain Transformers again: the reference `dflashq verify` compares with
        stored = sum(int(v) for v in run.conn.hvals(run.keys.blob_bytes))
        announced = run.conn.scard(run.keys.finished)
        samples, stored_states, _, _ = pick_stored(run, args.verify_samples)
        reports, _ = verify_samples(model, layer_ids, samples, stored_states, args.codec)
        plain_states = [reference_hidden(model, layer_ids, s.input_ids) for s in samples]
    finally:
        server.stop()
    broken = any(r.all_zero_samples or r.non_finite for r in reports)
    reference = float32_reference(model, layer_ids, samples)
    stored_error = mean_relative_error(stored_states, reference)
    plain_error = mean_relative_error(plain_states, reference)
    # Both codecs on one core each, on the plain forward's states of the verified samples: bytes per token and
    # throughput at this model's shape (random weights: a trained model's states compress differently, which
    # benchmarks/codec.py measures on a real one)
    codec_states = torch.cat([s.cpu() for s in plain_states])  # [N, K, H]
    codecs = both_codecs(codec_states, args.level, repeats=2)
    # fp8 adds its rounding (at most 2^-4 of a token's max) to whatever error the kernels made
    accurate = all(s <= max(1.1 * p, TOLERANCE[dtype]) + CODEC_RELATIVE_ERROR[args.codec]
                   for s, p in zip(stored_error, plain_error))
    verified = accurate and not broken
    print(f"verify: {'ok' if verified else 'FAILED'}; max|stored - plain| / max|plain| per layer "
          f"{[f'{r.max_rel_diff:.2g}' for r in reports]}; mean relative error against float32: stored "
          f"{[f'{e:.3g}' for e in stored_error]}, plain {[f'{e:.3g}' for e in plain_error]}", file=sys.stderr, flush=True)
    raw_bytes = tokens * len(layer_ids) * config.hidden_size * torch.empty(0, dtype=dtype).element_size()
    bare_flops = model_flops(model, chunks, None, config)
    capture_flops = model_flops(model, chunks, max(layer_ids), config)
    result = {
        "benchmark": "extract",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "model": "tiny qwen3_5" if args.tiny else "Qwen3.6-27B-shaped text model (random init)",
        "params_b": round(params / 1e9, 2),
        "init_seconds": round(init_s, 1), "warmup_seconds": round(warmup_s, 1),
        "chunks": len(chunks), "samples": sum(len(c.samples) for c in chunks), "tokens": tokens,
        "batch_tokens": args.batch_tokens, "sample_lengths": [args.min_len, args.max_len], "sort_window": args.sort_window,
        "padding_fraction": round(padding, 3),
        "matmul_tflops": round(ceiling, 1),
        "plain_tokens_per_s": round(tokens / plain_s),
        "bare_tokens_per_s": round(tokens / bare_s),
        "bare_vs_plain": round(plain_s / bare_s, 3),
        "bare_any_row_count_tokens_per_s": round(tokens / any_rows_s),
        "row_buckets_vs_any_row_count": round(any_rows_s / bare_s, 3),
        "padding_fraction_any_row_count": round(padding_any_rows, 3),
        "capture_tokens_per_s": round(tokens / capture_s),
        "e2e_tokens_per_s": round(tokens / e2e_s),
        "e2e_vs_bare": round(bare_s / e2e_s, 3),
        "e2e_steady_tokens_per_s": round(steady) if steady else None,
        "e2e_steady_vs_bare": round(steady * bare_s / tokens, 3) if steady else None,
        "plain_mfu": round(bare_flops / plain_s / 1e12 / ceiling, 3),
        "bare_mfu": round(bare_flops / bare_s / 1e12 / ceiling, 3),
        "e2e_mfu": round(capture_flops / e2e_s / 1e12 / ceiling, 3),
        "announced_blobs": announced,
        "bytes_per_token": round(stored / tokens),
        "compression_ratio": round(raw_bytes / stored, 3),
        "zstd_level": args.level, "writer_threads": args.writer_threads, "codec": args.codec,
        "codecs_one_core": {"tokens": codec_states.shape[0], **codecs},
        "fla": "fla" in sys.modules and sys.modules["fla"] is not None,
        "fused_kernels": dict(replaced),
        "verify_samples": len(samples), "verify_ok": verified,
        "verify_max_rel_diff": {r.layer_id: float(f"{r.max_rel_diff:.3g}") for r in reports},
        "float32_error_stored": {t: float(f"{e:.3g}") for t, e in zip(layer_ids, stored_error)},
        "float32_error_plain": {t: float(f"{e:.3g}") for t, e in zip(layer_ids, plain_error)},
        "machine": platform.node(),
    }
    print(json.dumps(result))
    if not args.out:
        shutil.rmtree(tmp, ignore_errors=True)
    if not verified:
        sys.exit(1)


if __name__ == "__main__":
    main()
