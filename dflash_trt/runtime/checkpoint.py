"""Reading and writing checkpoint files safely.

Loading never executes code from a checkpoint directory: published DFlash drafters carry an
``auto_map`` to remote code that users load with ``trust_remote_code=True``; we read config.json
and safetensors only. Pickle weight files (``*.bin``, ``*.pt``) can run arbitrary code when
loaded, so they are refused unless the caller explicitly allows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_trt.errors import DFlashError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    if not path.is_file():
        raise DFlashError(f"{what} not found: {path}; pass the checkpoint directory that contains {path.name}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{what} {path} is not valid JSON ({e}); the file is corrupt, re-download or re-export it")
    if not isinstance(obj, dict):
        raise DFlashError(f"{what} {path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def load_state_dict(directory: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of `directory`'s *.safetensors files (or pickles if explicitly allowed)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES) if directory.is_dir() else []
        if pickles and not allow_pickle:
            raise DFlashError(
                f"{directory}: only pickle weights ({pickles[0].name}) found; pickle can execute code on load. "
                "Convert to safetensors, or pass --allow-pickle if you trust the source"
            )
        if pickles:
            state: dict[str, torch.Tensor] = {}
            for p in pickles:
                state.update(torch.load(p, map_location="cpu", weights_only=True))
            return state
        raise DFlashError(f"{directory}: no *.safetensors weight file; pass a checkpoint directory with model.safetensors")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise DFlashError(f"{f}: corrupt or truncated safetensors file ({str(e).splitlines()[0]}); re-download or re-export it")
    return state


def save_safetensors_atomic(state: dict[str, torch.Tensor], path: Path) -> None:
    import os
    import tempfile

    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
