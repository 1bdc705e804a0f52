"""An out-of-memory training step under `dflashq up`: the trainer exits with TrainerOutOfMemory's code and sentence,
`up` starts it again up to defaults.OUT_OF_MEMORY_RETRIES times in a row, and stops the run only when it keeps
running out.

CI has no GPU to fill, and a CPU allocation that fails raises a plain RuntimeError, so the error is raised where a
GPU raises it: inside the drafter's real forward. A sitecustomize module on PYTHONPATH (Python's start-up hook) adds,
in processes that run `train`, a global forward pre-hook (torch.nn.modules.module.register_module_forward_pre_hook)
that raises torch.OutOfMemoryError in the first forward of the first N trainer starts, counted down in a file.
Everything after the raise is the project's own: the step's error, the CLI's sentence and exit code, the
supervisor's retries, the restarted trainer's resume from the stream and its checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflashq import defaults
from dflashq.keys import Keys
from dflashq.settings import load as load_settings
from test_trainer import final_state, stream_chunk_ids
from test_up import ROOT, write_config

SITECUSTOMIZE = '''
import os
import sys

if "train" in sys.orig_argv:
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    def out_of_memory(module, args):
        if type(module).__name__ != "DFlashDrafter":
            return
        path = os.environ["DFLASHQ_TEST_OUT_OF_MEMORY_STARTS"]
        with open(path) as f:
            left = int(f.read())
        if left > 0:
            with open(path, "w") as f:
                f.write(str(left - 1))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    register_module_forward_pre_hook(out_of_memory)
'''


def up_whose_trainer_runs_out(tmp_path, redis_url, model, starts: int) -> tuple[subprocess.CompletedProcess, Path]:
    """`dflashq up` (one CPU worker) whose first `starts` trainer processes run out of memory in their first step."""
    from producers.sample_data import write_sample_data

    write_sample_data(tmp_path / "data.jsonl", n=8)
    config = write_config(tmp_path, redis_url, model)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counter = tmp_path / "out-of-memory-starts"
    counter.write_text(str(starts))
    env = {**os.environ, "DFLASHQ_TEST_OUT_OF_MEMORY_STARTS": str(counter),
           "PYTHONPATH": os.pathsep.join(p for p in [str(hook), os.environ.get("PYTHONPATH", "")] if p)}
    up = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--config", str(config), "--workers", "1", "--no-live"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return up, counter


def test_up_starts_a_trainer_that_ran_out_of_memory_again_and_finishes_the_run(tmp_path, redis_url, tiny_qwen35):
    up, counter = up_whose_trainer_runs_out(tmp_path, redis_url, tiny_qwen35, starts=2)
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    assert counter.read_text() == "0"  # both out-of-memory starts happened
    said = up.stdout + up.stderr
    tries = [f"trainer ran out of memory (try {n} of {defaults.OUT_OF_MEMORY_RETRIES + 1})" for n in (1, 2, 3)]
    assert tries[0] in said and tries[1] in said and tries[2] not in said, said[-3000:]
    log = (tmp_path / "store" / "up" / "logs" / "trainer.log").read_text()  # the sentence `up` repeats, whole
    assert log.count("dflashq: The trainer ran out of memory on cpu with") == 2 and "Traceback" not in log
    assert "lower train.micro_batch_tokens (now 1024) or train.num_anchors (now 4)" in log
    settings = load_settings(write_config(tmp_path, redis_url, tiny_qwen35))
    trained = final_state(settings).consumed[0]
    from dflashq.run import Run

    run = Run.open(settings, join=False)
    assert sorted(trained) == sorted(set(trained)) == stream_chunk_ids(run.conn, Keys("up"), 0) != []  # each once


def test_up_stops_the_run_when_the_trainer_keeps_running_out_of_memory(tmp_path, redis_url, tiny_qwen35):
    up, counter = up_whose_trainer_runs_out(tmp_path, redis_url, tiny_qwen35, starts=100)
    assert up.returncode == 2, (up.stdout[-3000:], up.stderr[-3000:])
    tries = defaults.OUT_OF_MEMORY_RETRIES + 1
    assert int(counter.read_text()) == 100 - tries  # started that many times, then no more
    assert (f"trainer stopped the run after running out of memory {tries} times in a row: The trainer ran out of "
            "memory on cpu with") in up.stderr
    assert "Traceback" not in up.stderr
