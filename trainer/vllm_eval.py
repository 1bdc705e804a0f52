"""`dflashq eval --engine vllm`: an exported drafter served by vLLM's offline engine beside its target, greedy, as
a user serves it (`speculative_config={"method": "dflash", ...}`, num_speculative_tokens = block_size - 1).

Two engines run, each in its own process (a clean GPU, spec-decode counters from zero): the target alone and the
target with the drafter. Each decodes the prompts at every asked concurrency (a closed loop: a finished request is
replaced by the next one), so tokens/s with and without the drafter compare at equal load.

tau is counted as `dflashq eval` counts it (trainer/evaluate.py), from vLLM's per-step output deltas: one engine
step is one target forward, i.e. one verification pass; the prefill's token is no pass's; vLLM stops a request at
EOS and max_tokens, so a pass counts only up to them. vLLM's own mean acceptance length (1 + accepted / drafts,
from its counters) pools every pass and also counts drafts accepted past EOS or max_tokens, so it reads higher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflashq import defaults
from dflashq.exceptions import DflashqError, InputError
from dflashq.vllm_target import engine_environment, prepare_target, require_vllm

ROOT = Path(__file__).resolve().parent.parent
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"


# --- counting, as dflashq eval counts ----------------------------------------------------------------------
def pass_counts(deltas: list[int]) -> list[int]:
    """Tokens committed by each verification pass, from the sizes of a request's per-step output deltas (empty
    steps, e.g. chunks of a long prefill, already left out): the first delta's first token is the prefill's."""
    if not deltas:
        return []
    first = [deltas[0] - 1] if deltas[0] > 1 else []
    return first + list(deltas[1:])


def tau(passes: list[int]) -> float:
    """Mean tokens per pass; 0.0 for a request that ended at its prefill token (as SpeculativeResult.tau)."""
    return sum(passes) / len(passes) if passes else 0.0


def drafter_block_size(drafter_dir: str | Path) -> int:
    config_file = Path(drafter_dir) / "config.json"
    if not config_file.is_file():
        raise InputError(f"drafter folder {drafter_dir} has no config.json; give a folder `dflashq export` wrote.")
    config = json.loads(config_file.read_text())
    block = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size")
    if not block or block < 2:
        raise InputError(f"drafter {drafter_dir} names no block_size of 2 or more in config.json; export it again.")
    return int(block)


def pass_costs(base: dict, spec: dict) -> dict:
    """What bounds the speedup at one concurrency: the time of an engine step of the target alone (a decode forward)
    and with the drafter (the drafter's forward, then the target verifying a block). Verifying a block costs at least
    a decode forward, so 1 - their ratio is at most the drafter's (and the spec-decode bookkeeping's) share of a pass;
    the speedup is tau times their ratio."""
    if not base.get("steps") or not spec.get("steps"):
        return {}
    target_ms, dflash_ms = 1000 * base["wall_s"] / base["steps"], 1000 * spec["wall_s"] / spec["steps"]
    return {"target_ms_per_step": round(target_ms, 3), "dflash_ms_per_step": round(dflash_ms, 3),
            "drafter_share_of_pass_at_most": round(max(0.0, 1 - target_ms / dflash_ms), 3)}


def summarize(target: dict, dflash: dict, texts: tuple[list[str], list[str]]) -> dict:
    """The report from the two engines' results (each: per level, token ids and deltas; dflash also counters)."""
    full = dflash["levels"][-1]  # the largest concurrency, which decodes every prompt
    passes = [pass_counts(d) for d in full["deltas"]]
    counters = dflash["counters"]
    drafts = counters["drafts"]
    target_texts, dflash_texts = texts
    identical = [a == b for a, b in zip(target_texts, dflash_texts)]
    speed = []
    for base, spec in zip(target["levels"], dflash["levels"]):
        speed.append({"concurrency": base["concurrency"], "prompts": base["prompts"],
                      "target_tokens_per_s": round(base["tokens"] / base["wall_s"], 1),
                      "dflash_tokens_per_s": round(spec["tokens"] / spec["wall_s"], 1),
                      "speedup": round((spec["tokens"] / spec["wall_s"]) / (base["tokens"] / base["wall_s"]), 3),
                      "target_wall_s": round(base["wall_s"], 2), "dflash_wall_s": round(spec["wall_s"], 2),
                      **pass_costs(base, spec)})
    all_passes = [n for p in passes for n in p]
    return {
        "engine": "vllm", "vllm_version": dflash["vllm_version"], "device": dflash["device"],
        "model_runner": dflash.get("model_runner"),
        "prompts": len(passes),
        "mean_tau": round(sum(map(tau, passes)) / len(passes), 4) if passes else 0.0,
        "tau_pooled": round(sum(all_passes) / len(all_passes), 4) if all_passes else 0.0,
        "vllm_mean_acceptance_length": round(1 + counters["accepted"] / drafts, 4) if drafts else None,
        "draft_acceptance_rate": round(counters["accepted"] / counters["draft_tokens"], 4) if counters["draft_tokens"] else None,
        "per_position_acceptance": [round(n / drafts, 4) for n in counters["accepted_per_pos"]] if drafts else [],
        "identical_text": sum(identical),
        "speed": speed,
        "init_seconds": {"target": round(target["init_s"], 1), "dflash": round(dflash["init_s"], 1)},
        "per_prompt": [{"tau": round(tau(p), 4), "passes": len(p), "new_tokens": len(t), "identical": same,
                        "text": text}
                       for p, t, same, text in zip(passes, full["token_ids"], identical, dflash_texts)],
    }


# --- the parent: tokenize, run both engines, compare ------------------------------------------------------
def evaluate_in_vllm(target: str, drafter_dir: str | Path, prompts: list[str | list[dict]], max_new_tokens: int,
                     concurrency: list[int] = (1,), speed_prompts: int | None = None, device: str = "cuda:0",
                     capture_states: int = 0, progress: bool = True) -> dict:
    """Speculative decoding of `prompts` in vLLM with the drafter, against the target alone; see the module.
    The largest concurrency decodes every prompt and gives tau, counters and text; smaller ones time only the first
    `speed_prompts` (None: all). `capture_states` N: also compare, on the first N prompts, the target hidden states
    vLLM hands the drafter with the ones dflashq extracts with Transformers (relative error per tapped layer)."""
    require_vllm()
    from transformers import AutoTokenizer

    from dflashq.target import eos_ids_of_folder
    from trainer.evaluate import chat_prompt_ids

    block = drafter_block_size(drafter_dir)
    tokenizer = AutoTokenizer.from_pretrained(target)
    stop = sorted(eos_ids_of_folder(target, tokenizer))
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    levels = sorted(set(int(c) for c in concurrency))
    if not prompt_ids or levels[0] < 1:
        raise InputError("eval --engine vllm needs at least one prompt and concurrencies of 1 or more.")
    with tempfile.TemporaryDirectory(prefix="dflashq-vllm-eval-") as work:
        model, extra = prepare_target(target, work)
        engine = {"model": model, "tokenizer": target, "dtype": "bfloat16", "seed": 0, "disable_log_stats": False,
                  "gpu_memory_utilization": defaults.VLLM_GPU_MEMORY_UTILIZATION,
                  "max_num_seqs": max(levels), **extra}
        job = {"engine": engine, "prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "stop": stop,
               "levels": levels, "speed_prompts": speed_prompts, "progress": progress,
               "speculative_config": {"method": "dflash", "model": str(Path(drafter_dir).resolve()),
                                      "num_speculative_tokens": block - 1}}
        results = {kind: _run_child(dict(job, kind=kind), work, device) for kind in ("target", "dflash")}
        states = None
        if capture_states:  # a comparison reaching into vLLM's internals: its failure costs the figures above nothing
            try:
                states = _run_child(dict(job, kind="capture", capture=capture_states, target_path=target,
                                         drafter=str(drafter_dir)), work, device)
            except DflashqError as exc:
                states = {"states": {"error": str(exc)}}
    full = [r["levels"][-1]["token_ids"] for r in (results["target"], results["dflash"])]
    texts = tuple([tokenizer.decode(ids) for ids in rows] for rows in full)  # as dflashq eval decodes
    report = {"target": str(target), "drafter": str(drafter_dir), "max_new_tokens": max_new_tokens,
              "num_speculative_tokens": block - 1, **summarize(results["target"], results["dflash"], texts)}
    if states is not None:
        report["hidden_states"] = states["states"]
    return report


def _run_child(job: dict, work: str, device: str) -> dict:
    """One engine in its own process; its vLLM log goes to a file, named in the error if it fails."""
    kind = job["kind"]
    job_file, out_file, log_file = (Path(work) / f"{name}-{kind}.json" for name in ("job", "out", "log"))
    job_file.write_text(json.dumps(dict(job, out=str(out_file))))
    env = {**os.environ, **engine_environment(),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if device.startswith("cuda:"):
        env.setdefault("CUDA_VISIBLE_DEVICES", device.split(":", 1)[1])
    if kind == "capture":  # the engine in this process, so the hook below reaches its model runner
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    keep = Path(tempfile.gettempdir()) / f"dflashq-vllm-{kind}.log"
    with open(log_file, "w") as log:
        done = subprocess.run([sys.executable, "-m", "trainer.vllm_eval", str(job_file)], stdout=log, stderr=None,
                              env=env, cwd=ROOT)
    if done.returncode != 0 or not out_file.is_file():
        keep.write_text(log_file.read_text())
        raise DflashqError(f"vLLM ({kind}) exited with {done.returncode}; its log is in {keep}.")
    return json.loads(out_file.read_text())


# --- a child: one engine ------------------------------------------------------------------------------------
def _closed_loop(engine, prompt_ids: list[list[int]], concurrency: int, params, tag: str, on_done=None):
    """Decode every prompt keeping `concurrency` requests in flight; per prompt the generated ids and the size of
    each step's non-empty output delta; the wall time and the engine steps taken (each one target forward)."""
    tokens = [[] for _ in prompt_ids]
    deltas = [[] for _ in prompt_ids]
    queue = iter(range(len(prompt_ids)))

    def add() -> bool:
        index = next(queue, None)
        if index is not None:
            engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt_ids[index]}, params)
        return index is not None

    start, steps = time.perf_counter(), 0
    for _ in range(concurrency):
        if not add():
            break
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            index = int(out.request_id.rsplit("-", 1)[1])
            new = list(out.outputs[0].token_ids)
            if new:
                tokens[index] += new
                deltas[index].append(len(new))
            if out.finished:
                add()
                if on_done:
                    on_done()
    return tokens, deltas, time.perf_counter() - start, steps


def _counters(llm) -> dict:
    totals = {name: 0 for name in SPEC_COUNTERS.values()}
    per_position: list[int] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION_COUNTER:
            values = list(metric.values)
            per_position += [0] * (len(values) - len(per_position))
            for i, value in enumerate(values):
                per_position[i] += int(value)
    return {**totals, "accepted_per_pos": per_position}


def _difference(after: dict, before: dict) -> dict:
    per_position = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
                    for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in SPEC_COUNTERS.values()}, "accepted_per_pos": per_position}


def _child(job_file: str) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    job = json.loads(Path(job_file).read_text())
    import vllm
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind

    kind = job["kind"]
    engine_args = dict(job["engine"])
    if kind != "target":
        engine_args["speculative_config"] = job["speculative_config"]
    if kind == "capture":  # every prompt token's state computed, not reused; no compilation for a few prompts
        engine_args.update(enable_prefix_caching=False, enforce_eager=True)
    started = time.perf_counter()
    llm = vllm.LLM(**engine_args)
    init_s = time.perf_counter() - started

    def params(max_tokens: int):
        return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=job["stop"],
                                   detokenize=False, output_kind=RequestOutputKind.DELTA)

    prompt_ids = job["prompt_ids"]
    if kind == "capture":
        result = {"states": _capture(llm, job, prompt_ids[: job["capture"]], params(2))}
        Path(job["out"]).write_text(json.dumps(result))
        return
    engine = llm.llm_engine
    _closed_loop(engine, prompt_ids[:1], 1, params(16), "warmup")  # first-call costs, outside every figure
    config = getattr(engine, "vllm_config", None)
    result = {"vllm_version": vllm.__version__, "device": current_platform.get_device_name(), "init_s": init_s,
              "model_runner": "v2" if getattr(config, "use_v2_model_runner", False) else "v1", "levels": []}
    before = _counters(llm) if kind == "dflash" else None
    columns = (TextColumn(f"vllm {kind}" + " c={task.fields[c]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("prompts"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not job["progress"]) as bar:
        for level in job["levels"]:
            last = level == job["levels"][-1]
            rows = prompt_ids if last or not job["speed_prompts"] else prompt_ids[: job["speed_prompts"]]
            if last and before is not None:
                before = _counters(llm)
            task = bar.add_task("decode", total=len(rows), c=level)
            tokens, deltas, wall, steps = _closed_loop(engine, rows, level, params(job["max_new_tokens"]),
                                                       f"c{level}", lambda: bar.advance(task))
            entry = {"concurrency": level, "prompts": len(rows), "tokens": sum(map(len, tokens)), "wall_s": wall,
                     "steps": steps}
            if last:
                entry.update(token_ids=tokens, deltas=deltas)
            result["levels"].append(entry)
    if kind == "dflash":
        result["counters"] = _difference(_counters(llm), before)
    Path(job["out"]).write_text(json.dumps(result))


def _capture(llm, job: dict, prompt_ids: list[list[int]], params) -> dict:
    """The states vLLM's drafter receives for each prompt's prefill (the input of its combine_hidden_states: the
    tapped layers side by side), against HiddenStateCapture on the Transformers target for the same tokens."""
    import torch

    from dflashq.capture import HiddenStateCapture
    from dflashq.target import load_target
    from trainer.export import load_exported

    seen: list = []

    def hook(worker) -> None:
        runner = worker.model_runner
        proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        draft = proposer.model
        combine = draft.combine_hidden_states

        def recording(hidden_states):
            seen.append(hidden_states.detach().float().cpu())
            return combine(hidden_states)

        draft.combine_hidden_states = recording

    llm.collective_rpc(hook)
    layer_ids = list(load_exported(job["drafter"], "cpu").config.target_layer_ids)
    target = load_target(job["target_path"], "cuda", "bfloat16")
    capture = HiddenStateCapture(target, layer_ids)
    errors = []
    for index, ids in enumerate(prompt_ids):
        seen.clear()
        _closed_loop(llm.llm_engine, [ids], 1, params, f"capture{index}")
        ours = capture.capture(torch.tensor([ids], device="cuda"))[0].float().cpu()  # [P, K, H]
        theirs = seen[0][: len(ids)].reshape(len(ids), len(layer_ids), -1)  # [P, K, H]: the prefill's rows
        norms = ours.norm(dim=(0, 2))
        errors.append(((theirs - ours).norm(dim=(0, 2)) / norms).tolist())
    per_layer = torch.tensor(errors).mean(0).tolist()  # [K]
    return {"layer_ids": layer_ids, "prompts": len(prompt_ids),
            "relative_error_per_layer": [round(e, 5) for e in per_layer],
            "relative_error_per_prompt": [[round(e, 5) for e in row] for row in errors]}


if __name__ == "__main__":
    _child(sys.argv[1])
