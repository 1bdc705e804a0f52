"""Commands that prepare a target model folder: tiny-model, import-gguf."""

from __future__ import annotations

import click


@click.command("tiny-model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen3_5", "qwen3_next", "llama"]), default="qwen3_5", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_model(out, arch, seed):
    """Write a small random model with a tokenizer and chat template (demos, tests, dry runs)."""
    from workers.tiny_model import write_tiny_model

    click.echo(write_tiny_model(out, arch, seed))


@click.command("import-gguf")
@click.argument("file", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--no-progress", is_flag=True)
def import_gguf(file, out, no_progress):
    """Convert a llama.cpp GGUF checkpoint (llama, qwen2, qwen3) into a new Transformers model folder OUT:
    bf16 safetensors weights, config, tokenizer and chat template."""
    from ops.gguf_import import import_gguf as convert

    click.echo(convert(file, out, progress=not no_progress))


COMMANDS = [tiny_model, import_gguf]
