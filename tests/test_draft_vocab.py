"""The frequency-ranked draft vocabulary (runtime/drafters/draft_vocab.py): how it is ranked, stored and
validated, and that drafting over a subset never changes the output (verification keeps the full
vocabulary), however small the subset."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime import autoregressive_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, batched_generate
from dflash_trt.runtime.drafters.loading import load_drafter
from dflash_trt.runtime.drafters.draft_vocab import (
    FILE,
    DraftVocabHead,
    count_tokens,
    draft_vocab_from_data,
    load_draft_vocab,
    rank_vocab,
    save_draft_vocab,
)
from dflash_trt.runtime.batched.policy import FixedPolicy
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.train.data import save_data


def test_ranking_counts_response_tokens_only_most_frequent_first():
    seqs = [{"ids": [9, 9, 9, 5, 5, 7], "prompt_len": 2},  # prompt tokens 9, 9 are not counted
            {"ids": [1, 5, 3, 3], "prompt_len": 1}]
    counts = count_tokens(seqs, vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 2, 0, 3, 0, 1, 0, 1]
    assert rank_vocab(counts, 10).tolist() == [5, 3, 7, 9]  # seen tokens only, ties by id
    assert rank_vocab(counts, 2).tolist() == [5, 3]
    assert rank_vocab(counts, 3, always=[0]).tolist() == [0, 5, 3]  # e.g. the stop token, always kept
    ids, coverage = draft_vocab_from_data(seqs, 10, 2)
    assert ids.tolist() == [5, 3] and coverage == pytest.approx(5 / 7)
    with pytest.raises(DFlashError, match=">= 1"):
        rank_vocab(counts, 0)


def test_save_load_round_trip_and_bad_files_are_refused(tmp_path):
    assert load_draft_vocab(tmp_path, 100) is None  # no file: draft over the full vocabulary
    save_draft_vocab(tmp_path, torch.tensor([7, 3, 42], dtype=torch.int32), coverage=0.9)
    doc = json.loads((tmp_path / FILE).read_text())
    assert doc["size"] == 3 and doc["coverage"] == 0.9
    assert load_draft_vocab(tmp_path, 100).tolist() == [7, 3, 42]
    for bad, why in (([7, 3, 420], "0..99"), ([7, 7], "distinct"), ([], "non-empty"), ("x", "non-empty")):
        (tmp_path / FILE).write_text(json.dumps({"token_ids": bad}))
        with pytest.raises(DFlashError, match=why if why != "distinct" else "distinct ids"):
            load_draft_vocab(tmp_path, 100)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_draft_vocab(tmp_path, 100)


def test_head_argmax_is_the_full_heads_argmax_restricted_to_the_subset():
    weight = torch.randn(50, 16)
    ids = torch.tensor([4, 17, 30, 2, 49])
    hidden = torch.randn(3, 5, 16)  # [B, k, H]
    with torch.inference_mode():
        got = DraftVocabHead(weight, ids)(hidden)
    want = ids[(hidden @ weight[ids].T).argmax(-1)]
    assert got.shape == (3, 5) and torch.equal(got, want)


@pytest.mark.parametrize("size", [2, 1000])
def test_batched_output_is_unchanged_whatever_the_draft_vocabulary(tiny_pair_dirs, tmp_path, size):
    """A 2-token subset misses almost every target token (acceptance ~0), a large one covers all
    tokens of a data file: both decode exactly the plain greedy text."""
    tdir, ddir = tiny_pair_dirs
    draft_dir = tmp_path / "draft"
    shutil.copytree(ddir, draft_dir)
    prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8], [11, 12]]
    pair = load_pair(PairSource(tdir, draft_dir))
    truth = [autoregressive_generate(pair.target, p, SamplingParams(max_tokens=20)).output_ids for p in prompts]
    # the subset: tokens of the target's own answers (as train-draft counts them), capped at `size`
    seqs = [{"ids": p + t, "prompt_len": len(p)} for p, t in zip(prompts, truth)]
    save_draft_vocab(draft_dir, rank_vocab(count_tokens(seqs, pair.target.config.vocab_size), size))
    draft = load_drafter(draft_dir)
    assert draft.draft_vocab is not None and 1 <= draft.draft_vocab.numel() <= size
    rt = BatchedRuntime(pair.target, draft, RuntimeOptions(max_batch=3, max_seq_len=64),
                        None, RuntimeExtras(policy=FixedPolicy(7))).start()
    assert rt.stats()["draft_vocab"] == draft.draft_vocab.numel()
    out = batched_generate(draft, pair.target, prompts, SamplingParams(max_tokens=20), runtime=rt)
    assert [r.output_ids for r in out] == truth
    full = BatchedRuntime(pair.target, draft, RuntimeOptions(max_batch=3, max_seq_len=64),
                          None, RuntimeExtras(policy=FixedPolicy(7), use_draft_vocab=False)).start()
    assert full.draft_head is None and full.stats()["draft_vocab"] == pair.target.config.vocab_size


def test_a_draft_vocabulary_beyond_the_targets_vocabulary_is_refused(tiny_pair_dirs):
    tdir, ddir = tiny_pair_dirs
    pair = load_pair(PairSource(tdir, ddir))
    pair.draft.draft_vocab = torch.tensor([1, pair.target.config.vocab_size])  # e.g. made for another target
    with pytest.raises(DFlashError, match="beyond the target's vocabulary"):
        BatchedRuntime(pair.target, pair.draft, RuntimeOptions(max_batch=1, max_seq_len=32)).start()
    BatchedRuntime(pair.target, pair.draft, RuntimeOptions(max_batch=1, max_seq_len=32),
                   None, RuntimeExtras(use_draft_vocab=False)).start()  # opting out works


def test_draft_vocab_command_writes_the_file_and_refuses_bad_input(tiny_pair_dirs, tmp_path):
    _, ddir = tiny_pair_dirs
    draft_dir = tmp_path / "draft"
    shutil.copytree(ddir, draft_dir)
    data = tmp_path / "responses.pt"
    save_data(data, [{"id": "a", "category": "code", "prompt_len": 1, "ids": [5, 6, 6, 9]}], {})
    res = CliRunner().invoke(main, ["draft-vocab", str(draft_dir), "--data", str(data), "--size", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads((draft_dir / FILE).read_text())["token_ids"] == [6, 9]  # response tokens only (5 is the prompt)
    assert "2 token ids" in res.output
    res = CliRunner().invoke(main, ["draft-vocab", str(tmp_path), "--data", str(data)])  # no config.json here
    assert res.exit_code != 0 and "drafter config not found" in res.output and "Traceback" not in res.output
