"""Run configuration, its precedence, and the run manifest's refusal of mismatched commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflashq import settings as S
from dflashq.exceptions import ConfigError, ManifestMismatch
from dflashq.manifest import expected, join
from dflashq.store import Store

ROOT = Path(__file__).resolve().parent.parent


def test_example_config_loads_and_resolves_paths_relative_to_it():
    s = S.load(ROOT / "examples" / "run.toml", environ={})
    assert s.run == "qwen36-drafter"
    assert s.backpressure.max_store_bytes == 50 * 1024**3
    assert s.data.paths == [str(ROOT / "examples" / "data" / "train.jsonl")]
    assert s.model.layer_ids == []


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('run = "a"\n[backpressure]\nmax_backlog = 10\n[model]\nlayer_ids = [1, 2]\n')
    assert S.load(cfg, environ={}).backpressure.max_backlog == 10
    env = {"DFLASHQ_BACKPRESSURE_MAX_BACKLOG": "20", "REDIS_URL": "redis://x:1/0", "DFLASHQ_MODEL_LAYER_IDS": "3,4"}
    s = S.load(cfg, environ=env)
    assert (s.backpressure.max_backlog, s.redis.url, s.model.layer_ids) == (20, "redis://x:1/0", [3, 4])
    s = S.load(cfg, [("backpressure.max_backlog", "30"), ("redis.url", "redis://y:2/0")], environ=env)
    assert (s.backpressure.max_backlog, s.redis.url) == (30, "redis://y:2/0")
    assert S.load(None, environ={}).backpressure.max_backlog == S.defaults.MAX_BACKLOG


@pytest.mark.parametrize(
    "text, words",
    [
        ("[nosuch]\nx = 1\n", "unknown section [nosuch]"),
        ("[data]\nmax_lenght = 5\n", "Unknown setting 'data.max_lenght'"),
        ("[data]\nmax_length = 'long'\n", "data.max_length"),
        ('run = "bad name"\n', "Run name"),
        ("[store]\nretention = 'forever'\n", "store.retention"),
        ("[data\n", "not valid TOML"),
    ],
)
def test_bad_config_is_one_sentence(tmp_path, text, words):
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        S.load(cfg, environ={})
    assert words in str(info.value) and "\n" not in str(info.value)


def test_manifest_refuses_mismatched_join_and_remembers_on_disk(conn, tmp_path):
    settings = S.load(None, [("run", "m"), ("store.path", str(tmp_path))], environ={})
    store = Store(settings.store.path, "m")
    first = join(conn, store, expected(settings, [1, 5], "abc"))
    assert first["layer_ids"] == [1, 5]
    assert json.loads(Path(store.path("run.json")).read_text())["layer_ids"] == [1, 5]
    join(conn, store, expected(settings, None, None))  # a command that knows less may join
    with pytest.raises(ManifestMismatch, match="layer_ids"):
        join(conn, store, expected(settings, [1, 6], "abc"))
    settings.data.max_length = 99
    with pytest.raises(ManifestMismatch, match="max_length"):
        join(conn, store, expected(settings, [1, 5], "abc"))
    conn.flushdb()  # Redis lost everything: run.json still guards the run
    with pytest.raises(ManifestMismatch, match="max_length"):
        join(conn, store, expected(settings, [1, 5], "abc"))


def test_a_run_refuses_a_second_codec_also_when_started_before_codecs(conn, tmp_path):
    settings = S.load(None, [("run", "c"), ("store.path", str(tmp_path))], environ={})
    store = Store(settings.store.path, "c")
    assert join(conn, store, expected(settings, [1, 5], "abc"))["codec"] == "bf16"
    fp8 = S.load(None, [("run", "c"), ("store.path", str(tmp_path)), ("store.codec", "fp8")], environ={})
    with pytest.raises(ManifestMismatch, match="codec = 'bf16' but this command has 'fp8'"):
        join(conn, store, expected(fp8, [1, 5], "abc"))
    # a manifest written before the codec field: its blobs are bf16
    legacy = {k: v for k, v in json.loads(Path(store.path("run.json")).read_text()).items()
              if k not in ("codec", "blob_format_version")}
    conn.flushdb()
    Path(store.path("run.json")).write_text(json.dumps(legacy))
    with pytest.raises(ManifestMismatch, match="codec"):
        join(conn, store, expected(fp8, [1, 5], "abc"))
    assert join(conn, store, expected(settings, [1, 5], "abc"))["codec"] == "bf16"
    with pytest.raises(ConfigError, match="store.codec must be"):
        S.load(None, [("store.codec", "int4")], environ={})


@pytest.mark.slow
def test_cli_reports_config_errors_without_traceback(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[data]\nmax_length = 'long'\n")
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--config", str(cfg)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "data.max_length" in proc.stderr
