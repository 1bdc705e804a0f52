"""Commands that run and control a whole run: up, status, restart-worker, pause, resume, requeue, drain,
dashboard, report, demo, and the embedded Redis."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from dflashq import defaults
from dflashq.connection import redact
from ops import redis_server, status as status_module
from ops.cli.options import Cli, console, run_options
from ops.redis_server import open_run

# --- status -------------------------------------------------------------------------------------------------
@click.command()
@run_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable interface, see docs/operations.md).")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until Ctrl-C.")
def status(settings, as_json, watch):
    """Chunks admitted / queued / started / finished / failed, backlog, store bytes, workers, trainer, ETA."""
    import time

    from rich.live import Live

    settings.redis.url = redis_server.resolve_url(settings)  # an embedded Redis that died is started again here
    outage = status_module.OutageWatch(settings.redis.url, settings.redis.outage_seconds)
    if not watch and outage.down():  # a Redis of the user's own is down: say so at once, not after retrying
        if as_json:
            click.echo(json.dumps({"run": settings.run, "redis": {"reachable": False, "url": redact(settings.redis.url)}}))
        else:
            console.print(outage.render())
        sys.exit(2)
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
                view = outage.render() if outage.down() else status_module.render(status_module.collect(run), redact(settings.redis.url))
                live.update(view)
                time.sleep(2)
        except KeyboardInterrupt:
            pass

# --- the whole pipeline -------------------------------------------------------------------------------------
@click.command()
@run_options
@click.option("--workers", "num_workers", type=int, help="CPU workers (default: a worker on each GPU the trainer does not take).")
@click.option("--trainer-device", default=None, help="Trainer device; workers then run on every GPU (default: --trainer-gpus).")
@click.option("--trainer-gpus", type=int, default=None,
              help="GPUs for the trainer's ranks, the others run workers (default: balanced from measured rates).")
@click.option("--no-live", is_flag=True, help="No live status view (logs, CI).")
def up(settings, num_workers, trainer_device, trainer_gpus, no_live):
    """Run everything supervised: producer, workers (on GPUs, or --workers N on CPU), trainer ranks; then export."""
    import torch

    from ops.placement import place
    from ops.supervisor import Supervisor
    from trainer import checkpoint
    from trainer.export import export_once

    run = open_run(settings)
    placement = place(run, torch.cuda.device_count(), num_workers, trainer_device, trainer_gpus)
    if placement.note:
        console.print(placement.note)
    supervisor = Supervisor(run, placement.workers, placement.trainer_args, Path(run.store.path("logs")), console,
                            trainer_env=placement.trainer_env)
    done = supervisor.run_until_done(live=not no_live)
    exported = None
    latest = checkpoint.latest(run.store.path("checkpoints"))
    if done and latest is not None:
        exported = str(export_once(latest))
    summary = supervisor.summary(exported)
    table = Table(title=f"run '{settings.run}' " + ("done" if done else "stopped"), show_header=False)
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    if not done:
        sys.exit(130)


# --- control ------------------------------------------------------------------------------------------------
@click.command("restart-worker")
@run_options
@click.argument("name")
@click.option("--now", is_flag=True, help="Kill it now; its chunk goes back to the front of the queue at once.")
def restart_worker(settings, name, now):
    """Restart one worker: after its current chunk (warm), or at once with --now. Nothing is lost either way."""
    from ops import control

    control.restart_worker(open_run(settings, join=False), name, now)
    click.echo(f"{name}: {'restarting now' if now else 'restarting after its current chunk'}")


@click.command()
@run_options
@click.argument("name", required=False)
def pause(settings, name):
    """Pause one worker (NAME) or the whole run: no new chunks are taken; current ones finish."""
    from ops import control

    control.pause(open_run(settings, join=False), name)
    click.echo(f"paused {name or 'all workers'}")


@click.command()
@run_options
@click.argument("name", required=False)
def resume(settings, name):
    """Resume one paused worker (NAME) or the whole run."""
    from ops import control

    control.resume(open_run(settings, join=False), name)
    click.echo(f"resumed {name or 'all workers'}")


@click.command()
@run_options
@click.option("--failed", is_flag=True, required=True, help="Re-queue every failed chunk of the run.")
def requeue(settings, failed):
    """Re-queue failed chunks (after fixing what made them fail)."""
    from ops import control

    requeued = control.requeue_failed(open_run(settings, join=False))
    click.echo(f"re-queued {len(requeued)} failed chunk(s)")


@click.command()
@run_options
def drain(settings):
    """Stop admitting new chunks; finish everything already in flight."""
    from ops import control

    control.drain(open_run(settings, join=False))
    click.echo("draining: the producer admits nothing more; workers and trainer finish what is in flight")


# --- dashboard and report -----------------------------------------------------------------------------------
@click.command()
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


@click.command()
@run_options
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write (default: ./<run>-report.png).")
def report(settings, out):
    """Write a PNG of the run's curves: loss, EAL, per-slot accuracy, training and extraction throughput."""
    from ops.report import write_report

    click.echo(write_report(open_run(settings, join=False), out or f"{settings.run}-report.png"))


# --- redis --------------------------------------------------------------------------------------------------
@click.group(name="redis", cls=Cli)
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
@click.command()
@click.option("--out", default="demo-out", show_default=True, type=click.Path(file_okay=False), help="Folder for model, data and run.")
@click.option("--workers", default=2, show_default=True, help="CPU extraction workers.")
def demo(out, workers):
    """Run the pipeline on a tiny random hybrid model and built-in conversations (CPU, no downloads)."""
    from ops.demo import run_demo

    run_demo(out, workers)


COMMANDS = [status, up, restart_worker, pause, resume, requeue, drain, dashboard, report, redis_group, demo]
