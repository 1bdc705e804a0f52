"""Commands that prepare and admit data: regenerate, produce."""

from __future__ import annotations

import click
from rich.table import Table

from ops.cli.options import console, run_options
from ops.redis_server import open_run


# --- regenerate ---------------------------------------------------------------------------------------------
@click.command()
@run_options
@click.argument("inputs", nargs=-1, type=click.Path())
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False),
              help="Output JSONL, one regenerated conversation per input record; a rerun resumes it.")
@click.option("--endpoint", metavar="URL", help="An OpenAI-compatible server (vLLM, SGLang) serving the target.")
@click.option("--engine", "engine_name", type=click.Choice(["endpoint", "transformers", "vllm"]),
              help="Default: endpoint with --endpoint, else transformers (the target from model.path, here); vllm: "
                   "the target in vLLM's offline engine here (the `vllm` extra, a CUDA GPU).")
@click.option("--device", help="Transformers and vLLM engines: cuda:N or cpu (default: cuda:0 when a GPU is visible).")
@click.option("--concurrency", type=click.IntRange(min=1), help="Endpoint: requests in flight (key regenerate.concurrency).")
@click.option("--processes", type=click.IntRange(min=1),
              help="Transformers engine: processes sharing the device (key regenerate.processes).")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs, CI).")
def regenerate(settings, inputs, out, endpoint, engine_name, device, concurrency, processes, no_progress):
    """Replace the assistant turns of conversations with the target's own responses (run it before `produce`)."""
    from producers.regenerate import open_engine, resolve_inputs
    from producers.regenerate import regenerate as run_regenerate

    engine_name = engine_name or ("endpoint" if endpoint else "transformers")
    if (engine_name == "endpoint") != bool(endpoint):
        raise click.UsageError("Give --endpoint URL for the endpoint engine, and no --endpoint with --engine transformers.")
    if concurrency is not None:
        settings.set("regenerate.concurrency", concurrency)
    if processes is not None:
        settings.set("regenerate.processes", processes)
    resolve_inputs(settings, inputs, out)  # a wrong path fails before torch is imported and a model loads
    engine = open_engine(settings, engine_name, device, endpoint)
    with engine:
        report = run_regenerate(settings, list(inputs), out, engine, progress=not no_progress)
    table = Table(title=f"regenerated into {out}", show_header=False)
    table.add_row("records read", str(report.records))
    for field in ("already_done", "duplicates", "regenerated", "rejected", "failed", "truncated_turns"):
        table.add_row(field.replace("_", " "), str(getattr(report, field)))
    table.add_row("generated tokens", str(report.tokens))
    table.add_row("tokens/s", f"{report.tokens_per_second:,.0f}")
    if report.torn_line_dropped:
        table.add_row("torn last line", "cut off and redone")
    if report.rejected:
        table.add_row("rejects file", report.rejects_file)
        table.add_row("reject reasons", ", ".join(f"{k}: {v}" for k, v in sorted(report.reasons.items())))
    if report.failed:
        table.add_row("failed file", f"{report.failed_file} (run again to retry them)")
    console.print(table)


# --- produce ------------------------------------------------------------------------------------------------
@click.command()
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


COMMANDS = [regenerate, produce]
