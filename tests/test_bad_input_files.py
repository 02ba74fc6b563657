"""Data and config files that are not what they claim end in one line, and never run code.

Each test reproduces a class of issue 24 with the real CLI (click's runner or a subprocess) on
real files: a crafted pickle whose payload creates a marker file (its absence proves no code ran),
drafter configs with a wrong type or range, a build spec that is not UTF-8, empty answer data.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from tests.bad_input import assert_one_line_error, write_code_pickle


@pytest.fixture()
def pair(tmp_path):
    from tests.conftest import save_tiny_pair

    return save_tiny_pair(tmp_path / "pair")


# -- answer files (.pt): draft-vocab --data, train-draft --extra-data, train-data's resume -----------------


def test_draft_vocab_refuses_an_answer_file_that_runs_code(pair, tmp_path):
    _, ddir = pair
    marker = tmp_path / "pwned"
    evil = write_code_pickle(tmp_path / "responses.pt", marker)
    r = CliRunner().invoke(main, ["draft-vocab", str(ddir), "--data", str(evil)])
    assert_one_line_error(r, str(evil), "refused to load")
    assert not marker.exists()  # the payload did not run
    assert not (ddir / "draft_vocab.json").exists()  # and nothing was written


def test_extra_data_and_resume_refuse_an_answer_file_that_runs_code(pair, tmp_path):
    from dflash_trt.train.answers import AnswerSettings
    from dflash_trt.train.data import extend_answer_file
    from dflash_trt.train.dataset import load_extra_data

    tdir, _ = pair
    marker = tmp_path / "pwned"
    evil = write_code_pickle(tmp_path / "sampled.pt", marker)
    with pytest.raises(DFlashError, match="refused to load"):
        load_extra_data([str(evil)])  # train-draft --extra-data
    with pytest.raises(DFlashError, match="refused to load"):
        extend_answer_file(tdir, evil, AnswerSettings(max_new_tokens=4, batch_size=1))  # resume of train-data / sampled
    assert not marker.exists()


def test_answer_files_round_trip_and_are_readable_by_others(tmp_path):
    """What this project writes still loads under weights_only (str/int/list/tensor rows), with
    the umask's mode (0644), not tempfile's 0600."""
    import torch

    from dflash_trt.train.data import load_data, save_data

    rows = [{"id": "p1", "category": "chat", "prompt_len": 2, "ids": [5, 6, 7, 8], "feats": torch.ones(4, 3)}]
    old = os.umask(0o022)
    try:
        save_data(tmp_path / "responses.pt", rows, {"capture_layer_ids": [1, 2], "temperature": 0.0})
    finally:
        os.umask(old)
    seqs, meta = load_data(tmp_path / "responses.pt")
    assert seqs[0]["ids"] == [5, 6, 7, 8] and torch.equal(seqs[0]["feats"], torch.ones(4, 3))
    assert meta["capture_layer_ids"] == [1, 2]
    assert (tmp_path / "responses.pt").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("blob, message", [
    ([1, 2, 3], 'no "sequences" list'),
    ({"sequences": [{"id": "a", "ids": [1, -2], "prompt_len": 1}]}, "sequences[0].ids is not a list of token ids"),
    ({"sequences": [{"id": "a", "ids": [1, 2], "prompt_len": 9}]}, "prompt_len=9 is not in 0..2"),
])
def test_malformed_answer_files_are_one_line(tmp_path, blob, message):
    import torch

    from dflash_trt.train.data import load_data

    torch.save(blob, tmp_path / "x.pt")
    with pytest.raises(DFlashError, match="x.pt: ") as e:
        load_data(tmp_path / "x.pt")
    assert message in str(e.value)


def test_draft_vocab_refuses_empty_data(pair, tmp_path):
    from dflash_trt.train.data import save_data

    _, ddir = pair
    save_data(tmp_path / "empty.pt", [], {})
    r = CliRunner().invoke(main, ["draft-vocab", str(ddir), "--data", str(tmp_path / "empty.pt")])
    assert_one_line_error(r, "no response tokens")
    assert not (ddir / "draft_vocab.json").exists()  # `serve` would refuse the engine later


# -- --allow-pickle: weights-only, and a refusal in one line ----------------------------------------------


def test_allow_pickle_drafter_with_code_is_refused_in_one_line(pair, tmp_path):
    tdir, ddir = pair
    marker = tmp_path / "pwned"
    (ddir / "model.safetensors").unlink()
    write_code_pickle(ddir / "pytorch_model.bin", marker, wrap=lambda p: {"fc.weight": p})
    r = CliRunner().invoke(main, ["generate", "hi", "--target", str(tdir), "--draft", str(ddir), "--allow-pickle",
                                  "--raw", "--max-new-tokens", "2"])
    assert_one_line_error(r, "pytorch_model.bin", "refused to unpickle")
    assert not marker.exists()


def test_allow_pickle_target_with_code_is_refused_in_one_line(pair, tmp_path):
    tdir, ddir = pair
    marker = tmp_path / "pwned"
    for f in tdir.glob("*.safetensors"):
        f.unlink()
    write_code_pickle(tdir / "pytorch_model.bin", marker, wrap=lambda p: {"model.embed_tokens.weight": p})
    r = CliRunner().invoke(main, ["generate", "hi", "--target", str(tdir), "--draft", str(ddir), "--allow-pickle",
                                  "--raw", "--max-new-tokens", "2"])
    assert_one_line_error(r, str(tdir), "refused to unpickle")
    assert not marker.exists()


# -- drafter config.json: every field's type and range ------------------------------------------------------


def _edit_draft(ddir: Path, key: str, value) -> None:
    cfg = json.loads((ddir / "config.json").read_text())
    if key in ("mask_token_id", "target_layer_ids") or key in cfg.get("dflash_config", {}):
        cfg["dflash_config"][key] = value
    else:
        cfg[key] = value
    (ddir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key, value, message", [
    ("block_size", "sixteen", "block_size='sixteen' is str, not an integer; accepted: an integer 2..64"),
    ("block_size", 100000, "block_size=100000 is out of range; accepted: 2..64"),
    ("block_size", 16.5, "is float, not an integer"),
    ("mask_token_id", -1, "mask_token_id=-1 is out of range; accepted: >= 0"),
    ("num_hidden_layers", 0, "num_hidden_layers=0 is out of range; accepted: 1..256"),
    ("hidden_size", True, "hidden_size=True is bool, not an integer"),
    ("num_attention_heads", None, "no num_attention_heads"),
    ("num_key_value_heads", 3, "does not divide num_attention_heads"),
    ("rms_norm_eps", "tiny", "rms_norm_eps='tiny' is not a number in (0.0, 1.0)"),
    ("target_layer_ids", [], "target_layer_ids=[] is not a non-empty list"),
    ("target_layer_ids", ["1"], "target_layer_ids[]='1' is str, not an integer"),
    ("intermediate_size", 10**9, "intermediate_size=1000000000 is out of range; accepted: 1..1048576"),
])
def test_drafter_config_fields_are_checked_with_their_range(pair, key, value, message):
    tdir, ddir = pair
    _edit_draft(ddir, key, value)
    r = CliRunner().invoke(main, ["build", "--target", str(tdir), "--draft", str(ddir), "--gpu", "cpu", "--dry-run"])
    assert_one_line_error(r, message)


def test_generate_refuses_a_huge_block_size(pair):
    tdir, ddir = pair
    _edit_draft(ddir, "block_size", 100000)
    r = CliRunner().invoke(main, ["generate", "hi", "--target", str(tdir), "--draft", str(ddir), "--raw"])
    assert_one_line_error(r, "block_size=100000 is out of range; accepted: 2..64")


# -- config files that are not UTF-8 ---------------------------------------------------------------------------


def test_build_spec_that_is_not_utf8_is_one_line(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"gpu: h100\nname: caf\xe9\n")  # latin-1, as an old editor saves it
    r = CliRunner().invoke(main, ["plan", "--spec", str(spec), "--target", "qwen3-8b"])
    assert_one_line_error(r, "is not UTF-8 text (byte 0xe9 at offset 19)", "save it as UTF-8")


def test_existing_safe_paths_still_work(pair, tmp_path):
    """The checks refuse bad input only: a drafter config as written by this project passes."""
    from dflash_trt.runtime.drafters.dflash import DFlashSettings
    from dflash_trt.runtime.drafters.config import check_drafter_config

    _, ddir = pair
    cfg = json.loads((ddir / "config.json").read_text())
    check_drafter_config(cfg, "ok")
    assert DFlashSettings.from_config_dict(cfg).block_size == 8
    shutil.rmtree(ddir)
