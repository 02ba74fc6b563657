"""Answer files on disk, read without ever running code from them.

An answer file (``responses.pt``, ``sampled.pt``) is ``torch.save``'d ``{"sequences": [row, ...],
"meta": {...}}``: rows of str/int/list/tensor values (train/answers.py ``answer_row``). A ``.pt``
file is a pickle, and unpickling an arbitrary object runs code (``__reduce__``), so it is read
with ``torch.load(weights_only=True)``: torch's restricted unpickler, whose allow-list is exactly
what the rows hold (dict, list, str, int, float, bool, None, tensors) and nothing else. No extra
globals are allowed on purpose. A file that needs any other type (a crafted pickle, a foreign
checkpoint) is refused in one line, and a file of the right kind but the wrong shape is refused
before any row is used. Files written before this module are read unchanged (same format).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

def read_answer_file(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(sequences, meta) of an answer file; DFlashError (one line) if it is not one."""
    import torch

    path = Path(path)
    fix = "pass an answer file written by `dflash-trt train-data` (or python -m dflash_trt.train.sampled)"
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        from dflash_trt.checkpoints.files import refused_global

        raise DFlashError(f"{path}: refused to load, the file holds objects an answer file never has "
                          f"({refused_global(e)}); it may run code when unpickled, {fix}") from None
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        raise DFlashError(f"{path}: unreadable as an answer file ({' '.join(str(e).split())[:160]}); {fix}") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("sequences"), list):
        raise DFlashError(f"{path}: not an answer file (no \"sequences\" list); {fix}")
    meta = blob.get("meta", {})
    if not isinstance(meta, dict):
        raise DFlashError(f"{path}: \"meta\" is {type(meta).__name__}, not a dict; {fix}")
    for i, row in enumerate(blob["sequences"]):
        _check_row(path, i, row, fix)
    return blob["sequences"], meta


def _check_row(path: Path, i: int, row: Any, fix: str) -> None:
    if not isinstance(row, dict):
        raise DFlashError(f"{path}: sequences[{i}] is {type(row).__name__}, not a row dict; {fix}")
    ids = row.get("ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise DFlashError(f"{path}: sequences[{i}].ids is not a list of token ids; {fix}")
    if not isinstance(row.get("id"), str):
        raise DFlashError(f"{path}: sequences[{i}] has no string \"id\"; {fix}")
    plen = row.get("prompt_len")
    if not isinstance(plen, int) or not 0 <= plen <= len(ids):
        raise DFlashError(f"{path}: sequences[{i}].prompt_len={plen!r} is not in 0..{len(ids)}; {fix}")


def write_answer_file(path: str | Path, sequences: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write atomically (fsutil.atomic_file: a temporary file beside `path`, renamed over it, mode
    as the umask says): a crash mid-write leaves the previous file whole."""
    import torch

    from dflash_trt.fsutil import atomic_file

    with atomic_file(path, what="the output") as tmp:
        torch.save({"sequences": sequences, "meta": meta}, tmp)
