"""The reference implementations the tests compare against (scripts/oracles.txt): found in the
project's cache, where scripts/setup.sh -> scripts/setup_oracles.sh installs them, each in its own
``pip install --no-deps --target`` directory (never .venv); installed by the same script on first
use if `make setup` has not run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "scripts" / "oracles.txt"
ZLAB = "dflash-0.1.0"
SPECULATORS = "speculators-0.9.0"


def _pins() -> dict[str, str]:
    out = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, reqs = line.split(None, 1)
            out[name] = " ".join(reqs.split())
    return out


def oracle_dir(name: str) -> Path:
    """The --target directory of oracle `name`, installed (scripts/setup_oracles.sh) if missing."""
    reqs = _pins()[name]
    cache = Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-trt")
    home = Path(os.environ.get("ORACLES_DIR") or cache / "oracles") / name
    stamp = home / ".complete"
    if not (stamp.is_file() and stamp.read_text().strip() == reqs):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup_oracles.sh"), name], capture_output=True,
                              text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
        if proc.returncode != 0:
            pytest.fail(f"could not install the {name} oracle: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return home


def zlab() -> ModuleType:
    """z-lab's `dflash.model` (dflash 0.1.0 from PyPI), imported in this process: it runs on the
    project's torch (its own pin) and transformers (5.14 where it pins 5.15; what it imports is
    the same in both). Its `return_stats` timer calls torch.cuda.synchronize(); on a CPU the
    timer is plain perf_counter (timing only: nothing it computes changes)."""
    home = str(oracle_dir(ZLAB))
    if home not in sys.path:
        sys.path.append(home)
    import dflash
    import dflash.model as model
    from importlib.metadata import version

    assert Path(dflash.__file__).is_relative_to(home) and version("dflash") == "0.1.0", dflash.__file__
    model._cuda_time = time.perf_counter
    return model
