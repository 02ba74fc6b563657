"""The `dflash-trt` command line: the top of the house. It imports every area's command module;
nothing below it imports this module (shared flags and the error contract: cli_helpers.py).
Subcommands import their heavy dependencies lazily."""

from __future__ import annotations

import click

from dflash_trt import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dflash-trt")
def main() -> None:
    """DFlash speculative decoding: build, quantize, deploy and serve on TensorRT-LLM / Triton / Slurm.

    With no model arguments every command uses the embedded default pair.
    """


@main.group()
def deploy() -> None:
    """Turn an engine directory into a deployment (Triton model repository, Slurm jobs)."""


# Each area of the product keeps its commands in its own module, which exposes COMMANDS (added
# to `dflash-trt`) and optionally DEPLOY_COMMANDS (added to `dflash-trt deploy`). Those modules
# import heavy libraries inside the commands only, so `dflash-trt --help` stays fast.
COMMAND_MODULES = (
    "dflash_trt.generation_cli",
    "dflash_trt.train.cli",
    "dflash_trt.engine.cli",
    "dflash_trt.serving.cli",
    "dflash_trt.deploy.cli",
    "dflash_trt.bench.cli",
    "dflash_trt.drafter_cli",
)


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # that area is not written yet
                continue
            raise
        for cmd in getattr(module, "COMMANDS", ()):
            main.add_command(cmd)
        for cmd in getattr(module, "DEPLOY_COMMANDS", ()):
            deploy.add_command(cmd)


_register_commands()


if __name__ == "__main__":
    main()
