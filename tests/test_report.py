"""The run report PNG, from a real Redis results stream and a trainer log JSONL written as the trainer writes it."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from dflashq import settings as S
from dflashq.run import Run
from ops.report import read_extractions, read_train_log, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(redis_url, tmp_path) -> Run:
    settings = S.load(None, [("run", "rep"), ("redis.url", redis_url), ("store.path", str(tmp_path))], environ={})
    return Run.open(settings, join=False)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_report_of_a_run_with_extractions_and_training(redis_url, conn, tmp_path):
    run = _run(redis_url, tmp_path)
    start_ms = int(time.time() * 1000) - 600_000
    for i in range(300):  # ten minutes of extraction, two workers
        conn.xadd(run.keys.results, {"chunk": f"c{i}", "path": f"/x/c{i}.dfq", "tokens": 4096, "samples": 8,
                                     "bytes": 1 << 20, "epoch": 0, "worker": f"host.gpu{i % 2}"}, id=f"{start_ms + 2000 * i}-0")
    log = Path(run.store.path(run.settings.train.log_file))
    log.parent.mkdir(parents=True)
    lines = [{"event": "resumed", "step": 0, "checkpoint": "none"}]
    for step in range(1, 201):
        lines.append({"step": step, "epoch": 0, "chunk": f"c{step}", "loss": 5.0 / step, "acc": [0.8, 0.6, 0.4, 0.2],
                      "eal": 1 + step / 100, "lr": 1e-4, "grad_norm": 1.0, "tokens": 4096, "time": start_ms / 1000 + 3 * step})
    log.write_text("\n".join(json.dumps(line) for line in lines) + '\n{"step": 201, "lo')  # last line cut by a crash

    records = read_train_log(run)
    assert [r["step"] for r in records] == list(range(1, 201))
    times, tokens = read_extractions(run)
    assert len(times) == 300 and tokens.sum() == 300 * 4096 and times[1] - times[0] == 2.0

    out = write_report(run, tmp_path / "reports" / "run.png")
    assert out == tmp_path / "reports" / "run.png"
    width, height = _png_size(out)
    assert (width, height) == (1400, 1200)
    assert out.stat().st_size > 50_000  # curves drawn, not an empty canvas


def test_step_time_medians_over_the_steps_that_log_them():
    from ops.report import step_time_medians

    records = [{"step": 1}] + [{"step": i, "seconds": {"between": 0.1 * i, "read": 0.2, "compute": i}} for i in (2, 3, 4)]
    assert step_time_medians(records) == pytest.approx({"between": 0.3, "read": 0.2, "compute": 3.0})
    assert step_time_medians([{"step": 1}]) == {}


def test_extractions_are_read_across_xrange_pages(redis_url, conn, tmp_path):
    from ops.report import XRANGE_PAGE

    run = _run(redis_url, tmp_path)
    pipe = conn.pipeline(transaction=False)
    for i in range(XRANGE_PAGE + 3):
        pipe.xadd(run.keys.results, {"chunk": f"c{i}", "tokens": i + 1})
    pipe.execute()
    times, tokens = read_extractions(run)
    assert list(tokens) == list(range(1, XRANGE_PAGE + 4))
    assert (times[1:] >= times[:-1]).all()


def test_report_of_an_empty_run(redis_url, tmp_path):
    run = _run(redis_url, tmp_path)
    log = Path(run.store.path(run.settings.train.log_file))
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"event": "resumed", "step": 0, "checkpoint": "none"}) + "\n")  # events only, no step yet
    assert read_train_log(run) == []
    out = write_report(run, tmp_path / "empty.png")
    assert _png_size(out) == (1400, 1200)
