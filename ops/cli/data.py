"""Commands that prepare and admit data: produce."""

from __future__ import annotations

import click
from rich.table import Table

from ops.cli.options import console, open_run, run_options

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


COMMANDS = [produce]
