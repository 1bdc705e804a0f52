"""Child processes of one run: the flags that give a child the same settings, and `dflashq train --ranks N`, N
trainer ranks on this node through torch's elastic launcher (the API behind torchrun).

Each rank runs `python -m ops.cli train` with this command's settings; the launcher sets RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/MASTER_PORT (trainer.ranks reads them) and holds the rendezvous on a free local port.
When a rank dies the launcher stops the others and, up to `max_restarts` times, starts the group again (it resumes
from its checkpoint); past them the command exits with the rank's code, and `dflashq up` restarts it like any
child. SIGTERM or Ctrl-C reach every rank: each finishes its step, the group checkpoints and acknowledges, and
the command exits 0.
"""

from __future__ import annotations

import os
import sys
import uuid

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dflashq import compat
from dflashq.settings import Settings

# Ranks asked to stop finish their step and the group's checkpoint within this before the launcher kills them; less
# than ops.supervisor.STOP_TIMEOUT_S, so that `up` never kills a launcher whose ranks are still saving.
RANKS_STOP_TIMEOUT_S = 240


def settings_args(settings: Settings) -> list[str]:
    """Flags that give a child command exactly these settings: the config file, every explicit override, and the
    Redis URL resolved once here (children never race to start the embedded Redis)."""
    args = ["--config", settings.config_path] if settings.config_path else []
    for key, value in settings.overrides:
        args += ["--set", f"{key}={value}"]
    return args + ["--redis-url", settings.redis.url]


def launch_config(ranks: int, max_restarts: int = 0) -> LaunchConfig:
    """`ranks` processes on this node, their rendezvous on a free local port (what torchrun --standalone does)."""
    grace = compat.launch_stop_grace(RANKS_STOP_TIMEOUT_S)
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"dflashq-{uuid.uuid4().hex}",
                        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts, **grace)


def launch_ranks(settings: Settings, ranks: int, train_args: list[str], max_restarts: int) -> int:
    """Run `ranks` trainer ranks until they are done; returns the exit code for this command (a rank's own code
    when one failed, 128 + the signal when one was killed)."""
    # The ranks' process group would otherwise share the rendezvous store, whose keys outlive a restart: a restarted
    # group then reads its dead predecessor's addresses and cannot connect (pytorch/pytorch#135712).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        elastic_launch(launch_config(ranks, max_restarts), sys.executable)("-m", "ops.cli", "train", *settings_args(settings), *train_args)
    except ChildFailedError as exc:
        code = exc.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException:  # stopped as asked: the launcher has stopped the ranks
        return 0
    return 0
