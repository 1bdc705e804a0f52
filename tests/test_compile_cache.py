"""Compiled kernels kept under the run: a second process compiling the same graph hits the cache (what a warm
restart of a worker or trainer rank relies on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflashq.compile_cache import use_run_cache
from dflashq.store import Store

ROOT = Path(__file__).resolve().parent.parent

COMPILE = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from dflashq.compile_cache import use_run_cache
from dflashq.store import Store
use_run_cache(Store(sys.argv[1], "r"))
f = torch.compile(lambda x: (x.sin() * 2 + 1).sum())
f(torch.randn(64))
from torch._dynamo.utils import counters
print(json.dumps(dict(counters["inductor"])))
"""


def _compile(store: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    done = subprocess.run([sys.executable, "-c", COMPILE, str(store), str(ROOT)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_reuses_the_runs_compiled_graph(tmp_path):
    first = _compile(tmp_path)
    assert first.get("fxgraph_cache_miss") == 1 and not first.get("fxgraph_cache_hit")
    assert any((tmp_path / "r" / "compile-cache" / "inductor").iterdir())
    assert _compile(tmp_path).get("fxgraph_cache_hit") == 1  # a restart: nothing compiled again


def test_the_users_own_cache_folders_are_kept_and_remote_stores_keep_the_default(tmp_path, monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    root = use_run_cache(Store(str(tmp_path), "r"))
    assert root == str(tmp_path / "r" / "compile-cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor" and os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_run_cache(Store("memory://bucket", "r")) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
