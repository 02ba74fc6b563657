"""train-draft's data stage: the target's greedy answers and its features, from the
continuous-batching runtime (and the HF ``generate`` fallback), checked against batch-1 greedy
decoding and against a separate target pass over the finished sequences."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.prompts import Prompt
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras
from dflash_trt.runtime.reference.generate import autoregressive_generate
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.train.answers import AnswerSettings, generate_answers
from dflash_trt.train.data import compute_features

LAYERS = [0, 2, 3]
TEXTS = ["hi", "a longer prompt than the others", "x", "mid length one", "??", "seven", "tokens!"]


def _prompts() -> list[Prompt]:
    return [Prompt(f"p{i}", "chat", "train", t) for i, t in enumerate(TEXTS)]


def test_answers_are_batch1_greedy_and_features_match_a_separate_target_pass():
    """7 prompts of mixed lengths through 3 rows (rows are reused as answers finish): every answer
    equals single-sequence greedy decoding, stops at eos, and the captured features equal the
    features of a fresh target pass over the finished sequence at every fed position."""
    target = tiny_target("llama", seed=3, num_layers=4)
    vocab = int(target.config.vocab_size)
    # an eos that the first prompt's answer really emits, so stopping early is exercised
    eos = autoregressive_generate(target, TextCodec(None, vocab).encode(TEXTS[0]), SamplingParams(max_tokens=4)).output_ids[2]
    target.config.eos_token_id = eos
    saved: list[int] = []
    rows = generate_answers(target, None, _prompts(), AnswerSettings(max_new_tokens=12, batch_size=3,
                                                                     capture_layer_ids=tuple(LAYERS)),
                            on_batch=lambda done: saved.append(len(done)))
    assert sorted(r["id"] for r in rows) == [p.id for p in _prompts()]
    assert saved == [3, 6, 7]  # partial results after every `batch_size` answers, then the rest
    hit_eos = 0
    for r in rows:
        prompt = TextCodec(None, vocab).encode(TEXTS[int(r["id"][1:])])
        ref = autoregressive_generate(target, prompt, SamplingParams(max_tokens=12, stop_token_ids=[eos]))
        assert r["prompt_len"] == len(prompt) and r["ids"] == prompt + ref.output_ids
        hit_eos += r["ids"][-1] == eos
        assert r["feats"].dtype == torch.bfloat16 and r["feats"].shape == (len(r["ids"]) - 1, 3 * 64)
    full = compute_features(target, rows, LAYERS, dtype=torch.float32)
    for r, f in zip(rows, full):
        torch.testing.assert_close(r["feats"].float(), f[: len(r["ids"]) - 1], rtol=2e-2, atol=2e-2)
    assert hit_eos >= 1


def test_hf_fallback_gives_the_same_rows():
    """The HF ``generate`` path (used for targets the runtime refuses) writes the same rows."""
    target = tiny_target("llama", seed=4, num_layers=4)
    settings = AnswerSettings(max_new_tokens=10, batch_size=4, capture_layer_ids=tuple(LAYERS))
    rows = generate_answers(target, None, _prompts(), settings)
    hf = generate_answers(target, None, _prompts(), settings, via="hf")
    assert [h["id"] for h in hf] == [p.id for p in _prompts()]
    by_id = {r["id"]: r for r in rows}
    for h in hf:
        r = by_id[h["id"]]
        assert h["ids"] == r["ids"] and h["prompt_len"] == r["prompt_len"]
        torch.testing.assert_close(h["feats"].float(), r["feats"].float(), rtol=2e-2, atol=2e-2)


def test_capture_layer_ids_are_checked():
    target = tiny_target("llama", seed=0, num_layers=4)
    with pytest.raises(DFlashError, match="must name target layers 0..3"):
        BatchedRuntime(target, None, RuntimeOptions(max_batch=2, max_seq_len=32),
                       None, RuntimeExtras(capture_layer_ids=[1, 4])).start()


def test_train_data_job_extends_its_file_and_refuses_other_settings(tiny_pair_dirs, tmp_path):
    """`dflash-trt train-data`: the answers of the first N
    train prompts; a second run with more prompts keeps the first run's rows and adds the rest;
    a run with other settings is refused, the file untouched."""
    from click.testing import CliRunner

    from dflash_trt.cli import main
    from dflash_trt.runtime.targets.loading import load_target
    from dflash_trt.train.answers import train_prompts
    from dflash_trt.train.data import load_data

    target_dir, _ = tiny_pair_dirs
    out = tmp_path / "answers.pt"
    args = ["train-data", str(target_dir), str(out), "--max-new-tokens", "6", "--no-progress"]
    res = CliRunner().invoke(main, [*args, "--max-prompts", "3"])
    assert res.exit_code == 0, res.output
    first, meta = load_data(out)
    assert [r["id"] for r in first] == [p.id for p in train_prompts(0, 3)]
    assert (meta["samples"], meta["temperature"], meta["max_new_tokens"]) == (1, 0.0, 6)
    # the same answers the library function gives for those prompts
    again = generate_answers(load_target(target_dir), None, train_prompts(0, 3), AnswerSettings(max_new_tokens=6))
    assert [r["ids"] for r in again] == [r["ids"] for r in first]

    res = CliRunner().invoke(main, [*args, "--max-prompts", "5"])
    assert res.exit_code == 0 and "(2 new)" in res.output, res.output
    grown, _ = load_data(out)
    assert grown[:3] == first and sorted(r["id"] for r in grown) == sorted(p.id for p in train_prompts(0, 5))

    res = CliRunner().invoke(main, [*args, "--max-prompts", "5", "--samples", "2", "--temperature", "0.7"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "holds answers made with other settings (samples=1 there, 2 here, temperature=0.0 there, 0.7 here)" \
        in res.output
    assert load_data(out)[0] == grown
