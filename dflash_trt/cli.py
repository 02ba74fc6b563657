"""The `dflash-trt` command line. Subcommands import their heavy dependencies lazily."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from dflash_trt import __version__
from dflash_trt.errors import DFlashError


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DFlashError into one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dflash-trt")
def main() -> None:
    """DFlash speculative decoding: build, quantize, deploy and serve on TensorRT-LLM / Triton / Slurm.

    With no model arguments every command uses the embedded default pair.
    """


@main.command()
@click.argument("prompt")
@click.option("--target", "target_dir", type=click.Path(file_okay=False), help="Target HF checkpoint directory.")
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False), help="DFlash drafter directory (z-lab format).")
@click.option("--engine", "engine_dir", type=click.Path(file_okay=False),
              help="Engine directory from `dflash-trt build` (none/fp8/nvfp4; dequantized to run on CPU).")
@click.option("--tiny", is_flag=True, help="Use a tiny randomly initialised pair (no checkpoint; smoke tests).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--raw", is_flag=True, help="Do not apply the tokenizer's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ids, text, statistics).")
@click.option("--compare/--no-compare", default=False, show_default=True,
              help="Also run plain decoding on the same prompt and report the speedup.")
@click.option("--dtype", default="float32", show_default=True, help="float32 | bfloat16 | float16")
@click.option("--allow-pickle", is_flag=True, help="Allow pickle weight files (they can run code).")
@friendly_errors
def generate(prompt: str, target_dir: str | None, draft_dir: str | None, engine_dir: str | None, tiny: bool,
             max_new_tokens: int,
             temperature: float, top_p: float, seed: int, raw: bool, as_json: bool, compare: bool,
             dtype: str, allow_pickle: bool) -> None:
    """Generate text for PROMPT with DFlash and print it with acceptance statistics."""
    from dflash_trt.generation_cli import run_generate

    run_generate(prompt=prompt, target_dir=target_dir, draft_dir=draft_dir, engine_dir=engine_dir, tiny=tiny,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                 raw=raw, as_json=as_json, compare=compare, dtype=dtype, allow_pickle=allow_pickle)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=None, separators=(",", ":")))


@main.group()
def deploy() -> None:
    """Turn an engine directory into a deployment (Triton model repository, Slurm jobs)."""


# Each area of the product keeps its commands in its own module, which exposes COMMANDS (added
# to `dflash-trt`) and optionally DEPLOY_COMMANDS (added to `dflash-trt deploy`). Those modules
# import heavy libraries inside the commands only, so `dflash-trt --help` stays fast.
COMMAND_MODULES = (
    "dflash_trt.train.cli",
    "dflash_trt.engine.cli",
    "dflash_trt.serving.cli",
    "dflash_trt.deploy.cli",
    "dflash_trt.bench.cli",
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
