"""The embedded default pair: what every command uses when the user names no model.

Filled in by the embedded-default work (SmolLM2-135M-Instruct + the drafter trained for it).
"""

from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashError


def default_pair_dirs() -> tuple[Path, Path]:
    raise DFlashError("no embedded default pair is set up yet; pass --target and --draft, or --tiny")
