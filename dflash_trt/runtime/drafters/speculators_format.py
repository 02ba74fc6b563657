"""The speculators format of DFlash and DFlash2 drafters (speculators 0.9.0), both ways.

This module reads it (:func:`zlab_config`, :func:`zlab_state_of`: every drafter loader goes
through them); runtime/drafters/convert.py writes it (``dflash-trt convert-draft``). The table
below is both directions'.

vLLM loads drafters in this format as well as in z-lab's; TensorRT-LLM and z-lab read z-lab's
only. The same drafter in the two layouts (speculators 0.9.0: models/dflash/config.py,
models/dflash2/config.py, models/dflash/core.py; vLLM 0.32 transformers_utils/configs/speculators/
algos.py reads it back the way :func:`zlab_config_of` does):

=====================================  ==============================================================
z-lab config.json                      speculators config.json
=====================================  ==============================================================
architectures [DFlash(2)DraftModel]    speculators_model_type dflash / dflash2 (the family), and
                                       architectures [DFlashSpeculator] / [DFlash2DraftModel]
the Qwen3 layer fields (top level)     transformer_layer_config {...}
dflash_config.target_layer_ids = i     aux_hidden_state_layer_ids = i + 1 (speculators counts the
                                       embedding output as layer 0)
block_size, mask_token_id              block_size, mask_token_id (top level)
dflash_config.conv_* / selector_*      conv_* / selector_* (top level; dflash2 only)
is_causal: false                       sliding_window_non_causal: true (speculators' full-attention
is_causal absent                       sliding_window_non_causal: false  layers are always
is_causal: true                        -- (refused: no causal full-attention layers there)
vocab_size                             draft_vocab_size (== vocab_size: the full vocabulary)
num_target_layers                      num_target_layers (kept as an extra key: speculators' config
                                       classes accept extra keys and keep them)
=====================================  ==============================================================

Weights carry the same names in both (codebooks bare). A speculators checkpoint never stores the
verifier's embedding or head; ``embed_tokens``/``verifier_*`` tensors, which are the verifier's by
definition, are dropped when read. What this project does not run is refused in one line: a
reduced draft vocabulary (``d2t``/``t2d``/its own ``lm_head``), ``sample_from_anchor``, a target
hidden size other than the drafter's; and, writing speculators, z-lab's input_embedding_scale /
output_multiplier / final_logit_softcapping, which speculators has no field for (vLLM would run the
drafter without them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.drafters.families import CONFIG_NAME, detect_family, is_speculators

if TYPE_CHECKING:  # the command line imports this module for FORMATS: no torch at import time
    import torch

SPECULATORS_VERSION = "0.9.0"  # the version whose config classes tests/test_speculators_configs.py checks
# speculators' own defaults for keys a config may leave out (the config classes' Field defaults)
DEFAULTS: dict[str, dict[str, Any]] = {
    "dflash": {"block_size": 8, "sliding_window_non_causal": False, "sample_from_anchor": False},
    "dflash2": {"block_size": 8, "sliding_window_non_causal": True, "sample_from_anchor": False,
                "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
}
SPECULATOR_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel"}
# z-lab keys that are not the drafter's transformer layer config (speculators' converter's list,
# plus the keys that have their own speculators field)
NOT_LAYER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "is_causal",
                  "speculators_model_type")
NEWER_FIELDS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
VERIFIER_TENSORS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
REDUCED_VOCAB_TENSORS = ("d2t", "t2d", "lm_head.weight")
Format = Literal["zlab", "speculators"]
FORMATS: tuple[str, ...] = ("zlab", "speculators")


def _value(cfg: dict[str, Any], kind: str, name: str) -> Any:
    return cfg.get(name, DEFAULTS[kind].get(name))


def zlab_config_of(cfg: dict[str, Any], where: Any = "config.json") -> dict[str, Any]:
    """The z-lab config.json of a speculators DFlash/DFlash2 config (see the module docstring)."""
    family = detect_family(cfg, where)
    kind = family.speculators_type
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashError(f"{where}: transformer_layer_config={layer!r} is not an object; a speculators drafter "
                          "describes its layers there, fix config.json")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise DFlashError(f"{where}: transformer_layer_config.model_type={layer['model_type']!r}; this project runs "
                          "DFlash's Qwen3-style drafter layers (model_type qwen3)")
    if _value(cfg, kind, "sample_from_anchor"):
        raise DFlashError(f"{where}: sample_from_anchor=true drafts from the anchor slot too (block_size drafts); "
                          "this project, z-lab and vLLM draft block_size - 1 after the anchor, use such a drafter")
    vocab = layer.get("vocab_size")
    if cfg.get("draft_vocab_size", vocab) != vocab:
        raise DFlashError(f"{where}: draft_vocab_size={cfg.get('draft_vocab_size')} differs from the vocabulary "
                          f"({vocab}): a reduced draft vocabulary (d2t/t2d), which this project does not run; use a "
                          "full-vocabulary drafter")
    hidden = cfg.get("target_hidden_size")
    if hidden is not None and hidden != layer.get("hidden_size"):
        raise DFlashError(f"{where}: target_hidden_size={hidden} differs from the drafter's hidden_size="
                          f"{layer.get('hidden_size')}; this project's drafters share the target's hidden size")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise DFlashError(f"{where}: aux_hidden_state_layer_ids={aux!r} is not a non-empty list of layer ids; "
                          "fix config.json")
    if min(aux) < 1:
        raise DFlashError(f"{where}: aux_hidden_state_layer_ids has {min(aux)}: speculators' layer 0 is the "
                          "embedding output, which DFlash does not read; use ids of decoder layers (>= 1)")
    out = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map")}
    out["architectures"] = [family.architecture]
    out["model_type"] = "qwen3"
    dflash: dict[str, Any] = {"block_size": _value(cfg, kind, "block_size"), "mask_token_id": cfg.get("mask_token_id"),
                              "target_layer_ids": [i - 1 for i in aux]}
    for key in family.recipe_keys:
        dflash[key] = _value(cfg, kind, key)
    out["dflash_config"] = dflash
    if _value(cfg, kind, "sliding_window_non_causal"):
        out["is_causal"] = False  # z-lab: every layer bidirectional (speculators' full layers always are)
    if cfg.get("num_target_layers") is not None:
        out["num_target_layers"] = cfg["num_target_layers"]
    return out


def zlab_config(cfg: dict[str, Any], where: Any = CONFIG_NAME) -> dict[str, Any]:
    """`cfg` in z-lab's layout: a z-lab config as it is, a speculators config converted
    (:func:`zlab_config_of`). Every reader of a drafter config goes through this."""
    if isinstance(cfg, dict) and is_speculators(cfg):
        return zlab_config_of(cfg, where)
    return cfg


def zlab_state_of(state: dict[str, torch.Tensor], where: Any) -> dict[str, torch.Tensor]:
    """A speculators checkpoint's tensors as the drafter reads them: the verifier's dropped; a
    reduced vocabulary refused."""
    reduced = [k for k in REDUCED_VOCAB_TENSORS if k in state]
    if reduced:
        raise DFlashError(f"{where}: model.safetensors has {reduced[0]} (a speculators drafter with its own reduced "
                          "vocabulary and head), which this project does not run; use a full-vocabulary drafter")
    return {k: v for k, v in state.items() if k not in VERIFIER_TENSORS}
