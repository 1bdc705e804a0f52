"""Commands of the extraction side: worker, inspect, verify."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from ops.cli.options import console, run_options
from ops.redis_server import open_run

# --- workers ------------------------------------------------------------------------------------------------
@click.command()
@run_options
@click.option("--gpu", type=int, help="GPU index: the worker runs on cuda:N and is named <host>.gpuN.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="cpu: run on the CPU (named <host>.cpuN).")
@click.option("--index", type=int, default=0, show_default=True, help="Worker index with --device cpu.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty (tests, one-off jobs).")
def worker(settings, gpu, device, index, burst):
    """Run one long-lived extraction worker: loads the target once, then extracts chunks until stopped."""
    import logging

    from dflashq.compile_cache import use_run_cache
    from dflashq.store import Store

    use_run_cache(Store(settings.store.path, settings.run))  # before the kernels load: a restart skips their autotuning
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


@click.command()
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


@click.command()
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


COMMANDS = [worker, inspect, verify]
