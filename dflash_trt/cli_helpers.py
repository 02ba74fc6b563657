"""What every command module shares: the error contract, JSON output, the flags that must mean the
same on every command (``--max-draft-len``, ``--policy``, ``--draft-method``, ``--draft-len-schedule``) and the
comma-separated list flags.

The command modules (``dflash_trt/cli.py``, ``generation_cli.py`` and each area's ``cli.py``)
import this; nothing below the command layer does.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from dflash_trt.errors import DFlashError
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD, DRAFT_METHODS, POLICIES


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


def emit_json(obj: Any) -> None:
    """One JSON object on one line of stdout."""
    click.echo(json.dumps(obj, indent=None, separators=(",", ":")))


MAX_DRAFT_LEN_HELP = ("K: the most draft tokens one step verifies (1..block_size-1) [default: the engine's "
                      "limits.max_draft_len, else the drafter's block_size - 1].")


def max_draft_len_option(help: str = MAX_DRAFT_LEN_HELP) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--max-draft-len", type=click.IntRange(min=1), default=None, help=help)


def policy_option(default: str | None, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--policy", type=click.Choice(POLICIES), default=default, show_default=default is not None,
                        help=help)


DRAFT_METHOD_HELP = ("What a sampled step (temperature > 0) drafts and how it verifies: match = argmax drafts, "
                     "exact match against the target's samples; greedy = argmax drafts, rejection sampling with a "
                     "one-hot q; probabilistic = drafts sampled from the drafter's q, rejection sampling against it "
                     "(z-lab 0.1.0). All lossless; temperature 0 is the same for all.")


def draft_method_option(help: str = DRAFT_METHOD_HELP + f" [default: {DEFAULT_DRAFT_METHOD}]"
                        ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--draft-method, None when not given: SpeculationSettings' default (DEFAULT_DRAFT_METHOD) or
    the backend's own (serving/backends.tensorrt_llm_draft_method)."""
    return click.option("--draft-method", type=click.Choice(DRAFT_METHODS), default=None, help=help)


def _schedule_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--draft-len-schedule checked when parsed (one line naming the form), kept as its text."""
    from dflash_trt.draft_len_schedule import DraftLenSchedule

    if value is not None:
        try:
            DraftLenSchedule.parse(value)
        except DFlashError as e:
            raise click.BadParameter(str(e)) from None
    return value


DRAFT_LEN_SCHEDULE_HELP = ("What --policy schedule follows: batch-size thresholds to draft lengths, TensorRT-LLM's "
                           "draft_len_schedule, e.g. 1:15,8:3,16:1 (1 row drafts 15, 2-8 rows 3, 9-16 rows 1, more "
                           "none; the first value must be K), or off [default: the one the engine's build recorded].")


def draft_len_schedule_option(help: str = DRAFT_LEN_SCHEDULE_HELP) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    from dflash_trt.draft_len_schedule import FLAG

    return click.option(FLAG, "draft_len_schedule", callback=_schedule_text, default=None, help=help)


def prefix_cache_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--prefix-cache/--no-prefix-cache and --prefix-cache-mib: RuntimeChoices' prefix_cache and
    prefix_cache_mib (None when not given: the config file's or the default)."""
    from dflash_trt.runtime_options import DEFAULT_PREFIX_CACHE_MIB

    fn = click.option("--prefix-cache-mib", type=click.FloatRange(min=0, min_open=True), default=None,
                      help="Batched runtime: the prefix cache's memory budget in MiB; least recently used blocks are "
                           f"evicted beyond it [default: {DEFAULT_PREFIX_CACHE_MIB:g}].")(fn)
    return click.option("--prefix-cache/--no-prefix-cache", default=None,
                        help="Batched runtime: reuse the target's K/V and the drafter's context K/V of a prompt prefix "
                             "an earlier request computed, in blocks of 32 tokens (runtime/batched/prefix_cache.py); outputs "
                             "and acceptance are the same either way [default: on].")(fn)


def _number_list(kind: type, what: str, example: str) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> list[Any] | None:
        if value is None:
            return None
        try:
            return [kind(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a list of comma-separated {what}, e.g. {example}") from None

    return parse


def int_list(example: str) -> Callable[[click.Context, click.Parameter, str | None], list[int] | None]:
    """A click callback for a comma-separated integer flag: "1,2,4" -> [1, 2, 4], not given -> None,
    anything else one line naming the flag, the value and `example`."""
    return _number_list(int, "integers", example)


def float_list(example: str) -> Callable[[click.Context, click.Parameter, str | None], list[float] | None]:
    """As :func:`int_list`, for numbers: "20,60.5" -> [20.0, 60.5]."""
    return _number_list(float, "numbers", example)


def str_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    """A click callback for a comma-separated name flag: " a, b," -> ["a", "b"], not given -> None."""
    return None if value is None else [x.strip() for x in value.split(",") if x.strip()]


def _quiet_library_bars(ctx: click.Context, param: click.Parameter, no_progress: bool) -> bool:
    """--no-progress also silences the bars transformers and huggingface_hub draw themselves
    ("Loading weights", "Writing model shards"): our own tqdm/rich bars take `progress` directly."""
    if no_progress:
        import huggingface_hub.utils
        import transformers

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    return no_progress


def no_progress_option(help: str = "No progress bars.") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--no-progress", is_flag=True, callback=_quiet_library_bars, help=help)
