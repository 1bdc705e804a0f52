"""Where `dflashq up` runs its workers and its trainer: with G visible GPUs, workers on G - T of them and the
trainer's T ranks on the others (the trainer child sees only its own through CUDA_VISIBLE_DEVICES), never a worker
and a trainer rank on one GPU; with one GPU both share it, as with CPU workers the trainer takes cuda:0.

T is `--trainer-gpus`, else the T that balances the run: extraction on G - T GPUs feeding training on T, from the
busy rates earlier runs of the same run name recorded in Redis (the mean tokens/s of a GPU worker while extracting,
e, and of a GPU trainer rank while training, t), else from defaults.TRAINER_GPU_SHARE.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Mapping

from dflashq import defaults
from dflashq.exceptions import ConfigError
from dflashq.run import Run
from ops import status


@dataclasses.dataclass
class Placement:
    workers: list[tuple[str, int]]  # (device kind, index): one worker each
    trainer_args: list[str]  # `dflashq train` flags: its device, and its ranks
    trainer_env: dict[str, str]  # the trainer child's own environment (CUDA_VISIBLE_DEVICES)
    note: str | None  # how the GPUs were split, said once by `up`


def measured_share(run: Run) -> float | None:
    """e / (e + t) from the rates recorded by earlier runs of this run name, or None until both were measured."""
    workers = [p["busy_tokens_per_second"] for name, p in status.worker_progress(run).items()
               if ".gpu" in name and p.get("busy_tokens_per_second")]
    ranks = [r["busy_tokens_per_second"] for r in status.trainer_ranks(run)
             if r["device"].startswith("cuda") and r.get("busy_tokens_per_second")]
    if not workers or not ranks:
        return None
    e, t = statistics.mean(workers), statistics.mean(ranks)
    return e / (e + t)


def balanced_trainer_gpus(gpus: int, share: float) -> int:
    """The T in 1..G-1 whose slower side is fastest: max over T of min((G - T) e, T t), with e : t = share : 1 - share."""
    return max(range(1, gpus), key=lambda t: min((gpus - t) * share, t * (1 - share)))


def place(run: Run, gpus: int, cpu_workers: int | None, trainer_device: str | None, trainer_gpus: int | None,
          environ: Mapping[str, str] = os.environ) -> Placement:
    if trainer_gpus is not None and (cpu_workers or not gpus or trainer_device):
        raise ConfigError("--trainer-gpus splits this node's GPUs between workers and trainer ranks: leave out "
                          "--workers and --trainer-device with it (and it needs a visible GPU).")
    if cpu_workers or not gpus:
        return Placement([("cpu", i) for i in range(cpu_workers or 1)],
                         ["--device", trainer_device or ("cuda:0" if gpus else "cpu")], {}, None)
    if trainer_device:  # the user's own choice of device: workers on every GPU, as before --trainer-gpus
        return Placement([("cuda", i) for i in range(gpus)], ["--device", trainer_device], {}, None)
    if gpus == 1:
        if trainer_gpus not in (None, 1):
            raise ConfigError(f"--trainer-gpus {trainer_gpus} leaves no GPU for a worker: this node shows 1 GPU.")
        return Placement([("cuda", 0)], ["--device", "cuda:0"], {},
                         "one GPU: the worker and the trainer share cuda:0")
    if trainer_gpus is not None and not 1 <= trainer_gpus < gpus:
        raise ConfigError(f"--trainer-gpus must be from 1 to {gpus - 1} on this node's {gpus} GPUs (the others run workers).")
    if trainer_gpus is not None:
        count, why = trainer_gpus, "--trainer-gpus"
    else:
        share = measured_share(run)
        count = balanced_trainer_gpus(gpus, share if share is not None else defaults.TRAINER_GPU_SHARE)
        why = ("balanced from the rates earlier runs of this run measured" if share is not None
               else "balanced from the default ratio, defaults.TRAINER_GPU_SHARE (no rates measured yet)")
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or [str(i) for i in range(gpus)]
    mine = visible[gpus - count:gpus]
    return Placement([("cuda", i) for i in range(gpus - count)], ["--device", "cuda", "--ranks", str(count)],
                     {"CUDA_VISIBLE_DEVICES": ",".join(mine)},
                     f"{gpus - count} GPU(s) extract, {count} train (GPUs {','.join(mine)}; {why})")
