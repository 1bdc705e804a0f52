"""The embedded Redis as the CLI drives it: started on first use, reused by later commands, stopped on request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def dflashq(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_start_reuse_stop(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    store = ["--store", str(tmp_path), "--run", "emb"]
    started = dflashq("redis", "start", *store)
    assert started.returncode == 0, started.stderr
    url = started.stdout.strip()
    assert url.startswith("redis://127.0.0.1:")
    conn = redis.Redis.from_url(url)
    assert conn.config_get("appendonly")["appendonly"] == "yes"
    assert conn.config_get("appendfsync")["appendfsync"] == "always"
    assert Path(conn.config_get("dir")["dir"]) == (tmp_path / "emb" / "redis").resolve()
    assert dflashq("status", "--json", *store).returncode == 0
    assert dflashq("redis", "start", *store).stdout.strip() == url  # reused, not a second server
    stopped = dflashq("redis", "stop", *store)
    assert stopped.stdout.strip() == "stopped"
    assert dflashq("redis", "stop", *store).stdout.strip() == "not running"
