"""Commands of the training area: `setup-default`, `train-draft`."""

from __future__ import annotations

import click

from dflash_trt.cli import friendly_errors


@click.command("setup-default")
@click.option("--rebuild", is_flag=True, help="Convert again even if a valid cache exists.")
@friendly_errors
def setup_default(rebuild: bool) -> None:
    """Convert the embedded SmolLM2-135M-Instruct target (GGUF from PyPI) into the local cache.

    Writes ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/smollm2-135m-instruct once; later runs only
    validate it. Prints the target and drafter directories.
    """
    from dflash_trt.embedded import DRAFT_DIR, ensure_default_target

    target = ensure_default_target(rebuild=rebuild)
    click.echo(f"target: {target}")
    click.echo(f"draft:  {DRAFT_DIR}" + ("" if (DRAFT_DIR / "config.json").is_file() else " (missing)"))


COMMANDS = [setup_default]
