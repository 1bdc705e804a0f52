"""`dflashq inspect` and `dflashq verify` on blobs a real worker wrote; verify must catch all-zero states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


import pytest

from dflashq.blob import decode_blob, encode_blob
from test_worker import ROOT, admit_sample_data, settings_for, worker_cmd


def cli(*args):
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_inspect_and_verify(tmp_path, redis_url, tiny_qwen35, codec):
    settings = settings_for(tmp_path, redis_url, tiny_qwen35, **{"store.codec": codec})
    run, report = admit_sample_data(settings, 30)
    assert subprocess.run(worker_cmd(settings, 0), cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    run_args = ["--run", "w", "--redis-url", redis_url, "--store", settings.store.path, "--model", tiny_qwen35,
                "-s", "data.max_length=512", "-s", "train.num_layers=3", "-s", f"store.codec={codec}"]
    blobs = sorted(Path(run.store.path("blobs", "e0")).glob("*.dfq"))

    shown = cli("inspect", "--json", str(blobs[0]))
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["metadata"]["layer_ids"] == "[1, 3, 5]" and set(info["layers"]) == {"1", "3", "5"}
    assert all(v["zero_fraction"] < 0.5 and v["non_finite"] == 0 for v in info["layers"].values())
    assert info["metadata"]["codec"] == codec
    if codec == "fp8":  # the encoder's measured error per layer, within e4m3's rounding
        assert all(0 < v["relative_error"] < 2 ** -4 for v in info["layers"].values())
        assert "relative_error" in cli("inspect", str(blobs[0])).stdout

    good = cli("verify", "--samples", "6", *run_args)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count(" ok") >= 3

    # an all-zero layer, as vLLM has silently produced: re-encode every blob with layer 3 zeroed
    for path in blobs:
        blob = decode_blob(path.read_bytes())
        hidden = blob.hidden.clone()
        hidden[:, 1] = 0
        meta = {"run": "w", "chunk_id": blob.chunk_id, "epoch": 0, "layer_ids": blob.layer_ids}
        path.write_bytes(b"".join(bytes(b) for b in encode_blob(hidden, blob.input_ids, blob.loss_mask, blob.offsets, meta,
                                                                sample_index=blob.sample_index, codec=codec)))
    bad = cli("verify", "--samples", "4", *run_args)
    assert bad.returncode == 1
    assert "all-zero" in bad.stdout and "layer(s) 3" in bad.stderr and "Traceback" not in bad.stderr

    blobs[0].write_bytes(blobs[0].read_bytes()[:100])
    broken = cli("inspect", str(blobs[0]))
    assert broken.returncode == 1 and "Traceback" not in broken.stderr and broken.stderr.count("\n") == 1
    assert cli("inspect", str(tmp_path / "nope.dfq")).returncode == 2
