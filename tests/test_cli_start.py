"""The operator's commands start without torch, transformers or model code: they answer in a fraction of a second
even while a GPU job loads. Each check runs in a fresh interpreter and reads its sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("torch", "transformers", "safetensors", "producers", "trainer", "workers.extract", "workers.worker")

PROBE = """
import json, sys
from ops.cli import main
codes = {}
for args in json.loads(sys.argv[1]):
    try:
        codes[" ".join(args)] = main(args, prog_name="dflashq", standalone_mode=False) or 0  # ctx.exit(n) returns n
    except SystemExit as exc:
        codes[" ".join(args)] = exc.code
for module in json.loads(sys.argv[2]):
    __import__(module)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "transformers", "safetensors", "producers", "trainer"}
               or m in {"workers.extract", "workers.worker"})
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def probe(commands: list[list[str]], modules: list[str] = ()) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands), json.dumps(list(modules))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_of_the_cli_pulls_in_no_torch():
    out = subprocess.run([sys.executable, "-c", "import json, sys, ops.cli; print(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(out.stdout))
    assert "ops.cli.operate" in loaded  # the probe saw the CLI itself
    assert not [m for m in loaded if m.split(".")[0] in {"torch", "transformers", "safetensors", "trainer", "producers"}]


def test_operator_commands_run_without_torch(redis_url, tmp_path):
    run = ["--redis-url", redis_url, "--store", str(tmp_path / "store"), "--run", "ops"]
    helps = [["--help"], *([name, "--help"] for name in ("status", "pause", "resume", "drain", "requeue", "restart-worker",
                                                         "dashboard", "report", "up", "train", "worker", "eval", "regenerate",
                                                         "produce", "export", "inspect", "verify", "demo", "tiny-model"))]
    embedded = ["--store", str(tmp_path / "embedded"), "--run", "ops"]
    commands = [*helps, ["status", "--json", *run], ["status", *run], ["pause", *run], ["resume", "w1", *run], ["drain", *run],
                ["requeue", "--failed", *run], ["report", "--out", str(tmp_path / "r.png"), *run],
                ["redis", "start", *embedded], ["status", "--json", *embedded], ["redis", "stop", *embedded]]
    result = probe(commands, ["ops.dashboard", "ops.control", "ops.report"])
    assert result["codes"] == {" ".join(args): 0 for args in commands}
    assert (tmp_path / "r.png").is_file()
    assert result["heavy"] == []


def test_an_unknown_worker_is_a_sentence_without_torch(redis_url, tmp_path):
    result = probe([["restart-worker", "nobody", "--redis-url", redis_url, "--store", str(tmp_path), "--run", "ops"]])
    assert result["codes"] == {f"restart-worker nobody --redis-url {redis_url} --store {tmp_path} --run ops": 2}
    assert result["heavy"] == []


def test_the_probe_sees_torch_when_a_command_loads_it(tmp_path):
    """The check can fail: `inspect` decodes a blob and so needs torch."""
    result = probe([["inspect", str(tmp_path / "missing.dfq")]])
    assert "torch" in result["heavy"]
