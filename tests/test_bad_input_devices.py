"""Bad input on the device paths (issue 36) is one line and a non-zero exit, as everywhere else:
a `--device` this machine does not have (bench, train-data, serve, train-draft, and the pair loader
behind generate and serve), weights files that lie about their contents, tokenizer files that
cannot be read. `generate` and `build` refuse a weights file with the same line (one check,
checkpoints/streaming.py's header reader)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime_options import RuntimeOptions

try:
    from tests.bad_input import assert_one_line_error
    from tests.engine_fixtures import make_tiny_engine
except ImportError:  # tests/ is not a package
    from bad_input import assert_one_line_error
    from engine_fixtures import make_tiny_engine

NO_CUDA = not torch.cuda.is_available()
MISSING_GPU = "sees no CUDA GPU" if NO_CUDA else "CUDA GPU(s) visible"


LACKING = [
    pytest.param("cuda", "sees no CUDA GPU", marks=pytest.mark.skipif(not NO_CUDA, reason="a GPU is visible here"),
                 id="cuda"),
    pytest.param("cuda:99", MISSING_GPU, id="cuda:99"),
    pytest.param("tpu", "give cpu, cuda or cuda:N", id="tpu"),
    pytest.param("mps", "the runtime runs on cpu or cuda[:N]", id="mps"),
]


def _flag(device: str) -> str:
    return f"--device {device}" if device != "tpu" else "--device 'tpu'"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("devices"))


@pytest.mark.parametrize("device, needle", LACKING)
@pytest.mark.parametrize("command", ["bench", "train-data"])
def test_a_device_this_machine_lacks_is_one_line(tiny_pair_dirs, tmp_path, command, device, needle):
    """`bench --device cuda` on a CPU-only torch printed torch's "Torch not compiled with CUDA
    enabled" traceback; `train-data --device cuda` (and `python -m dflash_trt.train.sampled`,
    whose default it is) did too."""
    tdir, ddir = tiny_pair_dirs
    args = (["bench", "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "1"] if command == "bench" else
            ["train-data", str(tdir), str(tmp_path / "answers.pt"), "--max-prompts", "1"])
    r = CliRunner().invoke(main, [*args, "--device", device])
    assert_one_line_error(r, _flag(device), needle)
    assert not (tmp_path / "answers.pt").exists()


@pytest.mark.parametrize("device, needle", LACKING)
@pytest.mark.parametrize("command", ["serve", "train-draft"])
def test_serve_and_train_draft_refuse_a_device_this_machine_lacks(engine, tmp_path, command, device, needle):
    """`serve ENGINE --device` is checked before tritonserver starts (the pytorch backend will run
    on this machine); `train-draft --device` before the target loads."""
    args = (["serve", str(engine), "--backend", "pytorch", "--grpc-port", "0", "--metrics-port", "0"]
            if command == "serve" else ["train-draft", "--target", str(engine / "target"), "--out", str(tmp_path / "d")])
    r = CliRunner().invoke(main, [*args, "--device", device])
    last = assert_one_line_error(r, _flag(device), needle)
    assert last.startswith(f"error: {_flag(device)}")
    assert "tritonserver" not in r.output  # refused before it started
    assert not (tmp_path / "d").exists()


def test_the_served_runtime_refuses_meta(engine):
    """The pair loader takes `meta` (shapes only, for tests); the pytorch backend's own check
    refuses it before the engine's hashes and weights."""
    from dflash_trt.serving.backends import BackendSettings, load_backend

    with pytest.raises(DFlashError, match=r"^--device meta: the runtime runs on cpu or cuda\[:N\]$"):
        load_backend(engine, BackendSettings(backend="pytorch", device="meta"))


@pytest.mark.parametrize("device, needle", LACKING)
def test_the_pair_loader_refuses_a_device_before_the_weights(tiny_pair_dirs, tmp_path, device, needle):
    """generate has no --device (it decodes on the CPU); its pair loader (dflash_trt/pairs.py, also
    serve's and the Python API's) checks the device first: a truncated weights file behind it is
    never read."""
    tdir, ddir = tiny_pair_dirs
    bad = tmp_path / "target"
    shutil.copytree(tdir, bad)
    _truncate(bad / "model.safetensors")
    with pytest.raises(DFlashError, match=f"^{re.escape(_flag(device))}.*{re.escape(needle)}"):
        load_pair(PairSource(bad, ddir), RuntimeOptions(device=device))
    with pytest.raises(DFlashError, match="lies outside the file"):  # what the weights would have said
        load_pair(PairSource(bad, ddir), RuntimeOptions(device="cpu"))


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
