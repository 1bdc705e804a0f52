"""Drafter training throughput on one GPU: samples/s, MFU against a matmul measured in the same run, peak memory;
with --ranks N, the same per rank of a DDP group launched through torch's launcher, and the scaling efficiency
against one rank measured in the same run (N ranks' samples/s over N times one rank's).

The Qwen3.6-27B drafter shape (5 layers, H 5120, intermediate 17408, vocab 248320, 32/8 heads of 128, block 16,
4 sliding + 1 full layer) with synthetic context: random tapped states [T, 5*H] of 4096-token samples, every token
supervised, 512 anchors per sample, the real trainer.step.train_step (anchors, flex attention, chunked head + loss,
backward, clipping, AdamW on fp32 master weights, bf16 autocast).
MFU counts matmul FLOPs analytically (fc, projections, MLP x3 for forward + both backward products; fc x2: its
input needs no gradient; the frozen head x2: logits + input gradient) plus attention over the keys each query may
see (x3.5: forward + FlashAttention-style backward).
--shape picks the target: qwen3.6-27b (above), qwen3-8b (H 4096, V 151936, full attention) or smollm2 (H 576, V 49152,
the target's own 9/3 heads of 64). --lengths varied draws sample lengths per step and packs them as the trainer packs
a chunk, so shapes change as in a run; --lengths chat also leaves short samples fewer anchor candidates than --anchors;
compile_seconds = the whole run minus every step at the steady median.
Usage: python benchmarks/train.py [--tiny] [--shape qwen3-8b] [--steps 20] [--lengths varied|chat] [--profile] [--ranks 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.launcher.api import elastic_launch  # noqa: E402

from benchmarks.extract import QWEN36_27B, TINY, matmul_tflops, print_profile, sync  # noqa: E402
from benchmarks.host import cpu  # noqa: E402
from dflashq.chunk import micro_batches  # noqa: E402
from ops.launch import launch_config  # noqa: E402
from trainer import fused, parallel  # noqa: E402
from trainer.anchors import sample_anchors  # noqa: E402
from trainer.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from trainer.ranks import Ranks  # noqa: E402
from trainer.step import Batch, WarmupCosine, build_optimizer, train_step  # noqa: E402
from trainer.target_head import TargetHead  # noqa: E402


def step_flops(cfg: DrafterConfig, context_len: int, anchors: torch.Tensor) -> float:
    h, k, i, v, bs = cfg.hidden_size, cfg.num_tapped, cfg.intermediate_size, cfg.vocab_size, cfg.block_size
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    q = anchors.numel() * bs
    flops = 2 * context_len * k * h * h * 2  # fc
    per_layer = 2 * q * h * nq * 2 + 2 * (q + context_len) * h * nkv * 2 + 2 * q * h * i * 3
    flops += cfg.num_layers * per_layer * 3
    a = anchors.double()
    for layer_type in cfg.layer_types:
        if layer_type == "sliding_attention":
            visible = (a.clamp(max=cfg.sliding_window).sum() + anchors.numel() * (bs + 1) / 2) * bs
        else:
            visible = (a.sum() + anchors.numel() * bs) * bs
        flops += 2 * 2 * nq * float(visible) * 3.5
    flops += 2 * q * (bs - 1) / bs * h * v * 2  # head: valid rows only
    return flops


# Target config fields the drafter defaults read (published configs). The drafter takes the released shape
# (32/8 heads of 128, full attention) except where noted.
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3)  # under hidden 1024: the target's own attention
SHAPES = {
    # the released Qwen3.6-27B drafter's layout: 4 sliding + 1 full
    "qwen3.6-27b": (QWEN36_27B, ["sliding_attention"] * 4 + ["full_attention"]),
    "qwen3-8b": (QWEN3_8B, None),
    "smollm2": (SMOLLM2, None),
}


def batches(args, cfg, device, dtype, gen: torch.Generator):
    """Batches and their sample lengths. Fixed: `--batch` samples of `--seq-len` tokens every step, all supervised.
    Varied: samples of 1/4..1x `--seq-len` tokens, packed into micro-batches of at most `--micro-batch-tokens` padded
    tokens as the trainer packs a chunk (so the shapes change from step to step, as in a run). Chat: as varied over
    1/16..1x `--seq-len`, each sample's first 0-50% a prompt without loss, so short samples hold fewer anchor
    candidates than `--anchors`, as a chat data set's do (the quality benchmark's average 462 in 712 tokens)."""
    while True:
        if args.lengths == "fixed":
            lengths = [args.seq_len] * args.batch
        else:
            shortest = args.seq_len // (16 if args.lengths == "chat" else 4)
            lengths = torch.randint(shortest, args.seq_len + 1, (64,), generator=gen).tolist()
            groups = micro_batches(lengths, args.micro_batch_tokens)
            # varied keeps its first (longest) micro-batch, as its earlier figures did; chat any of them
            pick = int(torch.randint(len(groups), (1,), generator=gen)) if args.lengths == "chat" else 0
            lengths = [lengths[i] for i in groups[pick]]
        b, t, ends = len(lengths), max(lengths), torch.tensor(lengths)  # ends [b]
        prompts = torch.zeros(b, dtype=torch.long)  # [b]
        if args.lengths == "chat":
            prompts = (torch.rand(b, generator=gen) * 0.5 * ends).long()  # [b]
        positions = torch.arange(t)[None]  # [1, T]
        mask = ((positions >= prompts[:, None]) & (positions < ends[:, None])).to(torch.uint8)  # [b, T]
        yield Batch(torch.randn(b, t, cfg.num_tapped * cfg.hidden_size, dtype=dtype, device=device),  # [b, T, K*H]
                    torch.randint(0, cfg.vocab_size, (b, t), device=device),  # [b, T]
                    mask.to(device)), lengths  # [b, T]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny drafter on the CPU (checks the script)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b", help="the target whose drafter is trained")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", choices=["fixed", "varied", "chat"], default="fixed",
                        help="varied: random sample lengths packed like a chunk; chat: shorter ones, prompts without "
                             "loss; both report compile time over the run")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto", help="train.attention")
    parser.add_argument("--profile", action="store_true", help="also print the top operators of one step")
    parser.add_argument("--automatic-dynamic", action="store_true",
                        help="leave the sizes that change to Dynamo's automatic dynamic shapes, as the trainer did "
                             "before it marked them (trainer.fused.varying_sizes): the A/B of that marking")
    parser.add_argument("--ranks", type=int, default=None,
                        help="data-parallel (DDP) on N ranks through torch's launcher, after one rank alone")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq_len, args.micro_batch_tokens = 256, 512
    return args


def bench_device(args: argparse.Namespace, ranks: Ranks) -> torch.device:
    return ranks.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")


def measure(args: argparse.Namespace, ranks: Ranks = Ranks()) -> dict:
    """The benchmark on this process's device: one rank, or this rank of a DDP group it has joined."""
    device = bench_device(args, ranks)
    if args.automatic_dynamic:  # the compiled regions then mark nothing: each compiles static, then again per change
        fused.varying_sizes = lambda varying, call_args: contextlib.nullcontext()
    target, layer_types = (TINY, None) if args.tiny else SHAPES[args.shape]
    layout = {"layer_types": layer_types} if layer_types else {}
    cfg = DrafterConfig.default_for_target(target, num_layers=5, mask_token_id=target["vocab_size"] - 1, **layout)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device)  # fp32 master weights
    model = parallel.wrap(drafter, ranks, "ddp", device)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=head_dtype, device=device) * 0.02,
                      torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=head_dtype, device=device) * 0.02)
    optimizer, scheduler = build_optimizer(model.parameters(), 6e-4, 0.0, WarmupCosine(0.04, 1000))
    generator = torch.Generator(device=device).manual_seed(ranks.rank)
    ceiling = matmul_tflops(device)
    kwargs = dict(num_anchors=args.anchors, grad_clip=1.0, loss_chunk_rows=2048, generator=generator,
                  attention=args.attention, model=model)
    source = batches(args, cfg, device, head_dtype, torch.Generator().manual_seed(1 + ranks.rank))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, flops, samples, tokens = [], [], [], []
    for _ in range(args.warmup_steps + args.steps):  # the first ones compile flex attention and the block masks
        batch, lengths = next(source)
        # the step's own anchor draws, for its FLOP count (padding anchors are no work the model needs)
        probe = torch.Generator(device=device).manual_seed(generator.initial_seed())
        probe.set_state(generator.get_state())
        anchors, valid = sample_anchors(batch.loss_mask, args.anchors, probe)
        sync(device)
        t0 = time.perf_counter()
        stats = train_step(drafter, head, batch, optimizer, scheduler, **kwargs)
        sync(device)
        times.append(time.perf_counter() - t0)
        flops.append(sum(step_flops(cfg, n, a[v][None]) for n, a, v in zip(lengths, anchors, valid)))
        samples.append(batch.loss_mask.shape[0])
        tokens.append(int(batch.loss_mask.sum()))
    timed, timed_flops = times[args.warmup_steps:], flops[args.warmup_steps:]
    median = statistics.median(timed)
    seconds = sum(timed)
    if args.profile and ranks.leader:
        print_profile(device, lambda: train_step(drafter, head, next(source)[0], optimizer, scheduler, **kwargs))
    return {
        "benchmark": "train",
        "shape": "tiny" if args.tiny else args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": cpu(), "torch": torch.__version__, "automatic_dynamic": args.automatic_dynamic,
        "drafter_params_b": round(sum(p.numel() for p in drafter.parameters()) / 1e9, 3),
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "block": cfg.block_size,
        "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim], "layer_types": cfg.layer_types,
        "attention": args.attention, "lengths": args.lengths, "seq_len": args.seq_len, "anchors": args.anchors, "steps": args.steps,
        "warmup_seconds": round(sum(times[:args.warmup_steps]), 1),
        # whole run (warm-up included) minus every step at the steady median: what compiling cost
        "compile_seconds": round(sum(times) - len(times) * median, 1),
        # graphs Dynamo captured in this process: each compiled region once, plus its recompilations
        "graphs_compiled": counters["stats"]["unique_graphs"],
        "step_ms": round(1000 * seconds / args.steps, 1),
        "median_step_ms": round(1000 * median, 1),
        "samples_per_s": round(sum(samples[args.warmup_steps:]) / seconds, 3),
        # over the timed steps, as samples_per_s: with the warm-up in, a fresh compile cache would dominate it
        "tokens_per_s": round(sum(tokens[args.warmup_steps:]) / seconds, 1),
        "matmul_tflops": round(ceiling, 1),
        "model_tflops": round(sum(timed_flops) / seconds / 1e12, 1),
        "mfu": round(sum(timed_flops) / seconds / 1e12 / ceiling, 3) if device.type == "cuda" else None,
        # per step, then the median: a run whose changing shapes still compile now and then shows its steady rate
        "median_step_mfu": round(statistics.median(f / t for f, t in zip(timed_flops, timed)) / 1e12 / ceiling, 3)
        if device.type == "cuda" else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        "last_loss": round(stats.loss, 3),
    }


def rank_main(args: argparse.Namespace) -> dict:
    """One rank launched by torch's elastic launcher: its figures come back to the launching process."""
    ranks = Ranks.from_environment()
    with ranks.joined(bench_device(args, ranks), 600):
        return measure(args, ranks)


def launch(args: argparse.Namespace, ranks: int) -> list[dict]:
    results = elastic_launch(launch_config(ranks), rank_main)(args)
    return [results[rank] for rank in range(ranks)]


def main() -> None:
    args = parse_args()
    if not args.ranks:
        print(json.dumps(measure(args)), flush=True)
        return
    # one rank alone first, in the same run and through the same launcher, then N: their ratio is the scaling
    one = launch(args, 1)[0]
    per_rank = launch(args, args.ranks)
    total = sum(r["samples_per_s"] for r in per_rank)
    print(json.dumps({
        "benchmark": "train", "ranks": args.ranks, "parallel": "ddp", "one_rank": one, "per_rank": per_rank,
        "samples_per_s": round(total, 3),
        "scaling_efficiency": round(total / (args.ranks * one["samples_per_s"]), 3),
    }), flush=True)


if __name__ == "__main__":
    main()
