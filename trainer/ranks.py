"""Trainer ranks: which rank of one torch.distributed group this process is, the group's set-up, and the
collectives the daemon agrees through (a gather of small Python objects per step, a barrier after rank 0's
checkpoint, a broadcast of what rank 0 read at start).

A rank launched by torchrun, or by `dflashq train --ranks N` (torch's elastic launcher), finds RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR in its environment; without them the process is the one rank of a world of one, and
nothing is communicated (no process group at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def launched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a torch launcher (torchrun, the elastic agent) started this process as one of its ranks."""
    return all(name in environ for name in LAUNCHER_VARIABLES)


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Ranks":
        if not launched(environ):
            return cls()
        return cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: writes checkpoints, the train log and the run's trainer status."""
        return self.rank == 0

    @property
    def consumer(self) -> str:
        """This rank's stable consumer name in the results stream's group (the same after a restart on any host)."""
        return consumer_name(self.rank)

    @property
    def consumers(self) -> list[str]:
        """The consumer names of every live rank: their pending entries are never claimed by another rank."""
        return [consumer_name(rank) for rank in range(self.world_size)]

    def device(self, device: str) -> torch.device:
        """Each rank of a group on a GPU takes cuda:LOCAL_RANK; a world of one keeps the device it was given."""
        chosen = torch.device(device)
        if chosen.type == "cuda" and (self.distributed or chosen.index is None):
            chosen = torch.device("cuda", self.local_rank)
        return chosen

    @contextlib.contextmanager
    def joined(self, device: torch.device, timeout_seconds: float):
        """Be a member of the group while inside: NCCL on GPUs, gloo on CPUs. A collective waiting past the
        timeout fails instead of hanging (a rank that died mid-step, before the launcher tears the group down).
        Leaving destroys the group, also after an error (a gloo group left alive aborts the interpreter's exit)."""
        if not self.distributed:
            yield self
            return
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        try:
            yield self
        finally:
            dist.destroy_process_group()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def from_leader(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (what only rank 0 reads: the checkpoint)."""
        if not self.distributed:
            return obj
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def consumer_name(rank: int) -> str:
    return f"trainer-rank{rank}"
