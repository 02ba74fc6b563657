"""Drafter checkpoint format (z-lab), safe loading, and pair validation messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime import DFlashDraftModel, build_target_layer_ids
from dflash_trt.runtime.drafters.loading import load_drafter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime.drafters.validate import validate_pair


def test_build_target_layer_ids_matches_published_qwen3_8b():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]


def _draft_logits(draft, target, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 5, len(draft.target_layer_ids) * draft.config.hidden_size, generator=g)
    emb = target.get_input_embeddings()(torch.randint(0, 128, (1, 4), generator=g))
    pos = torch.arange(9)[None]
    with torch.no_grad():
        return target.get_output_embeddings()(draft(ctx, emb, pos))


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    target = tiny_target("qwen3")
    draft = random_draft(target.config, num_layers=2, block_size=7, seed=3)
    draft.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 7
    assert set(cfg["dflash_config"]) >= {"mask_token_id", "target_layer_ids"}
    loaded = load_drafter(tmp_path / "d")
    assert torch.equal(_draft_logits(draft, target), _draft_logits(loaded, target))


def test_loading_in_bfloat16_equals_loading_in_float32_then_casting(tmp_path):
    """load_drafter builds the modules in the dtype asked for (no float32 copy beside the
    weights): every parameter and buffer, the rotary frequencies included, has the bits and dtype
    of the float32 load cast afterwards, and torch's default dtype is left as it was."""
    target = tiny_target("qwen3")
    random_draft(target.config, num_layers=2, block_size=7, seed=3).save_pretrained(tmp_path / "d")
    direct = load_drafter(tmp_path / "d", dtype=torch.bfloat16)
    cast = load_drafter(tmp_path / "d").to(torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    a = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    b = {**dict(cast.named_parameters()), **dict(cast.named_buffers())}
    assert sorted(a) == sorted(b) and any("rotary" in k for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_loads_zlab_layout_with_block_size_inside_dflash_config_and_never_runs_auto_map(tmp_path):
    """Published drafters carry auto_map -> remote code. Loading must read data only: the
    referenced module would write a marker file if it were ever imported."""
    target = tiny_target("llama")
    draft = random_draft(target.config, num_layers=1, block_size=16)
    d = tmp_path / "zlab"
    draft.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "EXECUTED"
    (d / "dflash.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    loaded = load_drafter(d)
    assert loaded.block_size == 16
    assert not marker.exists()


@pytest.fixture()
def pair(tmp_path):
    from tests.conftest import save_tiny_pair

    return save_tiny_pair(tmp_path)


def _edit(path: Path, **changes):
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"hidden_size": 32}, "hidden_size=32 but the target's hidden_size=64"),
        ({"target_layer_ids": [1, 9]}, "target_layer_ids=[1, 9] has [9] outside the target's layers 0..3"),
        ({"num_target_layers": 36}, "num_target_layers=36 but the target has 4 layers"),
        ({"mask_token_id": 128}, "mask_token_id=128 is outside the target vocabulary (0..127)"),
        ({"block_size": 1}, "block_size=1 is out of range; accepted: 2..64"),
    ],
)
def test_pair_validation_errors_name_field_values_and_fix(pair, changes, expected):
    tdir, ddir = pair
    _edit(ddir / "config.json", **changes)
    with pytest.raises(DFlashError) as err:
        load_pair(PairSource(tdir, ddir))
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_max_draft_len_must_be_below_block_size(pair):
    """K is checked where it is chosen (SpeculationSettings), against the drafter's block size."""
    from transformers import AutoConfig

    from dflash_trt.speculation import SpeculationSettings

    tdir, ddir = pair
    cfg = json.loads((ddir / "config.json").read_text())
    block = validate_pair(cfg, AutoConfig.from_pretrained(tdir)).block_size
    with pytest.raises(DFlashError, match=r"max_draft_len=8 \(--max-draft-len\) must be between 1 and block_size-1=7"):
        SpeculationSettings.for_block(block, 8)
    with pytest.raises(DFlashError, match=r"max_draft_len=0 \(--max-draft-len\) must be between 1 and block_size-1=7"):
        SpeculationSettings.for_block(block, 0)
    assert SpeculationSettings.for_block(block, 7).max_draft_len == 7


def test_missing_corrupt_and_pickle_weights_are_refused(pair):
    tdir, ddir = pair
    weights = ddir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashError, match="corrupt or truncated safetensors"):
        load_pair(PairSource(tdir, ddir))
    weights.unlink()
    with pytest.raises(DFlashError, match="no \\*.safetensors weight file"):
        load_pair(PairSource(tdir, ddir))
    torch.save({"fc.weight": torch.zeros(1)}, ddir / "pytorch_model.bin")
    with pytest.raises(DFlashError, match="pickle can execute code"):
        load_pair(PairSource(tdir, ddir))


def test_weights_that_do_not_match_config_are_refused(pair):
    tdir, ddir = pair
    _edit(ddir / "config.json", num_hidden_layers=2)
    with pytest.raises(DFlashError, match="missing .* tensors .*layers.1"):
        load_pair(PairSource(tdir, ddir))


def test_not_a_drafter_is_refused(pair):
    tdir, _ = pair
    with pytest.raises(DFlashError, match="is not a DFlash drafter"):
        load_pair(PairSource(tdir, tdir))


def test_missing_directory(tmp_path, pair):
    tdir, _ = pair
    with pytest.raises(DFlashError, match="drafter config not found"):
        load_pair(PairSource(tdir, tmp_path / "nope"))
    shutil.rmtree(tdir)


def test_sliding_attention_layers_follow_zlab_masking():
    """z-lab: with no `is_causal` in the config, sliding_attention layers are causal and windowed;
    full layers see the whole block. A window of 2 then hides everything but the last 2 keys.
    Without use_sliding_window, transformers' Qwen3Config (which z-lab 0.1.0 and vLLM read the
    window through) drops the window: that combination is refused rather than run either way."""
    from dflash_trt.runtime.drafters.dflash import make_draft_config

    target = tiny_target("qwen3")
    cfg = make_draft_config(target.config, num_layers=2, block_size=4)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=2)
    with pytest.raises(DFlashError, match="sliding_window=2 but use_sliding_window is not true"):
        DFlashDraftModel(cfg)
    cfg["use_sliding_window"] = True
    draft = DFlashDraftModel(cfg)
    sliding, full = (layer.self_attn for layer in draft.layers)
    assert sliding.is_causal and sliding.sliding_window == 2
    assert not full.is_causal and full.sliding_window is None
    cfg["is_causal"] = False
    assert not DFlashDraftModel(cfg).layers[0].self_attn.is_causal
    from dflash_trt.runtime.drafters.dflash import block_attention_mask

    m = block_attention_mask(2, 5, causal=True, window=2, device=torch.device("cpu"))[0, 0]
    assert m.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
