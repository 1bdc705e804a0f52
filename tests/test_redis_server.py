"""The embedded Redis as the CLI drives it: started on first use, reused by later commands, stopped on request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent


def dflashq(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.mark.slow
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


def test_outage_watch_and_the_client_ride_through_a_restart(tmp_path, capfd):
    """What `status --watch` and `up`'s view read (a probe that never waits), and the run's own client: it says once
    that Redis is gone and once that it is back, heals the embedded server, and returns the command's answer."""
    import time

    from dflashq.connection import connect, outage_since
    from ops.redis_server import EmbeddedRedis
    from ops.status import OutageWatch

    server = EmbeddedRedis(str(tmp_path))
    url = server.ensure()
    try:
        conn = connect(url, outage_seconds=60, heal=server.ensure)
        conn.set("k", "v")
        watch = OutageWatch(url, 60)
        assert not watch.down() and watch.since is None
        server.kill()
        assert watch.down() and watch.since is not None and not watch.given_up
        assert "is unreachable since" in watch.render().plain and "redis.outage_seconds" in watch.render().plain
        started = time.monotonic()
        assert conn.get("k") == b"v"  # retried until healed: the embedded server restarted from its AOF
        assert time.monotonic() - started < 30 and outage_since(conn) is None and not watch.down()
        err = capfd.readouterr().err
        assert err.count("is unreachable") == 1 and err.count("is back after") == 1
        server.kill()
        gone = connect(url, check=False, outage_seconds=1)  # no healing: past outage_seconds the error surfaces
        try:
            gone.get("k")
        except redis.ConnectionError:
            pass
        else:
            raise AssertionError("a Redis down for longer than outage_seconds must raise")
    finally:
        server.stop()


def test_stopped_at_end_stops_the_embedded_redis_however_the_block_ends_and_leaves_the_users_alone(tmp_path, redis_url):
    """What the demo and benchmarks/quality.py wrap their work in: the run's embedded Redis, started inside, is
    stopped when the block ends, also on an exception (Ctrl-C included); a later command starts it again from its AOF.
    A Redis the user named (REDIS_URL) stays up."""
    from dflashq import settings as S
    from ops.redis_server import EmbeddedRedis, resolve_url, stopped_at_end

    settings = S.load(None, [("run", "emb"), ("store.path", str(tmp_path))], environ={})
    server = EmbeddedRedis(settings.run_dir)
    for raised in (None, KeyboardInterrupt):
        try:
            with stopped_at_end(settings):
                settings.redis.url = resolve_url(settings)  # as open_run does: the embedded server started here
                redis.Redis.from_url(settings.redis.url).incr("k")
                if raised:
                    raise raised
        except KeyboardInterrupt:
            pass
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url(), socket_connect_timeout=1).ping()
        settings.redis.url = ""
    try:
        assert redis.Redis.from_url(server.ensure()).get("k") == b"2"  # back from its AOF
    finally:
        server.stop()
    users = S.load(None, [("run", "emb"), ("store.path", str(tmp_path))], environ={"REDIS_URL": redis_url})
    with stopped_at_end(users):
        pass
    assert redis.Redis.from_url(redis_url).ping()
