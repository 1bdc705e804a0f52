"""Trainer checkpoints: safetensors for every tensor (never pickled weights), JSON for the rest, written atomically.

Layout: `<run_dir>/checkpoints/step-<N>/` with
  drafter.safetensors    the drafter's parameters (fp32 master weights, export tensor names)
  optimizer.safetensors  AdamW moments per parameter name, plus the RNG states (torch CPU, CUDA, anchor generator)
  state.json             drafter config, step, epoch, AdamW scalars, scheduler state, chunks trained per epoch
and `<run_dir>/checkpoints/latest` naming the newest complete one. A checkpoint is written into a temporary
folder, fsynced and renamed, and only then does `latest` move (also atomically): a crash at any point leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflashq.exceptions import ConfigError
from trainer.drafter import DFlashDrafter, DrafterConfig

KEEP = 2  # complete checkpoints kept on disk


@dataclasses.dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    consumed: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # epoch -> chunk ids, in training order
    duplicates_skipped: dict[int, int] = dataclasses.field(default_factory=dict)
    tokens: int = 0

    def consumed_in(self, epoch: int) -> list[str]:
        return self.consumed.setdefault(epoch, [])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | Path, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, scheduler,
         state: TrainState, generator: torch.Generator | None) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    names = {id(p): n for n, p in drafter.named_parameters()}
    tensors, scalars = {}, {}
    for param, slot in optimizer.state.items():
        name = names[id(param)]
        for key, value in slot.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{name}::{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}::{key}"] = float(value)
    tensors["rng::torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng::cuda"] = torch.cuda.get_rng_state()
    if generator is not None:
        tensors["rng::anchors"] = generator.get_state().cpu()
    save_file({k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}, tmp / "drafter.safetensors")
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({
        "drafter_config": dataclasses.asdict(drafter.config),
        "train_state": dataclasses.asdict(state),
        "optimizer_scalars": scalars,
        "optimizer_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict(),
    }, indent=1))
    for name in ("drafter.safetensors", "optimizer.safetensors", "state.json"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # a re-run of the same step after a crash between rename and `latest`
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".latest-{uuid.uuid4().hex}"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p != final)[:-(KEEP - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: str | Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def load_drafter(checkpoint: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter of a checkpoint folder (what `dflashq export` and evaluation start from)."""
    checkpoint = Path(checkpoint)
    meta = json.loads((checkpoint / "state.json").read_text())
    drafter = DFlashDrafter(DrafterConfig(**meta["drafter_config"]))
    drafter.load_state_dict(load_file(checkpoint / "drafter.safetensors"))
    return drafter.to(device)


def restore(checkpoint: str | Path, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, scheduler,
            generator: torch.Generator | None) -> TrainState:
    """Load everything `save` wrote back into live objects; returns the train state."""
    checkpoint = Path(checkpoint)
    meta = json.loads((checkpoint / "state.json").read_text())
    saved, current = meta["drafter_config"], dataclasses.asdict(drafter.config)
    changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if changed:
        field = changed[0]
        raise ConfigError(
            f"The run's checkpoint {checkpoint} holds a drafter with {field} = {saved.get(field)!r} but the config "
            f"now gives {current.get(field)!r}: configure the run as it was started, or choose another run name."
        )
    device = next(drafter.parameters()).device
    drafter.load_state_dict(load_file(checkpoint / "drafter.safetensors", device=str(device)))
    tensors = load_file(checkpoint / "optimizer.safetensors")
    params = dict(drafter.named_parameters())
    for key, value in meta["optimizer_scalars"].items():
        name, slot = key.split("::")
        optimizer.state[params[name]][slot] = torch.tensor(value)
    for key, value in tensors.items():
        name, slot = key.split("::")
        if name == "rng":
            continue
        optimizer.state[params[name]][slot] = value.to(device)
    for group, saved in zip(optimizer.param_groups, meta["optimizer_param_groups"]):
        group.update(saved)
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng::torch"])
    if "rng::cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng::cuda"])
    if generator is not None and "rng::anchors" in tensors:
        generator.set_state(tensors["rng::anchors"])  # generator states are CPU byte tensors, CUDA ones too
    raw = meta["train_state"]
    return TrainState(raw["step"], raw["epoch"], {int(k): v for k, v in raw["consumed"].items()},
                      {int(k): v for k, v in raw["duplicates_skipped"].items()}, raw["tokens"])
