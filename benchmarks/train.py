"""Drafter training throughput on one GPU: samples/s, MFU against a matmul measured in the same run, peak memory.

The Qwen3.6-27B drafter shape (5 layers, H 5120, intermediate 17408, vocab 248320, 32/8 heads of 128, block 16,
4 sliding + 1 full layer) with synthetic context: random tapped states [T, 5*H] of 4096-token samples, every token
supervised, 512 anchors per sample, the real trainer.step.train_step (anchors, flex attention, chunked head + loss,
backward, clipping, AdamW on fp32 master weights, bf16 autocast).
MFU counts matmul FLOPs analytically (fc, projections, MLP x3 for forward + both backward products; fc x2: its
input needs no gradient; the frozen head x2: logits + input gradient) plus attention over the keys each query may
see (x3.5: forward + FlashAttention-style backward).
Usage: python benchmarks/train.py [--tiny] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.extract import QWEN36_27B, TINY, matmul_tflops, sync  # noqa: E402
from trainer.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny drafter on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    target = dict(TINY if args.tiny else QWEN36_27B)
    seq_len = 256 if args.tiny else args.seq_len
    # the released Qwen3.6-27B drafter's layout (the default is full attention in every layer)
    cfg = DrafterConfig.default_for_target(target, num_layers=5, mask_token_id=target["vocab_size"] - 1,
                                           layer_types=["sliding_attention"] * 4 + ["full_attention"])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device)  # fp32 master weights
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=head_dtype, device=device) * 0.02,
                      torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=head_dtype, device=device) * 0.02)
    optimizer, scheduler = build_optimizer(drafter, 6e-4, 0.0, WarmupCosine(0.04, 1000))
    generator = torch.Generator(device=device).manual_seed(0)
    batch = Batch(
        torch.randn(args.batch, seq_len, cfg.num_tapped * cfg.hidden_size, dtype=head_dtype, device=device),  # [b, T, K*H]
        torch.randint(0, cfg.vocab_size, (args.batch, seq_len), device=device),  # [b, T]
        torch.ones(args.batch, seq_len, dtype=torch.uint8, device=device),  # [b, T]
    )
    ceiling = matmul_tflops(device)
    kwargs = dict(num_anchors=args.anchors, grad_clip=1.0, loss_chunk_rows=2048, generator=generator)
    start = time.perf_counter()
    for _ in range(args.warmup_steps):  # compiles flex attention and the block-mask builder
        train_step(drafter, head, batch, optimizer, scheduler, **kwargs)
    sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # the same anchor draws as the timed steps, for the FLOP count
    probe = torch.Generator(device=device).manual_seed(generator.initial_seed())
    probe.set_state(generator.get_state())
    from trainer.anchors import sample_anchors

    flops = sum(step_flops(cfg, seq_len, sample_anchors(batch.loss_mask, args.anchors, probe)[0]) for _ in range(args.steps))
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        stats = train_step(drafter, head, batch, optimizer, scheduler, **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    result = {
        "benchmark": "train",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "drafter_params_b": round(sum(p.numel() for p in drafter.parameters()) / 1e9, 3),
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "block": cfg.block_size,
        "seq_len": seq_len, "anchors": args.anchors, "batch": args.batch, "steps": args.steps,
        "warmup_seconds": round(warmup_s, 1),
        "step_ms": round(1000 * seconds / args.steps, 1),
        "samples_per_s": round(args.batch * args.steps / seconds, 2),
        "matmul_tflops": round(ceiling, 1),
        "model_tflops": round(flops / seconds / 1e12, 1),
        "mfu": round(flops / seconds / 1e12 / ceiling, 3) if device.type == "cuda" else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        "last_loss": round(stats.loss, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
