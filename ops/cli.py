"""The `dflashq` command line: a thin layer over the Python API of producers/, workers/, trainer/ and ops/."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.table import Table

from dflashq import defaults, settings as settings_module
from dflashq.connection import redact
from dflashq.exceptions import DflashqError
from dflashq.run import Run
from ops import redis_server, status as status_module

console = Console()


class Cli(click.Group):
    """Errors a user can cause end in one sentence and an exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DflashqError as exc:
            click.echo(f"dflashq: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except redis.ConnectionError as exc:
            click.echo(f"dflashq: lost the connection to Redis ({exc}): check that it is running, then run the command again.", err=True)
            ctx.exit(2)


def run_options(func):
    """--config, --set and the most used keys as their own flags; each maps onto a settings key."""

    @click.option("--config", "-c", type=click.Path(dir_okay=False), envvar="DFLASHQ_CONFIG", help="Run configuration TOML file.")
    @click.option("--set", "-s", "sets", multiple=True, metavar="SECTION.KEY=VALUE", help="Override any setting (repeatable).")
    @click.option("--run", "run_name", help="Run name (key `run`).")
    @click.option("--redis-url", help="Redis URL (key redis.url); empty: the run's embedded Redis.")
    @click.option("--store", help="Store directory or fsspec URL (key store.path).")
    @click.option("--model", help="Target model folder (key model.path).")
    @functools.wraps(func)
    def wrapper(config, sets, run_name, redis_url, store, model, **kwargs):
        overrides = []
        for item in sets:
            key, sep, value = item.partition("=")
            if not sep:
                raise click.BadParameter(f"'{item}' is not SECTION.KEY=VALUE", param_hint="--set")
            overrides.append((key.strip(), value))
        for key, value in (("run", run_name), ("redis.url", redis_url), ("store.path", store), ("model.path", model)):
            if value is not None:
                overrides.append((key, value))
        return func(settings_module.load(config, overrides), **kwargs)

    return wrapper


def open_run(settings, **kwargs) -> Run:
    settings.redis.url = redis_server.resolve_url(settings)
    return Run.open(settings, **kwargs)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflashq")
def main():
    """dflashq: extract target hidden states with Transformers GPU workers over Redis/RQ and train DFlash drafters."""


# --- produce ------------------------------------------------------------------------------------------------
@main.command()
@run_options
@click.argument("inputs", nargs=-1, type=click.Path())
@click.option("--epochs", type=int, help="Epochs to admit (default: train.epochs with retention=delete, else 1).")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs, CI).")
def produce(settings, inputs, epochs, no_progress):
    """Tokenize conversations and admit prompt chunks to the queue, under the backlog limits."""
    from producers.produce import produce as run_produce
    from producers.records import data_fingerprint

    if inputs:
        settings.data.paths = list(inputs)
    run = open_run(settings, data_fingerprint=data_fingerprint(settings.data.paths), with_layers=False)
    report = run_produce(run, epochs=epochs, progress=not no_progress)
    table = Table(title=f"produced into run '{settings.run}'", show_header=False)
    for field in ("records", "kept", "rejected", "truncated", "dropped_too_long", "dropped_few_supervised",
                  "chunks", "admitted", "duplicates", "already_stored", "tokens"):
        table.add_row(field.replace("_", " "), str(getattr(report, field)))
    table.add_row("tokens/s", f"{report.tokens_per_second:,.0f}")
    if report.rejected:
        table.add_row("rejects file", run.store.path(settings.data.rejects_file))
        table.add_row("reject reasons", ", ".join(f"{k}: {v}" for k, v in sorted(report.reasons.items())))
    console.print(table)


# --- status -------------------------------------------------------------------------------------------------
@main.command()
@run_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable interface, see README).")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until Ctrl-C.")
def status(settings, as_json, watch):
    """Chunks admitted / queued / started / finished / failed, backlog, store bytes, workers, trainer, ETA."""
    import time

    from rich.live import Live

    run = open_run(settings, join=False)
    if as_json:
        click.echo(json.dumps(status_module.collect(run), indent=2))
        return
    if not watch:
        console.print(status_module.render(status_module.collect(run), redact(settings.redis.url)))
        return
    with Live(console=console, refresh_per_second=1) as live:
        try:
            while True:
                live.update(status_module.render(status_module.collect(run), redact(settings.redis.url)))
                time.sleep(2)
        except KeyboardInterrupt:
            pass


# --- workers ------------------------------------------------------------------------------------------------
@main.command()
@run_options
@click.option("--gpu", type=int, help="GPU index: the worker runs on cuda:N and is named <host>.gpuN.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="cpu: run on the CPU (named <host>.cpuN).")
@click.option("--index", type=int, default=0, show_default=True, help="Worker index with --device cpu.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty (tests, one-off jobs).")
def worker(settings, gpu, device, index, burst):
    """Run one long-lived extraction worker: loads the target once, then extracts chunks until stopped."""
    import logging

    from workers.worker import EXIT_RESTART, ExtractionWorker, worker_name

    if gpu is None and device is None:
        raise click.UsageError("Give --gpu N, or --device cpu [--index N].")
    device_name, index = ("cpu", index) if device == "cpu" else ("cuda", gpu if gpu is not None else index)
    torch_device = "cpu" if device_name == "cpu" else f"cuda:{index}"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run = open_run(settings)
    extraction_worker = ExtractionWorker(run, worker_name(device_name, index), torch_device)
    extraction_worker.work(burst=burst)
    if extraction_worker.restart_requested:
        sys.exit(EXIT_RESTART)


@main.command()
@click.argument("blob", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Metadata and statistics as JSON.")
def inspect(blob, as_json):
    """Print a blob's metadata and per-layer statistics (layer ids in z-lab convention)."""
    from dflashq.blob import blob_stats, decode_blob
    from dflashq.exceptions import InputError

    if not Path(blob).is_file():
        raise InputError(f"Blob {blob} does not exist: give the path of a .dfq file from the run's store.")
    decoded = decode_blob(Path(blob).read_bytes())
    stats = blob_stats(decoded)
    if as_json:
        click.echo(json.dumps({"metadata": decoded.metadata, "samples": len(decoded), "tokens": int(decoded.input_ids.shape[0]),
                               "supervised_tokens": int(decoded.loss_mask.sum()), "layers": stats}, indent=2))
        return
    meta = Table(title=f"blob {blob}", show_header=False)
    for key, value in sorted(decoded.metadata.items()):
        meta.add_row(key, value)
    meta.add_row("samples / tokens / supervised", f"{len(decoded)} / {decoded.input_ids.shape[0]} / {int(decoded.loss_mask.sum())}")
    layers = Table(title="per tapped layer (z-lab ids: output of decoder layer t)")
    columns = list(next(iter(stats.values())))
    for col in ["layer", *columns]:
        layers.add_column(col)
    for layer, values in stats.items():
        layers.add_row(str(layer), *(f"{values[c]:.4g}" for c in columns))
    console.print(meta, layers)


@main.command()
@run_options
@click.option("--samples", "num_samples", default=8, show_default=True, help="Random stored samples to recompute.")
@click.option("--device", default="cpu", show_default=True, help="Device of the reference forward (cpu, cuda:0, ...).")
@click.option("--seed", default=0, show_default=True)
def verify(settings, num_samples, device, seed):
    """Recompute random stored samples with a plain unbatched Transformers forward; exit 1 on any bad layer."""
    from dflashq.exceptions import VerificationFailed
    from workers.verify import verify_run

    run = open_run(settings)
    reports, ok, checked = verify_run(run, num_samples, device, seed)
    table = Table(title=f"verify: {checked} samples of run '{settings.run}' (z-lab layer ids)")
    for col in ("layer", "max abs diff", "max rel diff", "result"):
        table.add_column(col)
    for r in reports:
        table.add_row(str(r.layer_id), f"{r.max_abs_diff:.3g}", f"{r.max_rel_diff:.3g}", "[green]ok" if r.ok else f"[red]{r.problems()}")
    console.print(table)
    if not ok:
        bad = ", ".join(str(r.layer_id) for r in reports if not r.ok)
        raise VerificationFailed(f"Stored hidden states of layer(s) {bad} are all-zero, non-finite or wrong: do not train on this run; re-extract it.")


@main.command("tiny-model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen3_5", "qwen3_next", "llama"]), default="qwen3_5", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_model(out, arch, seed):
    """Write a small random model with a tokenizer and chat template (demos, tests, dry runs)."""
    from workers.tiny_model import write_tiny_model

    click.echo(write_tiny_model(out, arch, seed))


# --- trainer ------------------------------------------------------------------------------------------------
@main.command()
@run_options
@click.option("--device", default=None, help="cuda:N or cpu (default: cuda:0 when a GPU is visible).")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps (then checkpoint).")
@click.option("--no-progress", is_flag=True)
def train(settings, device, max_steps, no_progress):
    """Run the trainer daemon: consume blobs, train the drafter, checkpoint, until the epochs are done."""
    import torch

    from trainer.daemon import Trainer

    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    report = Trainer(open_run(settings), device, progress=not no_progress).run_until_done(max_steps)
    table = Table(title=f"trainer of run '{settings.run}'" + (" (stopped)" if report.stopped else " (done)"), show_header=False)
    table.add_row("steps", str(report.steps))
    table.add_row("epochs done", f"{report.epochs_done} / {settings.train.epochs}")
    for epoch in sorted(report.consumed):
        table.add_row(f"epoch {epoch}", f"{report.consumed[epoch]} chunks trained, {report.duplicates_skipped.get(epoch, 0)} duplicates skipped")
    if report.last_loss is not None:
        table.add_row("last loss / EAL", f"{report.last_loss:.4f} / {report.last_eal:.3f}")
    table.add_row("checkpoint", str(report.checkpoint))
    console.print(table)


@main.command()
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


@main.command("eval")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(), help="Exported drafter folder.")
@click.option("--model", "target", required=True, type=click.Path(), help="Target model folder.")
@click.option("--data", "prompts_file", type=click.Path(), help="Prompts JSONL (`prompt` or `messages` per line).")
@click.option("--blobs", "blob_paths", multiple=True, type=click.Path(), help="Held-out blobs (files or folders): offline EAL.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--num-anchors", default=512, show_default=True, help="Anchors per sample with --blobs.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def evaluate(drafter_dir, target, prompts_file, blob_paths, max_new_tokens, num_anchors, device, as_json):
    """Measure a drafter: real greedy speculative decoding on prompts (tau, lossless check), or EAL on blobs."""
    from dflashq.blob import decode_blob
    from dflashq.exceptions import InputError
    from trainer.evaluate import evaluate_blobs, evaluate_prompts, read_prompts
    from trainer.export import load_exported
    from trainer.target_head import TargetHead

    if bool(prompts_file) == bool(blob_paths):
        raise click.UsageError("Give either --data PROMPTS.jsonl or --blobs PATH...")
    if prompts_file:
        report = evaluate_prompts(target, drafter_dir, read_prompts(prompts_file), max_new_tokens, device)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            table = Table(title=f"speculative decoding: mean tau {report['mean_tau']:.3f}, lossless {report['lossless']}")
            for col in ("prompt", "tau", "target passes", "new tokens", "lossless"):
                table.add_column(col)
            for i, r in enumerate(report["prompts"]):
                table.add_row(str(i), f"{r['tau']:.3f}", str(r["passes"]), str(r["new_tokens"]), str(r["lossless"]))
            console.print(table)
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


# --- the whole pipeline -------------------------------------------------------------------------------------
@main.command()
@run_options
@click.option("--workers", "num_workers", type=int, help="CPU workers (default: one worker per visible GPU).")
@click.option("--trainer-device", default=None, help="Trainer device (default: cuda:0 with GPUs, else cpu).")
@click.option("--no-live", is_flag=True, help="No live status view (logs, CI).")
def up(settings, num_workers, trainer_device, no_live):
    """Run everything supervised: producer, one worker per GPU (or --workers N on CPU), trainer; then export."""
    import torch

    from ops.supervisor import Supervisor
    from trainer import checkpoint
    from trainer.export import export_checkpoint

    run = open_run(settings)
    gpus = torch.cuda.device_count()
    workers = [("cpu", i) for i in range(num_workers or 1)] if num_workers or not gpus else [("cuda", i) for i in range(gpus)]
    supervisor = Supervisor(run, workers, trainer_device or ("cuda:0" if gpus else "cpu"), Path(run.store.path("logs")), console)
    done = supervisor.run_until_done(live=not no_live)
    exported = None
    latest = checkpoint.latest(run.store.path("checkpoints"))
    if done and latest is not None:
        target = Path(run.store.path(f"drafter-{latest.name}"))
        exported = str(target if target.exists() else export_checkpoint(latest, target))
    summary = supervisor.summary(exported)
    table = Table(title=f"run '{settings.run}' " + ("done" if done else "stopped"), show_header=False)
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    if not done:
        sys.exit(130)


# --- control ------------------------------------------------------------------------------------------------
@main.command("restart-worker")
@run_options
@click.argument("name")
@click.option("--now", is_flag=True, help="Kill it now; its chunk goes back to the front of the queue at once.")
def restart_worker(settings, name, now):
    """Restart one worker: after its current chunk (warm), or at once with --now. Nothing is lost either way."""
    from ops import control

    control.restart_worker(open_run(settings, join=False), name, now)
    click.echo(f"{name}: {'restarting now' if now else 'restarting after its current chunk'}")


@main.command()
@run_options
@click.argument("name", required=False)
def pause(settings, name):
    """Pause one worker (NAME) or the whole run: no new chunks are taken; current ones finish."""
    from ops import control

    control.pause(open_run(settings, join=False), name)
    click.echo(f"paused {name or 'all workers'}")


@main.command()
@run_options
@click.argument("name", required=False)
def resume(settings, name):
    """Resume one paused worker (NAME) or the whole run."""
    from ops import control

    control.resume(open_run(settings, join=False), name)
    click.echo(f"resumed {name or 'all workers'}")


@main.command()
@run_options
@click.option("--failed", is_flag=True, required=True, help="Re-queue every failed chunk of the run.")
def requeue(settings, failed):
    """Re-queue failed chunks (after fixing what made them fail)."""
    from ops import control

    requeued = control.requeue_failed(open_run(settings, join=False))
    click.echo(f"re-queued {len(requeued)} failed chunk(s)")


@main.command()
@run_options
def drain(settings):
    """Stop admitting new chunks; finish everything already in flight."""
    from ops import control

    control.drain(open_run(settings, join=False))
    click.echo("draining: the producer admits nothing more; workers and trainer finish what is in flight")


# --- dashboard and report -----------------------------------------------------------------------------------
@main.command()
@run_options
@click.option("--host", default=defaults.DASHBOARD_HOST, show_default=True, help="Address to bind; 0.0.0.0 exposes the dashboard to the network.")
@click.option("--port", default=defaults.DASHBOARD_PORT, show_default=True, type=int)
@click.option("--allow-delete", is_flag=True, help="Allow the actions that change queues: delete, empty, requeue, compact.")
@click.option("--username", envvar="DFLASHQ_DASHBOARD_USERNAME", help="HTTP basic auth user (with --password).")
@click.option("--password", envvar="DFLASHQ_DASHBOARD_PASSWORD", help="HTTP basic auth password (better: the environment variable).")
def dashboard(settings, host, port, allow_delete, username, password):
    """Serve rq-dashboard for the run's queues and workers (read-only unless --allow-delete)."""
    from ops.dashboard import serve_dashboard

    open_run(settings, join=False)  # resolves the embedded Redis and checks that it answers
    click.echo(f"dashboard of run '{settings.run}' ({redact(settings.redis.url)}) on http://{host}:{port}/")
    serve_dashboard(settings.redis.url, settings.run, host, port, allow_delete, username, password)


@main.command()
@run_options
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write (default: ./<run>-report.png).")
def report(settings, out):
    """Write a PNG of the run's curves: loss, EAL, per-slot accuracy, training and extraction throughput."""
    from ops.report import write_report

    click.echo(write_report(open_run(settings, join=False), out or f"{settings.run}-report.png"))


# --- redis --------------------------------------------------------------------------------------------------
@main.group(name="redis", cls=Cli)
def redis_group():
    """The run's embedded Redis (used when no Redis URL is configured)."""


@redis_group.command("start")
@run_options
def redis_start(settings):
    """Start (or find) the run's embedded Redis and print its URL."""
    click.echo(redis_server.EmbeddedRedis(settings.run_dir).ensure())


@redis_group.command("stop")
@run_options
def redis_stop(settings):
    """Stop the run's embedded Redis cleanly (its AOF keeps everything for the next start)."""
    stopped = redis_server.EmbeddedRedis(settings.run_dir).stop()
    click.echo("stopped" if stopped else "not running")


# --- demo -------------------------------------------------------------------------------------------------
@main.command()
@click.option("--out", default="demo-out", show_default=True, type=click.Path(file_okay=False), help="Folder for model, data and run.")
@click.option("--workers", default=2, show_default=True, help="CPU extraction workers.")
def demo(out, workers):
    """Run the pipeline on a tiny random hybrid model and built-in conversations (CPU, no downloads)."""
    from ops.demo import run_demo

    run_demo(out, workers)


def entry() -> None:
    main(prog_name="dflashq")


if __name__ == "__main__":
    sys.exit(entry())
