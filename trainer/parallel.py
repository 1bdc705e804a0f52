"""How the ranks hold the drafter (`train.parallel`): DistributedDataParallel, a full replica per rank whose
gradients are all-reduced (averaged) in the last backward of a step; or FSDP2 (`fully_shard`), with the fp32
master weights, gradients and AdamW state sharded over the ranks, for drafters whose training state does not fit
one GPU. A world of one trains the drafter itself.

Checkpoints hold full (unsharded) tensors whatever the layout, through torch.distributed.checkpoint's state-dict
API: rank 0 receives the full state to write, and at start rank 0's full state is broadcast to every rank (only
rank 0 needs to see the checkpoint folder).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from trainer.drafter import DFlashDrafter
from trainer.ranks import Ranks


def wrap(drafter: DFlashDrafter, ranks: Ranks, parallel: str, device: torch.device) -> nn.Module:
    """The module a step runs forward and backward through; build the optimizer over its parameters after this
    (fully_shard replaces them with sharded ones)."""
    if not ranks.distributed:
        return drafter
    if parallel == "fsdp":
        mesh = init_device_mesh(device.type, (ranks.world_size,))
        for layer in drafter.layers:  # one all-gather per layer in forward, so only one layer is ever unsharded
            fully_shard(layer, mesh=mesh)
        model = fully_shard(drafter, mesh=mesh)
        if drafter.config.dflash2:  # trainer.step calls it after the forward: it gathers the selector's weights too
            register_fsdp_forward_method(model, "selector_loss")
        return model
    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool):
    """Backward passes that only accumulate (every one of a step but the last) skip the gradient communication."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        yield
    else:
        yield


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(weights, optimizer state) as full CPU tensors on rank 0, keyed by the drafter's parameter names
    (torch.distributed.checkpoint's layout); other ranks get empty dicts. Collective: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks, weights: dict,
                    optimizer_state: dict) -> None:
    """Load full tensors (held by rank 0 at least) into the live, possibly sharded model and optimizer. Collective."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ranks.distributed)
    set_model_state_dict(model, weights, options=options)
    if optimizer_state:  # AdamW's implementation is the live machine's (fused on a GPU), not the checkpoint's
        optimizer_state = {**optimizer_state, "param_groups": [
            {**saved, **{key: group[key] for key in ("fused", "foreach")}}
            for saved, group in zip(optimizer_state["param_groups"], optimizer.param_groups)]}
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
