"""Bad input on the device paths (issue 36) is one line and a non-zero exit, as everywhere else:
a `--device` this machine does not have, weights files that lie about their contents, tokenizer
files that cannot be read. `generate` and `build` refuse a weights file with the same line (one
check, checkpoints/streaming.py's header reader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main

try:
    from tests.bad_input import assert_one_line_error
except ImportError:  # tests/ is not a package
    from bad_input import assert_one_line_error

NO_CUDA = not torch.cuda.is_available()
MISSING_GPU = "sees no CUDA GPU" if NO_CUDA else "CUDA GPU(s) visible"


@pytest.mark.parametrize("device, needle", [
    pytest.param("cuda", "sees no CUDA GPU", marks=pytest.mark.skipif(not NO_CUDA, reason="a GPU is visible here")),
    ("cuda:99", MISSING_GPU),
    ("tpu", "give cpu, cuda or cuda:N"),
    ("mps", "the runtime runs on cpu or cuda[:N]"),
])
@pytest.mark.parametrize("command", ["bench", "train-data"])
def test_a_device_this_machine_lacks_is_one_line(tiny_pair_dirs, tmp_path, command, device, needle):
    """`bench --device cuda` on a CPU-only torch printed torch's "Torch not compiled with CUDA
    enabled" traceback; `train-data --device cuda` (and `python -m dflash_trt.train.sampled`,
    whose default it is) did too."""
    tdir, ddir = tiny_pair_dirs
    args = (["bench", "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "1"] if command == "bench" else
            ["train-data", str(tdir), str(tmp_path / "answers.pt"), "--max-prompts", "1"])
    r = CliRunner().invoke(main, [*args, "--device", device])
    assert_one_line_error(r, f"--device {device}" if device != "tpu" else "--device 'tpu'", needle)
    assert not (tmp_path / "answers.pt").exists()


def _rewrite_header(f: Path, edit) -> None:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header, next(k for k in header if k != "__metadata__"))
    blob = json.dumps(header).encode()
    f.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _claim_2_40_bytes(f: Path) -> None:
    _rewrite_header(f, lambda h, k: h[k].__setitem__("data_offsets", [h[k]["data_offsets"][0], 2**40]))


def _header_length_2_40(f: Path) -> None:
    f.write_bytes((2**40).to_bytes(8, "little") + f.read_bytes()[8:])


def _list_header(f: Path) -> None:
    f.write_bytes(len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]")


def _negative_shape(f: Path) -> None:
    _rewrite_header(f, lambda h, k: h[k].__setitem__("shape", [-1, *h[k]["shape"][1:]]))


def _a_directory(f: Path) -> None:
    f.unlink()
    f.mkdir()


WEIGHTS = {
    "truncated": (_truncate, "lies outside the file"),
    "offsets claim 2^40 bytes": (_claim_2_40_bytes, "lies outside the file"),
    "header length 2^40": (_header_length_2_40, "header length 1099511627776"),
    "header is a list": (_list_header, "header is a JSON list, not an object"),
    "negative dimension": (_negative_shape, "has shape [-1"),
    "a directory": (_a_directory, "cannot read it (Is a directory)"),
}


@pytest.mark.parametrize("command", ["generate", "build"])
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_weights_that_lie_are_one_line_for_generate_and_build(tiny_pair_dirs, tmp_path, command, case):
    """`generate --target` printed safetensors' traceback for a truncated model.safetensors or one
    whose header claims 2^40 bytes; `build` already refused both. Now one check answers both."""
    tdir, ddir = tiny_pair_dirs
    bad = tmp_path / "target"
    shutil.copytree(tdir, bad)
    damage, needle = WEIGHTS[case]
    damage(bad / "model.safetensors")
    args = (["generate", "--target", str(bad), "--draft", str(ddir), "--max-new-tokens", "2", "hi"]
            if command == "generate" else
            ["build", "--target", str(bad), "--draft", str(ddir), "--gpu", "cpu", "--max-seq-len", "256",
             "--out", str(tmp_path / "engine"), "--no-progress"])
    r = CliRunner().invoke(main, args)
    assert_one_line_error(r, f"{bad / 'model.safetensors'}:", needle)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("command", ["generate", "build"])
def test_a_tokenizer_that_cannot_be_read_is_one_line_not_bytes(tiny_pair_dirs, tmp_path, command):
    """`generate` used to fall back to encoding bytes (garbage for a real model) when the target's
    tokenizer files could not be read; `build` refused. Both refuse now, before loading weights."""
    tdir, ddir = tiny_pair_dirs
    bad = tmp_path / "target"
    shutil.copytree(tdir, bad)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (bad / "tokenizer_config.json").write_text("{}")
    args = (["generate", "--target", str(bad), "--draft", str(ddir), "hi"] if command == "generate" else
            ["build", "--target", str(bad), "--draft", str(ddir), "--gpu", "cpu", "--out", str(tmp_path / "e")])
    r = CliRunner().invoke(main, args)
    assert_one_line_error(r, f"{bad}: tokenizer files present but unreadable")
