"""The `dflashq` command line: a thin layer over the Python API of producers/, workers/, trainer/ and ops/, with one
module per command group (as rq's cli/): data, models, workers, train, operate; options holds what they share."""

from __future__ import annotations

import click

from ops.cli import data, models, operate, train, workers
from ops.cli.options import Cli


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflashq")
def main():
    """dflashq: extract target hidden states with Transformers GPU workers over Redis/RQ and train DFlash drafters."""


for module in (data, models, workers, train, operate):
    for command in module.COMMANDS:
        main.add_command(command)


def entry() -> None:
    main(prog_name="dflashq")
