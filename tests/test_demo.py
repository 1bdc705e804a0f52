"""`make demo` = `dflashq demo`: prompts -> regenerate -> `up` -> export -> speculative decoding on the CPU, with tau
well above 1 on its learnable tiny target."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ops.redis_server import EmbeddedRedis
from workers.recovery import pid_running

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_runs_the_pipeline_and_prints_tau(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # rich wraps lines at the terminal width
    found = re.search(r"mean tau ([0-9.]+) \(lossless: True", text)
    assert found and float(found.group(1)) > 2.0, text[-1500:]  # it learned: an untrained drafter gets about 1
    assert "conversations regenerated" in text  # the target's own replies, through `regenerate`
    exported = list((out / "runs" / "demo").glob("drafter-step-*"))
    assert len(exported) == 1 and (exported[0] / "model.safetensors").exists()
    # the demo's embedded Redis is stopped at the end; a later command of the run starts it again from its AOF
    server = EmbeddedRedis(str(out / "runs" / "demo"))
    assert server.pid() is None or not pid_running(server.pid())
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url(), socket_connect_timeout=1).ping()
    status = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--json", "--config", str(out / "run.toml")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    subprocess.run([sys.executable, "-m", "ops.cli", "redis", "stop", "--config", str(out / "run.toml")], cwd=ROOT, timeout=60)
    assert status.returncode == 0, status.stderr[-2000:]
    chunks = json.loads(status.stdout)["chunks"]
    assert chunks["admitted"] > 0 and chunks["finished"] == chunks["admitted"]
