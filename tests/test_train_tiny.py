"""`dflash-trt train-draft` end to end on a tiny random pair: data, features, training, export."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel
from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate
from dflash_trt.runtime.targets.loading import load_target
from dflash_trt.sampling_params import SamplingParams


@pytest.mark.timeout(300)
def test_train_draft_writes_loadable_zlab_checkpoint_and_loss_decreases(tiny_pair_dirs, tmp_path):
    target_dir, _ = tiny_pair_dirs
    out = tmp_path / "drafter"
    res = CliRunner().invoke(main, [
        "train-draft", "--target", str(target_dir), "--out", str(out), "--max-prompts", "6",
        "--max-new-tokens", "40", "--steps", "80", "--block-size", "8", "--lr", "3e-3", "--seed", "1",
    ])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and set(cfg["dflash_config"]) >= {"mask_token_id", "target_layer_ids"}
    manifest = json.loads((out / "MANIFEST.json").read_text())
    hist = manifest["history"]
    assert manifest["steps"] == 80 and hist[-1]["loss"] < 0.7 * hist[0]["loss"]
    assert manifest["data"]["sequences"] == 6 and manifest["mask_token"]["id"] == cfg["dflash_config"]["mask_token_id"]
    assert not list(out.parent.glob(".drafter.partial-*"))  # atomic: nothing half-written left
    vocab = json.loads((out / "draft_vocab.json").read_text())  # the frequent-token draft vocabulary
    assert vocab["size"] == len(vocab["token_ids"]) == manifest["draft_vocab"]["size"] and vocab["coverage"] == 1.0

    # the exported drafter loads through the normal pair loader and decodes losslessly
    pair = load_pair(PairSource(target_dir, out))
    assert isinstance(pair.draft, DFlashDraftModel)
    assert pair.draft.draft_vocab is not None and pair.draft.draft_vocab.tolist() == vocab["token_ids"]
    prompt = [3, 14, 15, 92, 65]
    d = dflash_generate(pair.draft, pair.target, prompt, SamplingParams(max_tokens=24))
    a = autoregressive_generate(pair.target, prompt, SamplingParams(max_tokens=24))
    assert d.output_ids == a.output_ids


def test_train_draft_rejects_bad_flags_with_one_line(tiny_pair_dirs, tmp_path):
    target_dir, _ = tiny_pair_dirs
    res = CliRunner().invoke(main, ["train-draft", "--target", str(target_dir), "--out", str(tmp_path / "d"),
                                    "--target-layer-ids", "1,x"])
    assert res.exit_code != 0 and "comma-separated integers" in res.output
    res = CliRunner().invoke(main, ["train-draft", "--target", str(target_dir), "--out", str(tmp_path / "d"),
                                    "--target-layer-ids", "1,9", "--max-prompts", "2", "--max-new-tokens", "4"])
    assert res.exit_code != 0 and "outside the target's layers" in res.output
    assert len(res.output.strip().splitlines()[-1]) > 0 and "Traceback" not in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 10\nlearning_rate: 0.1\n")
    res = CliRunner().invoke(main, ["train-draft", "--target", str(target_dir), "--out", str(tmp_path / "d"),
                                    "--config", str(bad)])
    assert res.exit_code != 0 and "learning_rate" in res.output
    assert load_target(target_dir) is not None


def test_init_from_grows_a_drafter_without_changing_its_predictions(tmp_path):
    """--init-from copies a trained drafter into a deeper one whose extra layers start as the
    identity (zeroed output projections), so training resumes from the same predictions; a
    drafter with another mask token is refused with one line."""
    import torch

    from dflash_trt.errors import DFlashError
    from dflash_trt.runtime.tiny import random_draft, tiny_target
    from dflash_trt.train.drafter import init_from

    target = tiny_target("llama", seed=1, num_layers=4)
    src = random_draft(target.config, num_layers=1, block_size=8, seed=2, target_layer_ids=[0, 2, 3])
    src.save_pretrained(tmp_path / "src", dtype=torch.float32)
    grown = random_draft(target.config, num_layers=3, block_size=8, seed=5, target_layer_ids=[0, 2, 3])
    init_from(grown, tmp_path / "src")
    ctx = torch.randn(1, 6, 3 * target.config.hidden_size)
    noise = torch.randn(1, 8, target.config.hidden_size)
    pos = torch.arange(14)[None]
    with torch.no_grad():
        torch.testing.assert_close(grown(ctx, noise, pos), src(ctx, noise, pos))
    assert grown.layers[2].mlp.down_proj.weight.abs().sum() == 0 and grown.layers[2].mlp.up_proj.weight.abs().sum() > 0

    other = random_draft(target.config, num_layers=2, block_size=8, seed=2, target_layer_ids=[0, 1, 3])
    with pytest.raises(DFlashError, match="target_layer_ids"):
        init_from(other, tmp_path / "src")


def test_a_seed_fixes_the_weights_and_train_data_answers_are_train_drafts_own(tiny_pair_dirs, tmp_path):
    """Two runs of one config write byte-identical weights and history, another seed other
    weights; and a run on the answers `train-data` wrote (features captured at the drafter's
    layers) trains exactly as a run that generated them itself: one answer function."""
    import hashlib

    target_dir, _ = tiny_pair_dirs
    common = ["--target", str(target_dir), "--max-prompts", "4", "--max-new-tokens", "16", "--steps", "12",
              "--block-size", "8", "--target-layer-ids", "0,1", "--sampled-vocab", "30", "--no-progress"]

    def train(name: str, *extra: str) -> tuple[str, list]:
        out = tmp_path / name
        res = CliRunner().invoke(main, ["train-draft", *common, "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
        manifest = json.loads((out / "MANIFEST.json").read_text())
        figures = [{k: v for k, v in row.items() if k != "elapsed_s"} for row in manifest["history"]]  # not timings
        return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(), figures

    a = train("a", "--seed", "5")
    assert train("b", "--seed", "5") == a
    assert train("c", "--seed", "6")[0] != a[0]
    data = tmp_path / "job"
    res = CliRunner().invoke(main, ["train-data", str(target_dir), str(data / "responses.pt"), "--max-prompts", "4",
                                    "--max-new-tokens", "16", "--capture-layers", "0,1", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert train("d", "--seed", "5", "--data-dir", str(data)) == a
