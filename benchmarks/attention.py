"""The drafter's training attention paths on this device against a float32 reference on the CPU: for each path, the
error of one forward's hidden states and of every parameter's gradient relative to the reference, and the time of a
forward + backward. A kernel that misreads a boolean or broadcast mask (silent SDPA bugs of some CUDA backends) shows
here as relative errors near 1 instead of bf16's ~1e-2.

Paths: `sdpa` (the trainer's SDPA path: bf16 autocast, the memory-efficient kernel on CUDA), `flex` (compiled
flex_attention on CUDA; minutes of compilation on a fresh machine). Reference: the same weights and inputs through
the SDPA path in float32 on the CPU (torch's CPU kernels: another implementation than the device's).
Inputs as a run has them: --samples sequences of 1/8..1x --seq-len tokens, right-padded, the second half of each
supervised, up to --anchors anchors each (every supervised position, for short samples).
Usage: python benchmarks/attention.py [--tiny] [--shape smollm2] [--paths sdpa,flex] [--samples 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.extract import TINY, sync  # noqa: E402
from benchmarks.train import SHAPES  # noqa: E402
from trainer.anchors import gather_blocks, sample_anchors  # noqa: E402
from trainer.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from trainer.loss import dflash_loss  # noqa: E402
from trainer.target_head import TargetHead  # noqa: E402


def inputs(cfg: DrafterConfig, args, device: torch.device, gen: torch.Generator):
    lengths = torch.randint(max(2 * cfg.block_size, args.seq_len // 8), args.seq_len + 1, (args.samples,), generator=gen)
    t = int(lengths.max())
    positions = torch.arange(t)  # [T]
    mask = ((positions[None] < lengths[:, None]) & (positions[None] >= lengths[:, None] // 2)).to(torch.uint8)  # [b, T]
    ids = torch.randint(0, cfg.vocab_size, (args.samples, t), generator=gen)  # [b, T]
    context = torch.randn(args.samples, t, cfg.num_tapped * cfg.hidden_size, generator=gen)  # [b, T, K*H]
    mask, ids, context = mask.to(device), ids.to(device), context.to(device)
    anchors, valid = sample_anchors(mask, args.anchors, torch.Generator(device=device).manual_seed(0))  # [b, N] x2
    block_ids, targets, slot_valid = gather_blocks(ids, mask, anchors, valid, cfg.block_size, cfg.mask_token_id)
    return context, block_ids, anchors, targets, slot_valid  # [b, T, K*H], [b, N, B], [b, N], [b, N, B] x2


def forward_backward(drafter, head, batch, attention: str):
    """One forward + backward as trainer.step.backward runs it (bf16 autocast on CUDA, the head in its dtype);
    returns the final hidden states [b, N, B, H] and every parameter's gradient, in float32."""
    context, block_ids, anchors, targets, slot_valid = batch
    drafter.zero_grad(set_to_none=True)
    with torch.autocast(device_type=context.device.type, dtype=torch.bfloat16, enabled=context.is_cuda):
        hidden = drafter(context, block_ids, anchors, head, attention)  # [b, N, B, H]
    out = dflash_loss(hidden.to(head.lm_head.dtype), head.lm_head, targets, slot_valid)
    out.loss.backward()
    return hidden.detach().float(), {n: p.grad.float() for n, p in drafter.named_parameters()}


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def measure_path(drafter, head, batch, path: str, reference, repeats: int) -> dict:
    run = lambda: forward_backward(drafter, head, batch, path)  # noqa: E731
    device = batch[0].device
    try:
        t0 = time.perf_counter()
        hidden, grads = run()  # also the warm-up (compilation for flex)
        sync(device)
        first = time.perf_counter() - t0
    except RuntimeError as exc:  # flex's backward on the CPU
        return {"path": path, "supported": False, "reason": str(exc).splitlines()[0][:200]}
    valid = batch[4].any(-1)  # [b, N] blocks with a supervised slot
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    ref_hidden, ref_grads = reference[0].to(device), {n: g.to(device) for n, g in reference[1].items()}
    grad_errors = {n: relative_error(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(grad_errors, key=grad_errors.get)
    return {"path": path, "supported": True, "hidden_rel_error": round(relative_error(hidden[valid], ref_hidden[valid]), 5),
            "grad_rel_error_max": round(grad_errors[worst], 5), "grad_rel_error_worst_param": worst,
            "grad_rel_error_median": round(statistics.median(grad_errors.values()), 5),
            "first_ms": round(1000 * first, 1), "median_ms": round(1000 * statistics.median(times), 1)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny drafter on the CPU (checks the script)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--paths", default="sdpa", help="comma-separated: sdpa, flex")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq_len, args.samples, args.anchors, args.repeats = 128, 3, 16, 1
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    target, layer_types = (TINY, None) if args.tiny else SHAPES[args.shape]
    cfg = DrafterConfig.default_for_target(target, num_layers=5, mask_token_id=target["vocab_size"] - 1,
                                           **({"layer_types": layer_types} if layer_types else {}))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device)  # fp32 master weights, as the trainer holds them
    gen = torch.Generator().manual_seed(1)
    head32 = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02,  # [V, H] on the CPU
                        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the trainer's head dtype
    head = TargetHead(head32.embed_tokens.to(device, head_dtype), head32.lm_head.to(device, head_dtype))
    batch = inputs(cfg, args, device, gen)
    cpu = torch.device("cpu")
    reference = forward_backward(copy.deepcopy(drafter).to(cpu), head32, [x.to(cpu) for x in batch], "sdpa")
    paths = [measure_path(drafter, head, batch, p, reference, args.repeats) for p in args.paths.split(",")]
    for p in paths:
        print(json.dumps(p), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "attention", "shape": "tiny" if args.tiny else args.shape,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "samples": args.samples,
                      "tokens": int(batch[0].shape[0] * batch[0].shape[1]), "blocks": int(batch[2].numel()),
                      "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
