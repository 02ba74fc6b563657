"""Helpers of the bad-input tests (issue 24): a pickle that would run code, the one-line check."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RunsCode:
    """Unpickled by a full unpickler, this calls ``Path(marker).touch()``: the file appearing is
    the proof that code ran. torch's weights-only unpickler must refuse it instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def write_code_pickle(path: Path, marker: Path, wrap: Any = None) -> Path:
    """A torch.save'd file whose payload touches `marker` when loaded with weights_only=False.
    `wrap(payload)`: the structure around it (default: an answer file's)."""
    import torch

    payload = RunsCode(marker)
    torch.save(wrap(payload) if wrap else {"sequences": [payload], "meta": {}}, path)
    assert not marker.exists()
    return path


def assert_one_line_error(result: Any, *needles: str) -> str:
    """Exit != 0, no traceback, the LAST stderr line is ``error: ...`` and holds every needle
    (commands like `build` print the resolved spec before they fail)."""
    out = getattr(result, "output", "") or ""
    err = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
    code = getattr(result, "exit_code", getattr(result, "returncode", None))
    assert code != 0, out + err
    assert "Traceback" not in out + err, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    for n in needles:
        assert n in last, last
    return last
