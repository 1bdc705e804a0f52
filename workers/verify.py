"""`dflashq verify`: recompute samples with a plain, unbatched Transformers forward and compare with stored states.

The reference is `output_hidden_states=True` (hidden_states[t + 1] is the output of layer t), except for the last
decoder layer: Transformers puts the final-normed output there, so that layer's raw output is taken by a hook.
"""

from __future__ import annotations

import dataclasses

import torch

from dflashq.blob import CODEC_RELATIVE_ERROR
from dflashq.chunk import Sample
from dflashq.capture import decoder_layers

# Largest allowed max|stored - reference| as a fraction of the layer's max|reference|. Stored states come from
# padded batches whose kernels sum in another order: fp32 agrees to rounding; bf16 keeps 8 mantissa bits. The
# codec adds its own rounding on top (fp8 e4m3: at most 2^-4 of the token's max, so of the layer's max).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def tolerance(dtype: torch.dtype, codec: str = "bf16") -> float:
    return TOLERANCE[dtype] + CODEC_RELATIVE_ERROR[codec]


@dataclasses.dataclass
class LayerReport:
    layer_id: int
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0  # max_abs_diff / max|reference|, worst sample
    all_zero_samples: int = 0
    non_finite: int = 0
    mismatched_samples: int = 0

    @property
    def ok(self) -> bool:
        return not (self.all_zero_samples or self.non_finite or self.mismatched_samples)

    def problems(self) -> str:
        found = [
            f"{self.all_zero_samples} all-zero sample(s)" if self.all_zero_samples else "",
            f"{self.non_finite} non-finite value(s)" if self.non_finite else "",
            f"{self.mismatched_samples} mismatched sample(s)" if self.mismatched_samples else "",
        ]
        return ", ".join(p for p in found if p) or "ok"


@torch.inference_mode()
def reference_hidden(model: torch.nn.Module, layer_ids: list[int], input_ids) -> torch.Tensor:
    """One sample's tapped hidden states [T, K, H] from an unbatched forward with output_hidden_states."""
    layers = decoder_layers(model)
    last = len(layers) - 1
    raw_last: list[torch.Tensor] = []
    handle = layers[last].register_forward_hook(
        lambda module, args, output: raw_last.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        device = next(model.parameters()).device
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)[None]
        states = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()
    return torch.stack([raw_last[0][0] if t == last else states[t + 1][0] for t in layer_ids], dim=1)


def verify_samples(
    model: torch.nn.Module, layer_ids: list[int], samples: list[Sample], stored_hidden: list[torch.Tensor],
    codec: str = "bf16",
) -> tuple[list[LayerReport], bool]:
    """Per tapped layer, the worst disagreement between stored [T, K, H] states and the reference; and whether all
    layers pass (no all-zero sample, no non-finite value, no difference beyond the dtype's and codec's tolerance)."""
    reports = [LayerReport(t) for t in layer_ids]
    allowed = tolerance(model.dtype, codec)
    for sample, stored in zip(samples, stored_hidden, strict=True):
        reference = reference_hidden(model, layer_ids, sample.input_ids).float().cpu()
        stored = stored.float().cpu()
        if stored.shape != reference.shape:
            for report in reports:
                report.mismatched_samples += 1
                report.max_abs_diff = report.max_rel_diff = float("inf")
            continue
        for k, report in enumerate(reports):
            got, want = stored[:, k], reference[:, k]
            finite = torch.isfinite(got)
            report.non_finite += int((~finite).sum())
            report.all_zero_samples += int(bool((got == 0).all()))
            abs_diff = (got - want).abs().max().item() if finite.all() else float("inf")
            rel_diff = abs_diff / max(want.abs().max().item(), torch.finfo(torch.float32).tiny)
            report.max_abs_diff = max(report.max_abs_diff, abs_diff)
            report.max_rel_diff = max(report.max_rel_diff, rel_diff)
            report.mismatched_samples += int(rel_diff > allowed)
    return reports, all(r.ok for r in reports)


def pick_stored(run, num_samples: int, seed: int = 0) -> tuple[list[Sample], list[torch.Tensor], torch.dtype, str]:
    """`num_samples` random samples of the run's stored blobs: (samples, their stored states [T, K, H], dtype, codec)."""
    import random

    from dflashq.blob import decode_blob
    from dflashq.exceptions import InputError

    paths = [fields[b"path"].decode() for _, fields in run.conn.xrange(run.keys.results)]
    paths = [p for p in paths if run.store.exists(p)]
    if not paths:
        raise InputError(f"Run '{run.settings.run}' has no stored blobs to verify: run a worker first (with retention 'delete', verify before training).")
    rng = random.Random(seed)
    picks = sorted(rng.choices(range(len(paths)), k=num_samples))
    samples, stored, dtype, codec = [], [], None, "bf16"
    for index in sorted(set(picks)):
        blob = decode_blob(run.store.read(paths[index]))
        dtype, codec = blob.dtype, blob.codec  # one run: one codec (the manifest refuses a second)
        per_blob = list(blob.samples())
        for _ in range(picks.count(index)):
            hidden, ids, mask = per_blob[rng.randrange(len(per_blob))]
            samples.append(Sample(ids.numpy(), mask.numpy()))
            stored.append(hidden)
    return samples, stored, dtype, codec


def verify_run(run, num_samples: int, device: str = "cpu", seed: int = 0) -> tuple[list[LayerReport], bool, int]:
    """Recompute `num_samples` random samples of the run's stored blobs; returns (reports, ok, samples checked)."""
    from dflashq.target import load_target

    samples, stored, dtype, codec = pick_stored(run, num_samples, seed)
    # the reference runs in the dtype the blobs were written in, so the tolerance is that dtype's (and the codec's)
    model = load_target(run.settings.model.path, device, dtype, run.settings.model.trust_remote_code)
    reports, ok = verify_samples(model, run.layer_ids, samples, stored, codec)
    return reports, ok, len(samples)
