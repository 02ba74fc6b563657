"""`build` against the filesystem: read-only, full, shared with another build, left dirty by a
killed one, read by other users. Each case runs the real CLI or the real fsutil on real
filesystems: a tmpfs mounted read-only or a few KiB large (mounting needs root or
CAP_SYS_ADMIN; where it cannot be mounted the test says so and is skipped), flock between open
files, a child process killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from tests.bad_input import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tmpfs(tmp_path):
    """mount(size, read_only) -> a fresh tmpfs directory, unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str = "64k", read_only: bool = False) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _build_args(pair, out: Path, *extra: str) -> list[str]:
    tdir, ddir = pair
    return ["build", "--target", str(tdir), "--draft", str(ddir), "--gpu", "cpu", "--max-seq-len", "256",
            "--out", str(out), "--no-progress", *extra]


def test_build_onto_a_read_only_filesystem_is_one_line(tiny_pair_dirs, tmpfs):
    ro = tmpfs("1m", read_only=True)
    r = CliRunner().invoke(main, _build_args(tiny_pair_dirs, ro / "engine"))
    assert_one_line_error(r, f"cannot write the engine at {ro / 'engine'}", "read-only filesystem")


def test_build_onto_a_full_disk_names_free_and_needed_space(tiny_pair_dirs, tmpfs):
    small = tmpfs("64k")
    r = CliRunner().invoke(main, _build_args(tiny_pair_dirs, small / "engine"))
    assert_one_line_error(r, "not enough disk space for the engine", "64.0 KiB free", "needed")
    assert list(small.iterdir()) == []  # nothing half-written, no lock left


def test_a_disk_that_fills_during_the_write_is_one_line(tmpfs):
    """The free-space check passed but the disk fills anyway (another job writing): the OSError of
    a plain write and safetensors' own SafetensorError both become one line, nothing left behind."""
    import torch
    from safetensors.torch import save_file

    from dflash_trt.fsutil import atomic_directory

    small = tmpfs("64k")
    with pytest.raises(DFlashError, match=r"disk full writing the output at .*engine: .* free"):
        with atomic_directory(small / "engine") as tmp:
            (tmp / "big.bin").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(DFlashError, match="disk full writing the engine"):
        with atomic_directory(small / "engine", what="the engine", needed_bytes=1) as tmp:
            save_file({"w": torch.zeros(1 << 18)}, str(tmp / "model.safetensors"))
    assert list(small.iterdir()) == []


def test_a_second_build_to_the_same_out_names_the_holder(tiny_pair_dirs, tmp_path):
    """flock between two open files: the same exclusion two processes get, without two builds."""
    from dflash_trt.fsutil import directory_lock

    out = tmp_path / "engine"
    with directory_lock(out):
        r = CliRunner().invoke(main, _build_args(tiny_pair_dirs, out))
    assert_one_line_error(r, f"{out} is being written by pid {os.getpid()}", "wait for it to finish")
    assert not out.exists()
    ok = CliRunner().invoke(main, _build_args(tiny_pair_dirs, out))  # released: the next build proceeds
    assert ok.exit_code == 0, ok.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from dflash_trt.fsutil import atomic_directory
with atomic_directory(Path(sys.argv[1])) as tmp:
    (tmp / "half.safetensors").write_bytes(b"x" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_partials_of_a_killed_build_are_removed_by_the_next_build(tiny_pair_dirs, tmp_path):
    from dflash_trt.fsutil import directory_lock

    parent = tmp_path / "engines"
    parent.mkdir()
    child = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(parent / "dead")], cwd=ROOT)
    assert child.returncode == -signal.SIGKILL
    stale = [p for p in parent.iterdir() if p.name.startswith(".dead.partial-")]
    assert len(stale) == 1 and (stale[0] / "half.safetensors").is_file()  # what SIGKILL leaves
    live = parent / ".busy.partial-abc123"  # a build into `busy` that is still running
    live.mkdir()
    with directory_lock(parent / "busy"):
        r = CliRunner().invoke(main, _build_args(tiny_pair_dirs, parent / "other"))
    assert r.exit_code == 0, r.output
    assert f"removed {stale[0]}: a partial write left by a process that died" in r.stderr
    assert sorted(p.name for p in parent.iterdir()) == [".busy.partial-abc123", "other"]


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_engine_files_have_the_umask_modes(tiny_pair_dirs, tmp_path, umask, file_mode, dir_mode):
    """A shared filesystem's other users (the Slurm job's container user) read the engine."""
    out = tmp_path / "engine"
    old = os.umask(umask)
    try:
        r = CliRunner().invoke(main, _build_args(tiny_pair_dirs, out))
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    for p in [out, *out.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.is_dir():
            assert mode == dir_mode, (p, oct(mode))
        elif p.parent.name == "launch":  # launch scripts are executable
            assert mode & 0o444 == 0o444 & ~umask, (p, oct(mode))
        else:
            assert mode == file_mode, (p, oct(mode))


def test_no_progress_silences_the_libraries_bars(tiny_pair_dirs, tmp_path):
    """transformers draws its own "Loading weights" / "Writing model shards" bars; --no-progress
    must silence those too (a subprocess: disabling them is process-wide). A quantized build, so
    models are loaded, calibrated, exported and gated (a --quant none build only streams shards)."""
    cli = [sys.executable, "-m", "dflash_trt.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    work = ("--quant", "fp8", "--no-gate", "--calib-size", "2")
    quiet = subprocess.run(cli + _build_args(tiny_pair_dirs, tmp_path / "quiet", *work), capture_output=True,
                           text=True, cwd=ROOT, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "it/s" not in quiet.stderr and "Loading weights" not in quiet.stderr, quiet.stderr
    loud_args = [a for a in _build_args(tiny_pair_dirs, tmp_path / "loud", *work) if a != "--no-progress"]
    loud = subprocess.run(cli + loud_args, capture_output=True, text=True, cwd=ROOT, env=env)
    assert loud.returncode == 0 and "it/s" in loud.stderr  # the bars this test looks for do exist
