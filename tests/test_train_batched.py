"""The GPU training path, run here on CPU: many sequences per step, features made online, and
the target's sampled answers as extra data. Each piece is checked against the one-sequence,
cached-feature path the embedded drafter was first trained with."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.prompts import Prompt
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.train.data import compute_features, save_data
from dflash_trt.train.objective import block_inputs, dflash_loss, dflash_loss_batch
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.train.answers import AnswerSettings, generate_answers
from dflash_trt.train.dataset import make_batch
from dflash_trt.train.step import online_features


def _pair():
    target = tiny_target("llama", seed=1, num_layers=4)
    draft = random_draft(target.config, num_layers=2, block_size=8, seed=2, target_layer_ids=[0, 2, 3])
    return target, draft


def _seqs(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"id": f"s{i}", "category": "code", "prompt_len": p,
             "ids": torch.randint(0, vocab - 1, (n,), generator=g).tolist()}
            for i, (p, n) in enumerate([(6, 40), (9, 23), (4, 31)])]


def test_one_padded_forward_gives_the_label_weighted_mean_of_per_sequence_losses():
    target, draft = _pair()
    adapter = TargetAdapter(target)
    seqs = _seqs(int(target.config.vocab_size))
    layer_ids = draft.target_layer_ids
    # (made in inference mode, so cloned before autograd sees them, as make_batch's padding does)
    feats = [f.clone() for f in compute_features(target, seqs, layer_ids, batch_size=3, dtype=torch.float32)]
    gen = torch.Generator().manual_seed(0)
    # 12 anchors: the 23-token row has only 13 positions to anchor, so rows get padded anchors
    batch = make_batch(seqs, feats, 12, gen, torch.device("cpu"))
    assert batch["anchor_ok"].sum(1).tolist() == [12, 12, 12]
    batch = make_batch(seqs, feats, 30, torch.Generator().manual_seed(0), torch.device("cpu"))
    n_ok = batch["anchor_ok"].sum(1).tolist()
    assert n_ok == [30, 13, 26] and batch["ids"].shape == (3, 40) and batch["feats"].shape[:2] == (3, 40)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    got, stats = dflash_loss_batch(draft, emb, head, batch["ids"], batch["lens"], batch["feats"], batch["anchors"],
                                   batch["anchor_ok"], 4.0)
    num = den = 0.0
    for r, s in enumerate(seqs):
        anchors = batch["anchors"][r, : n_ok[r]]
        ids = torch.tensor(s["ids"])
        loss, _ = dflash_loss(draft, emb, head, ids, feats[r], anchors, 4.0)
        _, _, _, valid = block_inputs(ids, anchors, 8, draft.mask_token_id)
        k = torch.arange(8).expand_as(valid)[valid]
        w = torch.exp(-(k - 1).float() / 4.0).sum()
        num, den = num + loss * w, den + w
    torch.testing.assert_close(got, num / den, rtol=1e-5, atol=1e-6)
    assert 1.0 <= stats["tau_est"] <= 8.0
    # with padded anchors and rows, one step still trains
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in draft.parameters() if p.requires_grad)
    del adapter


def test_online_features_of_a_padded_batch_equal_each_sequences_own_pass():
    target, draft = _pair()
    seqs = _seqs(int(target.config.vocab_size))
    batch = make_batch(seqs, None, 4, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert "feats" not in batch
    online = online_features(TargetAdapter(target), batch["ids"], draft.target_layer_ids)  # [3, 40, 3H]
    alone = compute_features(target, seqs, draft.target_layer_ids, batch_size=1, dtype=torch.float32)
    for r, f in enumerate(alone):
        torch.testing.assert_close(online[r, : f.shape[0]], f, rtol=1e-4, atol=1e-5)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"code-train-{i:03d}", "code", "train", f"write function number {i}") for i in range(n)]


def _sampled(target, n_prompts: int, seed: int, samples: int = 4, batch_size: int = 8, via: str = "auto",
             max_new_tokens: int = 12, temperature: float = 1.0) -> list[dict]:
    settings = AnswerSettings(samples=samples, temperature=temperature, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, seed=seed)
    return generate_answers(target, None, _prompts(n_prompts), settings, via=via)


def test_sampled_answers_are_k_per_prompt_reproducible_and_diverse():
    target, _ = _pair()
    eos = int(target.config.eos_token_id)
    rows = _sampled(target, 3, seed=3)
    assert [r["ids"] for r in _sampled(target, 3, seed=3)] == [r["ids"] for r in rows]  # the seed fixes the samples
    assert sorted(r["id"] for r in rows) == [f"code-train-{i:03d}#s{j}" for i in range(3) for j in range(4)]
    other = _sampled(target, 3, seed=4)
    assert [r["ids"] for r in other] != [r["ids"] for r in rows]  # and another seed draws others
    first = [r for r in rows if r["id"].startswith("code-train-000#")]
    prompt0 = first[0]["ids"][: first[0]["prompt_len"]]
    assert all(r["ids"][: r["prompt_len"]] == prompt0 for r in first)  # the prompt, unpadded
    assert len({tuple(r["ids"]) for r in first}) > 1  # different answers to one prompt
    for r in rows:
        resp = r["ids"][r["prompt_len"]:]
        assert 1 <= len(resp) <= 12 and (eos not in resp or resp.index(eos) == len(resp) - 1)


def test_hf_fallback_samples_the_same_row_format():
    """Targets the batched runtime does not run (sliding windows, sinks) sample through HF generate."""
    target, _ = _pair()
    rows = _sampled(target, 2, seed=0, samples=3, batch_size=6, via="hf", max_new_tokens=10)
    assert [r["id"] for r in rows] == [f"code-train-{i:03d}#s{j}" for i in range(2) for j in range(3)]
    codec = TextCodec(None, int(target.config.vocab_size))
    for i, r in enumerate(rows):
        prompt = codec.encode(_prompts(2)[i // 3].prompt)
        assert r["ids"][: len(prompt)] == prompt and r["prompt_len"] == len(prompt)
        assert 1 <= len(r["ids"]) - len(prompt) <= 10


def test_greedy_answers_cannot_be_sampled_twice():
    from dflash_trt.errors import DFlashError

    with pytest.raises(DFlashError, match="--temperature > 0"):
        AnswerSettings(samples=2)


def test_train_draft_online_batched_with_sampled_extra_data(tiny_pair_dirs, tmp_path):
    """The GPU recipe (scripts/gpu_drafter.sh) on CPU: --features online --batch-sequences N --extra-data."""
    target_dir, _ = tiny_pair_dirs
    from dflash_trt.runtime.targets.loading import load_target

    extra = _sampled(load_target(target_dir), 4, seed=1, samples=2, batch_size=8, max_new_tokens=24, temperature=0.8)
    usable = sum(len(r["ids"]) - r["prompt_len"] >= 2 for r in extra)
    save_data(tmp_path / "sampled.pt", extra, {"capture_layer_ids": None, "sampled": True})
    out = tmp_path / "drafter"
    res = CliRunner().invoke(main, [
        "train-draft", "--target", str(target_dir), "--out", str(out), "--max-prompts", "4",
        "--max-new-tokens", "24", "--steps", "12", "--block-size", "8", "--seed", "1", "--features", "online",
        "--batch-sequences", "3", "--extra-data", str(tmp_path / "sampled.pt"),
    ])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["steps"] == 12 and manifest["machine"]["features"] == "online"
    assert manifest["config"]["batch_sequences"] == 3
    greedy = manifest["data"]["sequences"] - usable
    assert 1 <= greedy <= 4 and manifest["data"]["extra_sequences"] == usable
    res = CliRunner().invoke(main, ["train-draft", "--target", str(target_dir), "--out", str(out),
                                    "--device", "cuda:0" if not torch.cuda.is_available() else "tpu"])
    assert res.exit_code != 0 and "--device" in res.output and "Traceback" not in res.output


def test_sampled_job_bad_input_is_one_line(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "dflash_trt.train.sampled", str(tmp_path / "nope"),
                          str(tmp_path / "out.pt"), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: target config not found")
    assert not (tmp_path / "out.pt").exists()
    run = subprocess.run([sys.executable, "-m", "dflash_trt.train.sampled", str(tmp_path), str(tmp_path / "o.pt"),
                          "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--temperature > 0" in run.stderr
