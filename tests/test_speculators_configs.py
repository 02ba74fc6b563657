"""What `convert-draft --to speculators` writes reads as intended under speculators 0.9.0's OWN config
and model classes, and what those classes write reads back here as the same drafter.

speculators 0.9.0 is installed with --no-deps into its own directory of the project's cache (the
oracle of scripts/oracles.txt, with what importing its config classes needs: its package __init__
imports datasets and hs-connectors) and run in a child process on the project's torch and
transformers (5.14; speculators accepts 5.0 to 5.19), never imported here. The child loads each
config.json with ``SpeculatorModelConfig.from_pretrained`` (which picks the class by
speculators_model_type), builds speculators' DFlash/DFlash2 model from it, loads our weights into
it (strict=False, as speculators' own converter does) and saves the config again with speculators'
writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_trt.runtime.drafters.convert import convert_drafter

try:
    from tests.oracles import SPECULATORS, oracle_dir
    from tests.test_speculators_format import VARIANTS, assert_same_weights, meaning, save_variant
except ImportError:  # tests/ is not a package
    from oracles import SPECULATORS, oracle_dir
    from test_speculators_format import VARIANTS, assert_same_weights, meaning, save_variant

CHILD = r"""
import json, os, sys
from importlib.metadata import version
from safetensors.torch import load_file
from speculators import SpeculatorModelConfig
from speculators.models.dflash.core import DFlashDraftModel
from speculators.models.dflash2.core import DFlash2DraftModel

out = {"version": version("speculators")}
for d, resaved in zip(sys.argv[1::2], sys.argv[2::2]):
    c = SpeculatorModelConfig.from_pretrained(d)
    tl = c.transformer_layer_config
    missing = unexpected = None
    if os.path.isfile(d + "/model.safetensors"):
        cls = DFlash2DraftModel if c.speculators_model_type == "dflash2" else DFlashDraftModel
        missing, unexpected = cls(config=c).load_state_dict(load_file(d + "/model.safetensors"), strict=False)
        missing, unexpected = sorted(missing), sorted(unexpected)
    out[d] = {
        "class": type(c).__name__, "architectures": c.architectures, "aux": c.aux_hidden_state_layer_ids,
        "block_size": c.block_size, "mask_token_id": c.mask_token_id, "draft_vocab_size": c.draft_vocab_size,
        "target_vocab_size": c.target_vocab_size, "non_causal": c.sliding_window_non_causal,
        "sample_from_anchor": c.sample_from_anchor, "num_target_layers": getattr(c, "num_target_layers", None),
        "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens,
        "recipe": {k: getattr(c, k, None) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k")},
        "layers": {"model_type": tl.model_type, "hidden_size": tl.hidden_size, "num_hidden_layers":
                   tl.num_hidden_layers, "layer_types": tl.layer_types, "sliding_window": tl.sliding_window,
                   "head_dim": tl.head_dim, "num_key_value_heads": tl.num_key_value_heads,
                   "rope_theta": tl.rope_parameters["rope_theta"]},
        "missing": missing, "unexpected": unexpected,
    }
    c.save_pretrained(resaved)
print(json.dumps(out))
"""
VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def read_with_speculators(pairs: list[tuple[Path, Path]]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(oracle_dir(SPECULATORS)), "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = [str(p) for pair in pairs for p in pair]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("version") == "0.9.0"
    return {Path(k): v for k, v in out.items()}


def test_speculators_reads_what_we_write_and_we_read_what_it_writes(tmp_path):
    pairs, sources = [], {}
    for name in VARIANTS:
        _, zdir = save_variant(tmp_path / "src", name)
        convert_drafter(zdir, tmp_path / name, "speculators", verifier="org/some-target")
        pairs.append((tmp_path / name, tmp_path / f"{name}-resaved"))
        sources[name] = zdir
    got = read_with_speculators(pairs)
    for name, (spec_dir, resaved) in zip(VARIANTS, pairs):
        g, (layers, top, flash) = got[spec_dir], meaning(sources[name])
        dflash2 = name.startswith("dflash2")
        assert g["class"] == ("DFlash2SpeculatorConfig" if dflash2 else "DFlashSpeculatorConfig"), name
        assert g["architectures"] == (["DFlash2DraftModel"] if dflash2 else ["DFlashSpeculator"])
        assert g["aux"] == [i + 1 for i in flash["target_layer_ids"]]
        assert (g["block_size"], g["speculative_tokens"], g["mask_token_id"]) == (flash["block_size"],
                                                                                 flash["block_size"] - 1,
                                                                                 flash["mask_token_id"])
        assert g["draft_vocab_size"] == g["target_vocab_size"] == layers["vocab_size"]
        assert g["non_causal"] is (top.get("is_causal") is False) and g["sample_from_anchor"] is False
        assert g["num_target_layers"] == top["num_target_layers"]
        if dflash2:
            assert g["recipe"] == {k: flash[k] for k in g["recipe"]}
        for key in ("hidden_size", "head_dim", "num_hidden_layers", "num_key_value_heads", "layer_types",
                    "sliding_window"):
            assert g["layers"][key] == layers[key], (name, key)
        assert g["layers"]["rope_theta"] == layers["rope_parameters"]["rope_theta"]
        # every tensor we wrote is one of speculators' model; what is missing is the verifier's own
        assert g["unexpected"] == [] and set(g["missing"]) <= VERIFIER_OWNED, name
        # speculators' own writer, read back here: the same drafter
        for f in ("model.safetensors",):
            (resaved / f).write_bytes((spec_dir / f).read_bytes())
        assert meaning(resaved) == meaning(sources[name]), name
        convert_drafter(resaved, tmp_path / f"{name}-zlab", "zlab")
        assert meaning(tmp_path / f"{name}-zlab") == meaning(sources[name])
        assert_same_weights(sources[name], tmp_path / f"{name}-zlab")


def test_speculators_defaults_read_as_speculators_means_them(tmp_path):
    """A config that leaves speculators' defaulted fields out means its classes' defaults: a dflash2
    speculator is bidirectional (sliding_window_non_causal True) with conv 2 x 16 and a selector
    256 x 16; a dflash one is not. Checked against the classes by writing the minimal config,
    letting speculators resave it in full, and reading both here."""
    from dflash_trt.runtime.drafters.speculators_format import zlab_config_of

    try:
        from tests.test_speculators_format import config_meaning
    except ImportError:
        from test_speculators_format import config_meaning

    pairs = []
    for kind in ("dflash", "dflash2"):
        _, zdir = save_variant(tmp_path / "src", kind)
        convert_drafter(zdir, tmp_path / kind, "speculators")
        cfg = json.loads((tmp_path / kind / "config.json").read_text())
        for key in ("block_size", "sliding_window_non_causal", "sample_from_anchor", "conv_kernel_size",
                    "conv_group_size", "selector_rank", "selector_top_k"):
            cfg.pop(key, None)
        (tmp_path / kind / "config.json").write_text(json.dumps(cfg))
        (tmp_path / kind / "model.safetensors").unlink()  # a config-only check: the defaults resize the weights
        pairs.append((tmp_path / kind, tmp_path / f"{kind}-resaved"))
    read_with_speculators(pairs)
    for spec_dir, resaved in pairs:
        ours = config_meaning(json.loads((spec_dir / "config.json").read_text()))
        assert ours == config_meaning(json.loads((resaved / "config.json").read_text())), spec_dir.name
        full = zlab_config_of(json.loads((resaved / "config.json").read_text()))
    assert full["dflash_config"]["selector_rank"] == 256 and full["is_causal"] is False
    assert "is_causal" not in zlab_config_of(json.loads((pairs[0][1] / "config.json").read_text()))
