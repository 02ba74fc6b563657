"""fsutil.atomic_file: the one write-then-rename every artifact file goes through (issue 46: it
replaced three full copies, one of which skipped the umask step, and three cruder ones).

Real files in a temporary directory: the umask's mode on success, the old file untouched and no
temporary left on failure, and the writers that now go through it (safetensors, answer files,
plot PNGs) keep those guarantees."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from dflash_trt.fsutil import atomic_file


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_completed_write_replaces_the_file_with_the_umask_mode(tmp_path, umask):
    path = tmp_path / "sub" / "out.bin"  # the parent is created
    old = os.umask(umask)
    try:
        with atomic_file(path) as tmp:
            assert tmp.parent == path.parent and tmp != path
            tmp.write_bytes(b"new")
            assert not path.exists()  # nothing at the final name before the block ends
    finally:
        os.umask(old)
    assert path.read_bytes() == b"new"
    assert _mode(path) == 0o666 & ~umask  # tempfile would have left 0600
    assert [p.name for p in path.parent.iterdir()] == ["out.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_the_writers_that_use_it_get_the_umask_mode(tmp_path):
    """save_safetensors_atomic skipped the umask step before it wrote through atomic_file."""
    from dflash_trt.checkpoints.files import save_safetensors_atomic
    from dflash_trt.train.datafile import read_answer_file, write_answer_file

    old = os.umask(0o022)
    try:
        save_safetensors_atomic({"w": torch.ones(2)}, tmp_path / "model.safetensors")
        write_answer_file(tmp_path / "responses.pt", [{"id": "a", "prompt_len": 1, "ids": [1, 2]}], {"k": 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "model.safetensors") == _mode(tmp_path / "responses.pt") == 0o644
    assert read_answer_file(tmp_path / "responses.pt")[0][0]["ids"] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "responses.pt"]
