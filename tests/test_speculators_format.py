"""The speculators format (runtime/drafters/speculators_format.py): read as a drafter, converted both ways by
`dflash-trt convert-draft`, round trips bit-exact, one-line refusals for what this project does not
run. The files it writes are checked against speculators 0.9.0's own config classes in
tests/test_speculators_configs.py (integration tier)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.checkpoints.files import load_state_dict, save_safetensors_atomic
from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.drafters.config import draft_value
from dflash_trt.runtime.drafters.loading import load_drafter
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.runtime.drafters.convert import convert_drafter
from dflash_trt.runtime.drafters.speculators_format import zlab_config
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams

from tests.test_zlab_oracle import rig

DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
               "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def config_meaning(raw: dict) -> tuple[dict, dict, dict]:
    """What a drafter config says, however it says it: the layers' config as transformers'
    Qwen3Config holds it (every default filled in, rope_theta as rope_parameters), the fields
    outside it, and each DFlash key as z-lab reads it (dflash_config first, then the top level)."""
    from transformers import Qwen3Config

    from dflash_trt.runtime.drafters.dflash import _qwen3_kwargs

    cfg = zlab_config(raw)
    outside = ("architectures", "num_target_layers", "is_causal")
    layer_fields = {k: v for k, v in cfg.items() if k not in ("dflash_config", *DFLASH_KEYS, *outside)}
    layers = Qwen3Config(**_qwen3_kwargs(layer_fields)).to_dict()
    layers.pop("transformers_version", None)
    return (layers, {k: cfg.get(k) for k in outside},
            {k: draft_value(cfg, k) for k in DFLASH_KEYS if draft_value(cfg, k) is not None})


def meaning(directory) -> tuple[dict, dict, dict]:
    return config_meaning(json.loads((directory / "config.json").read_text()))


def assert_same_weights(a, b) -> None:
    sa, sb = load_state_dict(a), load_state_dict(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# every value away from speculators' defaults (block 8; conv 2 x 16; selector 256 x 16), so a field
# that is written under the wrong name cannot pass as its default
RECIPE = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
VARIANTS = {
    "dflash": dict(family="dflash"),
    "dflash-bf16": dict(family="dflash", save_dtype=torch.bfloat16),
    "dflash2": dict(family="dflash2", block_size=16, dflash2_recipe=RECIPE),
    "dflash2-sliding": dict(family="dflash2", block_size=16, dflash2_recipe=RECIPE, num_layers=2,
                            extra={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32,
                                   "use_sliding_window": True, "is_causal": False}),
}


def save_variant(root, name: str, rigged: bool = False):
    """The variant's random drafter for a tiny target (`rigged`: the pair rigged to be accepted as
    tests/test_zlab_oracle.rig rigs it), saved in z-lab's format -> (target, its directory)."""
    v = dict(VARIANTS[name])
    target = tiny_target("qwen3", seed=1)
    extra, save_dtype = v.pop("extra", {}), v.pop("save_dtype", None)
    draft = random_draft(target.config, seed=2, **v, **({"num_key_value_heads": 4} if rigged else {}))
    if rigged:
        rig(target, draft)
    draft.raw_config.update(extra)
    out = root / name
    draft.save_pretrained(out, dtype=save_dtype)
    return target, out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trips_are_bit_exact(tmp_path, name):
    _, zdir = save_variant(tmp_path, name)
    runner = CliRunner()
    for src, out, to in ((zdir, tmp_path / "s", "speculators"), (tmp_path / "s", tmp_path / "z", "zlab"),
                         (tmp_path / "z", tmp_path / "s2", "speculators")):
        res = runner.invoke(main, ["convert-draft", str(src), str(out), "--to", to, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout.strip().splitlines()[-1])["format"] == to
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_model_type"] == VARIANTS[name]["family"]
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in meaning(zdir)[2]["target_layer_ids"]]
    assert spec["sliding_window_non_causal"] is (name == "dflash2-sliding")
    assert meaning(tmp_path / "z") == meaning(zdir) == meaning(tmp_path / "s")  # zlab -> speculators -> zlab
    assert json.loads((tmp_path / "s2" / "config.json").read_text()) == spec  # speculators -> zlab -> speculators
    for d in ("s", "z", "s2"):
        assert_same_weights(zdir, tmp_path / d)


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_a_speculators_drafter_runs_as_its_zlab_twin(tmp_path, name):
    """The same steps, on a pair rigged to be accepted: a random drafter's acceptance lengths are all
    1, whatever each twin drafts."""
    target, zdir = save_variant(tmp_path, name, rigged=True)
    convert_drafter(zdir, tmp_path / "s", "speculators")
    ours, theirs = load_drafter(zdir, torch.float64), load_drafter(tmp_path / "s", torch.float64)
    assert type(ours) is type(theirs) and ours.target_layer_ids == theirs.target_layer_ids
    target.save_pretrained(tmp_path / "target")
    pair = load_pair(PairSource(tmp_path / "target", tmp_path / "s"), RuntimeOptions(dtype="float32", pack=False))  # validate_pair reads it too
    assert type(pair.draft) is type(ours)
    params = SamplingParams(max_tokens=24)
    target = target.double()
    steps = dflash_generate(ours, target, [1, 2, 3], params).stats.acceptance_lengths
    assert steps == dflash_generate(theirs, target, [1, 2, 3], params).stats.acceptance_lengths
    assert max(steps) > 4 and min(steps) < max(steps), steps  # long accepted runs, and rejections


def _speculators_dir(tmp_path, edit=None, tensors=None):
    _, zdir = save_variant(tmp_path, "dflash")
    convert_drafter(zdir, tmp_path / "s", "speculators")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    if edit:
        edit(cfg)
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_state_dict(tmp_path / "s")
        state.update(tensors)
        save_safetensors_atomic(state, tmp_path / "s" / "model.safetensors")
    return tmp_path / "s"


READ_REFUSALS = {
    "reduced vocabulary": (dict(edit=lambda c: c.update(draft_vocab_size=64)),
                           "draft_vocab_size=64 differs from the vocabulary \\(128\\): a reduced draft vocabulary"),
    "d2t": (dict(tensors={"d2t": torch.zeros(64, dtype=torch.long)}), "model.safetensors has d2t"),
    "own head": (dict(tensors={"lm_head.weight": torch.zeros(128, 64)}), "model.safetensors has lm_head.weight"),
    "sample_from_anchor": (dict(edit=lambda c: c.update(sample_from_anchor=True)), "sample_from_anchor=true"),
    "target_hidden_size": (dict(edit=lambda c: c.update(target_hidden_size=128)), "target_hidden_size=128 differs"),
    "embedding as a layer": (dict(edit=lambda c: c.update(aux_hidden_state_layer_ids=[0, 2])),
                             "aux_hidden_state_layer_ids has 0: speculators' layer 0 is the embedding output"),
    "unknown type": (dict(edit=lambda c: c.update(speculators_model_type="eagle3")),
                     "speculators_model_type='eagle3' is not a drafter this project runs"),
    "other layers": (dict(edit=lambda c: c["transformer_layer_config"].update(model_type="llama")),
                     "transformer_layer_config.model_type='llama'"),
}


@pytest.mark.parametrize("case", list(READ_REFUSALS))
def test_what_this_project_does_not_run_is_refused_in_one_line(tmp_path, case):
    kw, message = READ_REFUSALS[case]
    src = _speculators_dir(tmp_path, **kw)
    with pytest.raises(DFlashError, match=message) as err:
        load_drafter(src)
    assert "\n" not in str(err.value)
    res = CliRunner().invoke(main, ["convert-draft", str(src), str(tmp_path / "z"), "--to", "zlab"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and not (tmp_path / "z").exists()


def test_what_speculators_cannot_say_is_refused_when_writing_it(tmp_path):
    runner = CliRunner()
    for name, edit, message in (
        ("causal", {"is_causal": True}, "is_causal=true makes full-attention layers causal"),
        ("scaled", {"dflash_config": {"input_embedding_scale": 8.0}}, "input_embedding_scale=8.0 has no field in "
                                                                       "the speculators format"),
    ):
        _, zdir = save_variant(tmp_path / name, "dflash")
        cfg = json.loads((zdir / "config.json").read_text())
        for k, v in edit.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
        (zdir / "config.json").write_text(json.dumps(cfg))
        res = runner.invoke(main, ["convert-draft", str(zdir), str(tmp_path / name / "s"), "--to", "speculators"])
        assert res.exit_code == 2 and message in res.output and not (tmp_path / name / "s").exists(), res.output
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def test_convert_draft_writes_atomically_and_never_over_its_source(tmp_path):
    _, zdir = save_variant(tmp_path, "dflash")
    runner = CliRunner()
    res = runner.invoke(main, ["convert-draft", str(zdir), str(zdir), "--to", "zlab"])
    assert res.exit_code == 2 and "is the source drafter itself" in res.output
    assert runner.invoke(main, ["convert-draft", str(zdir), str(tmp_path / "s"), "--to", "speculators"]).exit_code == 0
    res = runner.invoke(main, ["convert-draft", str(zdir), str(tmp_path / "s"), "--to", "speculators"])
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    assert runner.invoke(main, ["convert-draft", str(zdir), str(tmp_path / "s"), "--to", "speculators",
                                "--force"]).exit_code == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial directory left
    res = runner.invoke(main, ["convert-draft", str(zdir), str(tmp_path / "x"), "--to", "eagle"])
    assert res.exit_code == 2 and "'eagle' is not one of 'zlab', 'speculators'" in res.output


def test_build_refuses_a_speculators_drafter_with_the_conversion_to_run(tmp_path):
    from dflash_trt.engine.builder import prepare
    from dflash_trt.engine.spec import resolve_spec

    target, zdir = save_variant(tmp_path, "dflash")
    target.save_pretrained(tmp_path / "target")
    convert_drafter(zdir, tmp_path / "s", "speculators")
    spec = resolve_spec(None, {"target": str(tmp_path / "target"), "draft": str(tmp_path / "s"), "gpu": "h100"})
    with pytest.raises(DFlashError, match="convert it first: dflash-trt convert-draft .* --to zlab"):
        prepare(spec)
