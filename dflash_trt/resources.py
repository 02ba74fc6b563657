"""Where the project's data folders are, from a source checkout or an installed wheel.

`build/` (recipes, known architectures), `deploy/` (Slurm templates) and `triton_repo/` (the
Triton model-repository template) live at the top of the repository; the wheel force-includes
them as `dflash_trt/_data/<name>` (see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """Path of the data folder `name` ("build", "deploy" or "triton_repo")."""
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"data folder {name!r} not found next to the dflash_trt package")
