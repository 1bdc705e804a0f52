"""Commands of the training side: train, export, eval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from dflashq.exceptions import DflashqError
from ops.cli.options import console, run_options
from ops.redis_server import open_run, resolve_url

# --- trainer ------------------------------------------------------------------------------------------------
@click.command()
@run_options
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when a GPU is visible); ranks on GPUs take cuda:LOCAL_RANK.")
@click.option("--ranks", type=click.IntRange(min=1), default=None,
              help="Train one drafter on N ranks of this node through torch's launcher (under torchrun: leave it out).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --ranks: times the group is started again after a rank died (from its checkpoint).")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps (then checkpoint).")
@click.option("--no-progress", is_flag=True)
def train(settings, device, ranks, max_restarts, max_steps, no_progress):
    """Run the trainer daemon: consume blobs, train the drafter, checkpoint, until the epochs are done."""
    from dflashq.compile_cache import use_run_cache
    from dflashq.store import Store

    use_run_cache(Store(settings.store.path, settings.run))  # before anything compiles: a restart reuses the kernels
    import torch

    from dflashq.exceptions import ConfigError
    from trainer.daemon import Trainer
    from trainer.ranks import Ranks, launched

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ranks is not None and launched():
        raise ConfigError("This trainer is already a rank of a torch launcher (RANK, WORLD_SIZE, LOCAL_RANK and "
                          "MASTER_ADDR are set): leave out --ranks, the launcher's --nproc-per-node gives their number.")
    if ranks is not None and ranks > 1:
        from ops.launch import launch_ranks

        settings.redis.url = resolve_url(settings)
        args = ["--device", device, *(["--max-steps", str(max_steps)] if max_steps is not None else []),
                *(["--no-progress"] if no_progress else [])]
        sys.exit(launch_ranks(settings, ranks, args, max_restarts))
    me = Ranks.from_environment()
    device = me.device(device)
    with me.joined(device, settings.train.rank_timeout_seconds):
        report = Trainer(open_run(settings), str(device), progress=not no_progress, ranks=me).run_until_done(max_steps)
    if not me.leader:  # rank 0 reports for the group
        return
    table = Table(title=f"trainer of run '{settings.run}'" + (" (stopped)" if report.stopped else " (done)"), show_header=False)
    table.add_row("steps", str(report.steps))
    table.add_row("ranks", str(me.world_size))
    table.add_row("epochs done", f"{report.epochs_done} / {settings.train.epochs}")
    for epoch in sorted(report.consumed):
        table.add_row(f"epoch {epoch}", f"{report.consumed[epoch]} chunks trained, {report.duplicates_skipped.get(epoch, 0)} duplicates skipped")
    if report.last_loss is not None:
        table.add_row("last loss / EAL", f"{report.last_loss:.4f} / {report.last_eal:.3f}")
    table.add_row("checkpoint", str(report.checkpoint))
    console.print(table)


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out", type=click.Path())
def export(checkpoint, out):
    """Export a trainer checkpoint (or a run's checkpoints folder: its latest) in the z-lab DFlash format
    that vLLM, SGLang and the `dflash` package load."""
    from dflashq.exceptions import InputError
    from trainer import checkpoint as checkpoints
    from trainer.export import export_checkpoint

    source = Path(checkpoint)
    if not (source / "state.json").exists():
        source = checkpoints.latest(source)
        if source is None:
            raise InputError(f"{checkpoint} is neither a checkpoint nor a checkpoints folder with one: give <store>/<run>/checkpoints.")
    click.echo(export_checkpoint(source, out))


@click.command("eval")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(), help="Exported drafter folder.")
@click.option("--model", "target", required=True, type=click.Path(), help="Target model folder.")
@click.option("--data", "prompts_file", type=click.Path(), help="Prompts JSONL (`prompt` or `messages` per line).")
@click.option("--blobs", "blob_paths", multiple=True, type=click.Path(), help="Held-out blobs (files or folders): offline EAL.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--num-anchors", default=512, show_default=True, help="Anchors per sample with --blobs.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--check-lossless", "lossless_prompts", type=int, default=None,
              help="Compare only the first N prompts with plain greedy decoding (it costs a forward per token). [all]")
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers", show_default=True,
              help="vllm: the drafter served by vLLM beside the target (the `vllm` extra, a CUDA GPU); tau, "
                   "acceptance per position and tokens/s with and without it.")
@click.option("--concurrency", type=click.IntRange(min=1), multiple=True,
              help="vLLM: requests in flight to time besides 1 (repeatable); the largest decodes every prompt.")
@click.option("--speed-prompts", type=click.IntRange(min=1), default=None,
              help="vLLM: time the smaller concurrencies on the first N prompts only. [all]")
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-progress", is_flag=True, help="No progress bar (logs, CI).")
def evaluate(drafter_dir, target, prompts_file, blob_paths, max_new_tokens, num_anchors, device, lossless_prompts,
             engine, concurrency, speed_prompts, as_json, no_progress):
    """Measure a drafter: real greedy speculative decoding on prompts (tau, lossless check), or EAL on blobs."""
    if engine == "vllm":
        return _evaluate_in_vllm(drafter_dir, target, prompts_file, max_new_tokens, device, concurrency,
                                 speed_prompts, as_json, no_progress)
    from dflashq.blob import decode_blob
    from dflashq.exceptions import InputError
    from trainer.evaluate import evaluate_blobs, evaluate_prompts, read_prompts
    from trainer.export import load_exported
    from trainer.target_head import TargetHead

    if bool(prompts_file) == bool(blob_paths):
        raise click.UsageError("Give either --data PROMPTS.jsonl or --blobs PATH...")
    if prompts_file:
        report = evaluate_prompts(target, drafter_dir, read_prompts(prompts_file), max_new_tokens, device,
                                  lossless_prompts, progress=not no_progress)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            table = Table(title=f"speculative decoding: mean tau {report['mean_tau']:.3f}, lossless {report['lossless']} "
                                f"({report['lossless_checked']} of {len(report['prompts'])} prompts checked)")
            for col in ("prompt", "tau", "target passes", "new tokens", "lossless"):
                table.add_column(col)
            for i, r in enumerate(report["prompts"]):
                table.add_row(str(i), f"{r['tau']:.3f}", str(r["passes"]), str(r["new_tokens"]), str(r["lossless"]))
            console.print(table)
            console.print(f"acceptance per draft position: {report['per_position_acceptance']}")
        if not report["lossless"]:
            raise DflashqError("Speculative output differs from plain greedy decoding: this is a bug, please report it with the prompts.")
        return
    files = [p for path in map(Path, blob_paths) for p in (sorted(path.glob("**/*.dfq")) if path.is_dir() else [path])]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or not files:
        raise InputError(f"No blob at {', '.join(missing) or ', '.join(blob_paths)}: give .dfq files or folders holding them.")
    drafter = load_exported(drafter_dir, device)
    head = TargetHead.from_pretrained(target, dtype=next(drafter.parameters()).dtype, device=device)
    report = evaluate_blobs(drafter, head, [decode_blob(p.read_bytes()) for p in files], num_anchors)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        console.print(f"{report['samples']} samples: loss {report['loss']:.4f}, EAL {report['eal']:.3f}, "
                      f"acc per slot {[round(a, 3) for a in report['acc']]}")


def _evaluate_in_vllm(drafter_dir, target, prompts_file, max_new_tokens, device, concurrency, speed_prompts, as_json,
                      no_progress):
    from dflashq.vllm_target import require_vllm
    from trainer.evaluate import read_prompts

    if not prompts_file:
        raise click.UsageError("--engine vllm decodes prompts: give --data PROMPTS.jsonl.")
    prompts = read_prompts(prompts_file)  # a wrong path fails before vLLM is asked for
    require_vllm()
    from trainer.vllm_eval import evaluate_in_vllm

    report = evaluate_in_vllm(target, drafter_dir, prompts, max_new_tokens, [1, *concurrency], speed_prompts,
                              "cuda:0" if device == "cpu" else device, progress=not no_progress)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console.print(f"vLLM {report['vllm_version']} on {report['device']}, {report['prompts']} prompts, "
                  f"{report['num_speculative_tokens']} draft tokens per pass")
    console.print(f"mean tau {report['mean_tau']:.3f} (per prompt, as dflashq eval counts); vLLM's mean acceptance "
                  f"length {report['vllm_mean_acceptance_length']}; identical text with and without the drafter: "
                  f"{report['identical_text']} of {report['prompts']}")
    console.print(f"acceptance per draft position: {report['per_position_acceptance']}")
    table = Table(title="generated tokens/s")
    for col in ("concurrency", "prompts", "target alone", "with drafter", "speedup", "ms/step alone",
                "ms/step with drafter", "drafter's share of a pass, at most"):
        table.add_column(col)
    for row in report["speed"]:
        table.add_row(str(row["concurrency"]), str(row["prompts"]), f"{row['target_tokens_per_s']:,.0f}",
                      f"{row['dflash_tokens_per_s']:,.0f}", f"{row['speedup']:.2f}x",
                      *(f"{row[k]:.2f}" if k in row else "-" for k in ("target_ms_per_step", "dflash_ms_per_step",
                                                                         "drafter_share_of_pass_at_most")))
    console.print(table)


COMMANDS = [train, export, evaluate]
