"""`dflash-trt generate` as users and scripts call it (a real subprocess-free click run)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.runtime import autoregressive_generate
from dflash_trt.runtime.targets.loading import load_target
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD, DRAFT_METHODS


def test_generate_json_fields_match_plain_greedy(rigged_pair_dirs):
    """A pair rigged to be accepted (tests/conftest.py): with a random drafter nothing is accepted and
    tau = 1 + accepted / steps would read 1 == 1."""
    tdir, ddir = rigged_pair_dirs
    res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "--draft", str(ddir), "--json",
                                    "--max-new-tokens", "12", "hello"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("prompt_ids", "output_ids", "text", "acceptance_lengths", "tau", "acceptance_rate",
                "total_draft_tokens", "total_accepted_draft_tokens", "per_position_acceptance", "ttft_s", "tpot_s"):
        assert key in out
    plain = autoregressive_generate(load_target(tdir), out["prompt_ids"], SamplingParams(max_tokens=12))
    assert out["output_ids"] == plain.output_ids
    assert out["total_accepted_draft_tokens"] > 0 and out["tau"] > 2
    assert abs(out["tau"] - (1 + out["total_accepted_draft_tokens"] / len(out["acceptance_lengths"]))) < 1e-9


@pytest.mark.parametrize("method", [m for m in DRAFT_METHODS if m != DEFAULT_DRAFT_METHOD])
def test_generate_takes_the_draft_method(tiny_pair_dirs, method):
    """--draft-method (each method but the default, so that dropping the flag shows) reaches the
    speculation settings whole, on the reference loop and the batched runtime, and a seed gives
    both the same text (a seeded row draws what the reference loop draws)."""
    tdir, ddir = tiny_pair_dirs
    outs = []
    for policy in ("fixed", "adaptive"):
        res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "--draft", str(ddir), "--json", "--policy",
                                        policy, "--draft-method", method, "--temperature", "0.9",
                                        "--seed", "5", "--max-new-tokens", "12", "hello"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["speculation"]["draft_method"] == method and out["speculation"]["policy"] == policy
        outs.append(out["output_ids"])
    assert outs[0] == outs[1]
    res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "--draft", str(ddir), "--draft-method", "beam", "x"])
    assert res.exit_code == 2 and "'beam' is not one of 'match', 'greedy', 'probabilistic'" in res.output


def test_generate_bad_input_is_one_line_and_nonzero(tiny_pair_dirs, tmp_path):
    tdir, _ = tiny_pair_dirs
    res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "--draft", str(tmp_path), "x"])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and res.output.startswith("error: ")
    res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "x"])
    assert res.exit_code == 2 and "pass both --target and --draft" in res.output


def test_every_command_has_help():
    runner = CliRunner()
    res = runner.invoke(main, ["--help"])
    assert res.exit_code == 0
    names = list(main.commands)
    assert {"generate", "build", "plan", "verify", "serve", "client", "deploy", "launch"} <= set(names)
    for name in names:
        r = runner.invoke(main, [name, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.output, name
    assert runner.invoke(main, ["--version"]).output.startswith("dflash-trt, version")
