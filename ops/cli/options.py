"""What every command shares: the error rule (one sentence, never a traceback), the run options, the console
(commands open their run with ops.redis_server.open_run)."""

from __future__ import annotations

import functools

import click
import redis
from rich.console import Console

from dflashq import settings as settings_module
from dflashq.exceptions import DflashqError

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
            click.echo(f"dflashq: lost the connection to Redis for longer than redis.outage_seconds ({exc}): check that "
                       "it is running, then run the command again.", err=True)
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


