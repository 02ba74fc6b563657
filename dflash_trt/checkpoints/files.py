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


def refused_global(error: BaseException) -> str:
    """The line of torch's (page-long) weights-only refusal that names what it refused."""
    first = next((ln.strip() for ln in str(error).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
    return first[:160] or type(error).__name__


def pickle_refusal(path: Path, error: BaseException) -> DFlashError:
    """The one line for a pickle that torch's weights-only unpickler refused (it wanted a global
    outside the allow-list: a crafted file would run code there)."""
    return DFlashError(f"{path}: refused to unpickle, it holds more than tensors ({refused_global(error)}), "
                       "which can run code when loaded; convert the checkpoint to safetensors from a trusted copy")


def load_pickle_weights(path: Path) -> dict[str, torch.Tensor]:
    """A pickle weight file's tensors, read with torch's weights-only unpickler (--allow-pickle)."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle_refusal(path, e) from None
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        raise DFlashError(f"{path}: unreadable pickle weight file ({' '.join(str(e).split())[:160]}); "
                          "re-download or convert it to safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise DFlashError(f"{path}: not a state dict (name -> tensor); pass the drafter's weight file")
    return state


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
                state.update(load_pickle_weights(p))
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
    """`state` as a safetensors file at `path`, written through fsutil.atomic_file (umask mode)."""
    from safetensors.torch import save_file

    from dflash_trt.fsutil import atomic_file

    with atomic_file(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
