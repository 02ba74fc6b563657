"""The multi-turn workload (bench/multiturn.py) on a tiny rigged pair: conversations resend their
history, later turns hit what earlier ones cached, and the cache changes no token and no step.

The text goes through a TextCodec without a tokenizer (bytes folded into the tiny vocabulary), so the
conversations are real text turned into ids the way a tokenizer-less target gets them."""

from __future__ import annotations

import pytest

from dflash_trt.bench.multiturn import (conversations, pooled_tau, run_conversations, steps_by_conversation, summary,
                                        tau_halfwidth)
from dflash_trt.runtime.batched.runtime import BatchedRuntime
from dflash_trt.runtime.batched.prefix_cache import BLOCK_TOKENS
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams

from tests.test_batched_dflash2 import rigged_pair

SYSTEM = "You are a careful assistant. " * 4  # ~110 bytes: three full blocks of the shared prefix


def _run(prefix_cache: bool):
    target, draft = rigged_pair("v1+fields")
    codec = TextCodec(None, target.config.vocab_size)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=480, prefix_cache=prefix_cache)).start()
    convs = [[f"q{c}{t} " * 3 for t in range(3)] for c in range(3)]
    return run_conversations(rt, codec, SYSTEM, convs, 2, lambda c, t: SamplingParams(max_tokens=12))


def test_turns_resend_their_history_hit_the_cache_and_decode_the_same_tokens_and_steps():
    on, wall_on = _run(True)
    off, wall_off = _run(False)
    assert [(r.conversation, r.turn) for r in on] == [(c, t) for c in range(3) for t in range(3)]
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert [r.acceptance_lengths for r in on] == [r.acceptance_lengths for r in off]
    assert all(r.num_cached_tokens == 0 for r in off)
    for r in on:  # each turn's prompt holds the previous turns: it grows, and from turn 1 on it hits
        if r.turn:
            prev = next(p for p in on if (p.conversation, p.turn) == (r.conversation, r.turn - 1))
            assert r.num_prompt_tokens > prev.num_prompt_tokens + prev.num_output_tokens - 1
            assert r.num_cached_tokens >= (prev.num_prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS > 0
    s_on, s_off = summary(on, wall_on), summary(off, wall_off)
    assert s_on["tau"] == s_off["tau"] > 1.5 and s_on["hit_rate"] > 0.3 and s_off["hit_rate"] == 0


def test_conversations_take_the_held_out_prompts_once_each():
    convs = conversations(5, 3)
    flat = [m for conv in convs for m in conv]
    assert len(convs) == 5 and all(len(c) == 3 for c in convs) and len(set(flat)) == 15


def test_taus_interval_is_over_conversations():
    steps = [[3, 1, 2], [1, 1], [4, 4, 1, 1]]
    assert pooled_tau(steps) == pytest.approx(18 / 9)
    assert tau_halfwidth([[2, 2], [2]]) == 0.0  # nothing varies
    assert 0 < tau_halfwidth(steps) < 1.5
    assert steps_by_conversation([]) == []


def test_the_command_writes_its_table_and_the_summary_docs_keep(rigged_pair_dirs, tmp_path):
    """`bench --workload multi-turn --out DIR`: bench.json, the table it printed (table.txt), and
    bench.summary.json.gz (bench/archive.py): the turns without their token ids, with the
    acceptance lengths tau's interval is bootstrapped from."""
    import json

    from click.testing import CliRunner

    from dflash_trt.bench.archive import NAME, read_json
    from dflash_trt.cli import main

    tdir, ddir = rigged_pair_dirs
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["bench", "--workload", "multi-turn", "--target", str(tdir), "--draft", str(ddir),
                                    "--concurrency", "2", "--turns", "2", "--conversations", "2",
                                    "--max-new-tokens", "8", "--system-prompt-tokens", "64", "--threads", "1",
                                    "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    table = (out / "table.txt").read_text()
    assert table.startswith("multi-turn: 2 conversations x 2 turns") and table in res.output
    whole, kept = json.loads((out / "bench.json").read_text()), read_json(out / NAME)
    assert kept["levels"] == whole["levels"] and kept["ttft_probe"] == whole["ttft_probe"]
    for side in ("on", "off"):
        turns, kept_turns = whole["records"][side]["2"], kept["records"][side]["2"]
        assert all(t["output_ids"] for t in turns) and not any("output_ids" in t for t in kept_turns)
        assert [t["acceptance_lengths"] for t in kept_turns] == [t["acceptance_lengths"] for t in turns]
