"""A tampered engine never verifies, and prompts are refused in one place.

The engine is built by the real builder from the tiny pair (tests/conftest.py), then copied and
altered the way a hostile or careless user would: an edited manifest figure, a `files` entry or
a link leading outside the engine, changed weights. `verify`, `deploy triton` and `deploy slurm`
must refuse each in one line. Prompts: the tokenizer contract (runtime/decoding/tokens.py) refuses empty,
non-UTF-8 and too-long prompts for `generate`, `serve` and `bench` alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.manifest import MANIFEST_NAME
from dflash_trt.errors import InvalidRequest
from tests.bad_input import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built_engine(tiny_pair_dirs, tmp_path_factory) -> Path:
    tdir, ddir = tiny_pair_dirs
    out = tmp_path_factory.mktemp("built") / "engine"
    r = CliRunner().invoke(main, ["build", "--target", str(tdir), "--draft", str(ddir), "--gpu", "cpu",
                                  "--max-seq-len", "256", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture()
def engine(built_engine, tmp_path) -> Path:
    copy = tmp_path / "engine"
    shutil.copytree(built_engine, copy)
    return copy


def _edit_manifest(engine: Path, section: str, key: str, value) -> None:
    path = engine / MANIFEST_NAME
    m = json.loads(path.read_text())
    if section:
        m[section][key] = value
    else:
        m[key] = value
    path.write_text(json.dumps(m))


def test_the_untouched_engine_verifies(engine):
    r = CliRunner().invoke(main, ["verify", str(engine)])
    assert r.exit_code == 0 and r.stdout.startswith("ok:"), r.output


@pytest.mark.parametrize("section, key, value, message", [
    ("draft", "block_size", 16, "says draft.block_size=16 but draft/config.json has 8"),
    ("draft", "target_layer_ids", [0], "says draft.target_layer_ids=[0] but draft/config.json has"),
    ("draft", "mask_token_id", 1, "says draft.mask_token_id=1 but draft/config.json has"),
    ("target", "hidden_size", 4096, "says target.hidden_size=4096 but target/config.json has"),
    ("target", "num_layers", 36, "says target.num_layers=36 but target/config.json has 4"),
    ("limits", "max_seq_len", 4096, "says limits.max_seq_len=4096 but llm_api_options.yaml max_seq_len has 256"),
    ("limits", "max_batch_size", 64, "says limits.max_batch_size=64 but llm_api_options.yaml max_batch_size has"),
    ("limits", "max_draft_len", 3, "says limits.max_draft_len=3 but llm_api_options.yaml speculative_config"),
])
def test_an_edited_manifest_figure_does_not_verify(engine, section, key, value, message):
    _edit_manifest(engine, section, key, value)
    r = CliRunner().invoke(main, ["verify", str(engine)])
    assert_one_line_error(r, message, "rebuild or re-copy the engine")


@pytest.mark.parametrize("rel", ["../../../../etc/hostname", "/etc/hostname", "target/../../outside.bin"])
def test_a_files_entry_outside_the_engine_is_refused_before_it_is_read(engine, rel):
    m = json.loads((engine / MANIFEST_NAME).read_text())
    m["files"][rel] = "0" * 64
    (engine / MANIFEST_NAME).write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(engine)])
    assert_one_line_error(r, f"files entry {rel!r} is not a relative path inside the engine directory")


def test_a_link_leading_outside_the_engine_is_refused(engine, tmp_path):
    """A symbolic link listed with the right hash would otherwise verify and be loaded."""
    from dflash_trt.engine.verify import sha256_file

    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not part of the engine\n")
    (engine / "notes.txt").symlink_to(outside)
    m = json.loads((engine / MANIFEST_NAME).read_text())
    m["files"]["notes.txt"] = sha256_file(outside)
    (engine / MANIFEST_NAME).write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(engine)])
    assert_one_line_error(r, "notes.txt leads outside the engine directory")


def _alter_weights(engine: Path) -> None:
    weights = next((engine / "target").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern in the last tensor's data: the header still parses
    weights.write_bytes(bytes(data))


def test_deploy_triton_refuses_altered_weights(engine, tmp_path):
    _alter_weights(engine)
    r = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "repo")])
    assert_one_line_error(r, "model.safetensors is modified or corrupt")
    assert not (tmp_path / "repo").exists()


def test_deploy_slurm_refuses_altered_weights(engine, tmp_path):
    _alter_weights(engine)
    r = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(tmp_path / "jobs")])
    assert_one_line_error(r, "model.safetensors is modified or corrupt")
    assert not (tmp_path / "jobs" / "serve.sbatch").exists()
    # (a CPU engine: its jobs run the pytorch backend, TensorRT-LLM is never handed one)
    ok = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(tmp_path / "jobs"), "--no-verify",
                                   "--backend", "pytorch"])
    assert ok.exit_code == 0, ok.output  # the escape hatch: scripts from the manifest alone


# -- prompts ---------------------------------------------------------------------------------------------------


def test_empty_prompt_is_one_line():
    r = CliRunner().invoke(main, ["generate", "--tiny", "--raw", ""])
    assert_one_line_error(r, "the prompt is empty")


def test_prompt_argument_that_is_not_utf8_is_one_line():
    """Python decodes invalid argv bytes to lone surrogates; encoding them later raised a
    TypeError inside the tokenizer (a subprocess: the bytes go through the real argv)."""
    r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--tiny", b"caf\xe9"],
                       capture_output=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_one_line_error(r, "the prompt is not valid UTF-8 (byte 0xe9 at character 3)")


def test_generate_refuses_a_prompt_longer_than_the_engines_max_seq_len(tmp_path):
    from tests.engine_fixtures import make_tiny_engine

    eng = make_tiny_engine(tmp_path, max_seq_len=64)
    r = CliRunner().invoke(main, ["generate", "word " * 100, "--engine", str(eng), "--raw", "--max-new-tokens", "4"])
    assert_one_line_error(r, "the prompt is 201 tokens, the engine's max_seq_len=64", "shorten the prompt to under 64")
    budget = CliRunner().invoke(main, ["generate", "word " * 25, "--engine", str(eng), "--raw", "--max-new-tokens", "40"])
    assert_one_line_error(budget, "the prompt is 51 tokens and 40 more are asked for, over the engine's "
                                  "max_seq_len=64", "at most 24 tokens")
    fits = CliRunner().invoke(main, ["generate", "word " * 5, "--engine", str(eng), "--raw", "--max-new-tokens", "4"])
    assert fits.exit_code == 0, fits.output


def test_the_codec_refuses_for_every_caller():
    """serve and bench encode through the same TextCodec: the refusal is an InvalidRequest (400)."""
    from dflash_trt.runtime.decoding.tokens import TextCodec

    codec = TextCodec(None, 256, max_seq_len=16)
    assert len(codec.encode("x" * 15, raw=True)) == 15
    with pytest.raises(InvalidRequest, match="max_seq_len=16"):
        codec.encode("x" * 16, raw=True)
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        codec.encode_messages([{"role": "user", "content": "caf\udce9"}])
    with pytest.raises(InvalidRequest, match="is empty"):
        codec.encode("")
