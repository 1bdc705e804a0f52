"""Trainer checkpoints: safetensors for every tensor (never pickled weights), JSON for the rest, written atomically.

Layout: `<run_dir>/checkpoints/step-<N>/` with
  drafter.safetensors    the drafter's parameters (fp32 master weights, export tensor names)
  optimizer.safetensors  AdamW moments per parameter name, plus every rank's RNG states (torch CPU, CUDA)
  state.json             drafter config, step, epoch, AdamW scalars, scheduler state, chunks trained per epoch
and `<run_dir>/checkpoints/latest` naming the newest complete one. A checkpoint is written into a temporary
folder, fsynced and renamed, and only then does `latest` move (also atomically): a crash at any point leaves the
previous checkpoint intact. Tensors are full, never sharded: with several ranks, rank 0 writes what
trainer.parallel gathered from all of them.
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
from trainer import parallel
from trainer.drafter import DFLASH2_FIELDS, DFlashDrafter, DrafterConfig
from trainer.ranks import Ranks

KEEP = 2  # complete checkpoints kept on disk
FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DrafterConfig) if f.default is not dataclasses.MISSING}


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


@dataclasses.dataclass
class Saved:
    """What a checkpoint folder holds, as full (unsharded) tensors on the CPU."""
    path: Path
    drafter_config: dict
    state: TrainState
    scheduler: dict
    rng: dict[int, dict[str, torch.Tensor]]  # rank -> its RNG states ("torch", "cuda")
    weights: dict[str, torch.Tensor]
    optimizer: dict  # torch.distributed.checkpoint's layout: {"state": {name: {slot: value}}, "param_groups": [...]}

    def check_config(self, config: DrafterConfig) -> None:
        """A restart must train the drafter the checkpoint holds; otherwise one sentence names the field."""
        current = dataclasses.asdict(config)
        saved = {**FIELD_DEFAULTS, **self.drafter_config}  # a field added since the checkpoint: its default then
        unused = DFLASH2_FIELDS if saved["architecture"] == current["architecture"] == "dflash" else ()
        changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k) and k not in unused)
        if changed:
            field = changed[0]
            raise ConfigError(
                f"The run's checkpoint {self.path} holds a drafter with {field} = {saved.get(field)!r} "
                f"but the config now gives {current.get(field)!r}: configure the run as it was started, or choose "
                "another run name."
            )


def path_of(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states (training draws its anchors from per-chunk generators; these are kept so that a
    restart resumes every rank exactly where it was)."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: dict[str, torch.Tensor], device: torch.device) -> None:
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def save(root: str | Path, drafter_config: DrafterConfig, weights: dict[str, torch.Tensor], optimizer: dict,
         scheduler: dict, state: TrainState, rng: list[dict[str, torch.Tensor]]) -> Path:
    """Write a checkpoint atomically from full tensors (`trainer.parallel.full_state`) and every rank's RNG
    states, in rank order."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = path_of(root, state.step)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    tensors, scalars = {}, {}
    for name, slot in optimizer["state"].items():
        for key, value in slot.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{name}::{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}::{key}"] = float(value)
    for rank, states in enumerate(rng):
        for kind, value in states.items():
            tensors[f"rng::{kind}::{rank}"] = value
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "drafter.safetensors")
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({
        "drafter_config": dataclasses.asdict(drafter_config),
        "train_state": dataclasses.asdict(state),
        "optimizer_scalars": scalars,
        "optimizer_param_groups": optimizer["param_groups"],
        "scheduler": scheduler,
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


def read(checkpoint: str | Path) -> Saved:
    """Everything `save` wrote, as full CPU tensors (`trainer.parallel.load_full_state` puts them back)."""
    checkpoint = Path(checkpoint)
    meta = json.loads((checkpoint / "state.json").read_text())
    optimizer: dict[str, dict] = {}
    rng: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(checkpoint / "optimizer.safetensors").items():
        name, slot, *rank = key.split("::")
        if name == "rng":  # rng::<kind>::<rank>; checkpoints of the single trainer wrote rng::<kind> (rank 0)
            rng.setdefault(int(rank[0]) if rank else 0, {})[slot] = value
        else:
            optimizer.setdefault(name, {})[slot] = value
    for key, value in meta["optimizer_scalars"].items():
        name, slot = key.split("::")
        optimizer.setdefault(name, {})[slot] = torch.tensor(value)
    weights = load_file(checkpoint / "drafter.safetensors")
    # checkpoints of the single trainer kept no parameter names in the group; it held every parameter
    groups = [{"params": list(weights), **group} for group in meta["optimizer_param_groups"]]
    raw = meta["train_state"]
    state = TrainState(raw["step"], raw["epoch"], {int(k): v for k, v in raw["consumed"].items()},
                       {int(k): v for k, v in raw["duplicates_skipped"].items()}, raw["tokens"])
    return Saved(checkpoint, meta["drafter_config"], state, meta["scheduler"], rng, weights,
                 {"state": optimizer, "param_groups": groups})


def restore_group(root: str | Path, ranks: Ranks, model, config: DrafterConfig, optimizer, scheduler,
                  device: torch.device) -> tuple[TrainState, Path | None]:
    """Load the latest checkpoint into the (wrapped) model, optimizer and scheduler of every rank: rank 0 alone reads
    it (the others may not see its folder) and broadcasts. Returns its state and folder (fresh state, None without)."""
    saved = None
    if ranks.leader:
        found = latest(root)
        saved = read(found) if found is not None else None
    # the small part to every rank; the tensors go through torch.distributed.checkpoint's broadcast
    meta = ranks.from_leader(dataclasses.replace(saved, weights={}, optimizer={}) if saved else None)
    if meta is None:
        return TrainState(), None
    meta.check_config(config)
    parallel.load_full_state(model, optimizer, ranks, saved.weights if saved else {}, saved.optimizer if saved else {})
    scheduler.load_state_dict(meta.scheduler)
    set_rng_state(meta.rng.get(ranks.rank, {}), device)  # a new rank keeps its fresh one
    return meta.state, meta.path


def save_group(root: str | Path, ranks: Ranks, model, config: DrafterConfig, optimizer, scheduler, state: TrainState,
               device: torch.device) -> str:
    """Write the group's checkpoint: collective (every rank calls it), rank 0 writes, and every rank returns once the
    checkpoint exists, so that no rank acknowledges an entry before the checkpoint holding it."""
    weights, optimizer_state = parallel.full_state(model, optimizer)
    rng = ranks.gather(rng_state(device))
    if ranks.leader:
        save(root, config, weights, optimizer_state, scheduler.state_dict(), state, rng)
    ranks.barrier()
    return str(path_of(root, state.step))
