"""dflashq/compat.py is the one place that asks which torch or Transformers is installed: its answers are ones the
installed libraries accept, and no other module sniffs versions or reads compiled code's internals by name."""

from __future__ import annotations

import re

from dflashq import compat
from tests.conftest import ROOT

# version sniffing, and the by-name reads the compile path used to make (a closure's variable, a guard source)
SNIFFING = re.compile(r"(torch|transformers|rq)\.__version__|__version__\s*(==|!=|<|>)|Version\(|version\.parse"
                      r"|hasattr\((torch|transformers|inductor)|dataclasses\.fields\(LaunchConfig"
                      r"|getclosurevars|dynamic_sources|L\['")


def test_the_answers_are_accepted_by_the_installed_libraries():
    from torch._inductor import config
    from torch.distributed.launcher.api import LaunchConfig

    with config.patch(compat.inductor_options()):  # an option this torch lacks would raise here
        pass
    grace = compat.launch_stop_grace(7)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **grace)
    assert getattr(config, "shutdown_timeout", 7) == 7


def test_the_cache_keyword_is_a_parameter_of_the_models_forward():
    import inspect

    from transformers import Qwen3ForCausalLM

    assert compat.cache_keyword(Qwen3ForCausalLM) in inspect.signature(Qwen3ForCausalLM.forward).parameters


def test_no_module_outside_compat_sniffs_versions():
    found = []
    for folder in ("dflashq", "producers", "workers", "trainer", "ops"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "dflashq" / "compat.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if SNIFFING.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
    assert SNIFFING.search('if hasattr(torch.compiler.config, "dynamic_sources"):')  # the pattern can match
