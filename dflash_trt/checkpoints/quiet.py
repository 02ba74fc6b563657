"""transformers' chatter kept off the CLI's output while it loads or saves a checkpoint."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def quiet_transformers(progress: bool = True, prints_to: TextIO | None = None) -> Iterator[None]:
    """Errors only from transformers' logger; what it prints (load reports, on stdout) goes to
    `prints_to`, swallowed when None, so stdout stays clean for --json consumers; `progress`
    False also hides its shard bars (--no-progress)."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(prints_to if prints_to is not None else io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(old)
        if not progress:
            hf_logging.enable_progress_bar()
