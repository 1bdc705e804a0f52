"""The test session's own check (conftest.py): a test that leaves a process it started running fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

import conftest
from ops.redis_server import EmbeddedRedis


def test_a_daemonized_redis_and_a_child_are_found_until_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "EXIT_GRACE_S", 0.0)
    before = set(conftest.started_here())
    server = EmbeddedRedis(str(tmp_path))
    server.ensure()  # redis-server daemonizes: its parent is init, not this process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        left = conftest.left_running(before)
        assert server.pid() in left and "redis-server" in left[server.pid()]
        assert child.pid in left
    finally:
        server.stop()
        child.kill()
        child.wait()
    assert conftest.left_running(before) == {}


@pytest.mark.slow
def test_a_test_that_leaves_a_process_running_fails_and_the_process_is_ended(pytester):
    pytester.makeconftest((conftest.ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_leaves="""
        import subprocess, sys

        import conftest

        conftest.EXIT_GRACE_S = 0.5

        def test_leaves_a_sleeper(tmp_path):
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            (tmp_path.parent.parent / "pid").write_text(str(proc.pid))

        def test_after_it():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--basetemp", str(pytester.path / "tmp"))
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_leaves_a_sleeper left 1 process(es) running*time.sleep(600)*"])
    pid = int((pytester.path / "pid").read_text())
    assert not conftest._live_processes().get(pid)  # killed by the check: it does not outlive the test
