"""Quantization recipes: WHICH layers a `--quant` format applies to, as data.

A recipe names a module selection; the format (fp8 / nvfp4) comes from `--quant`. The ModelOpt
config is the format's preset narrowed to the recipe's selection, using ModelOpt's own presets
for the selection (NVFP4_MLP_ONLY_CFG / NVFP4_EXPERTS_ONLY_CFG name the modules; the FP8 variant
reuses those names with FP8's quantizer settings), so what "mlp-only" means is what ModelOpt's
`hf_ptq.py --qformat nvfp4_mlp_only` means.

- full: every linear layer except lm_head, embeddings and MoE routers (ModelOpt's
  FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG).
- mlp-only: the MLP / expert linear layers; attention stays in 16 bits.
- experts-only: MoE expert layers only (MoE targets).

`keep_layers` additionally leaves whole decoder layers in 16 bits (the sensitive ones);
`keep_modules` leaves one kind of linear layer (e.g. `down_proj`) in 16 bits in every layer.

Defaults (`recipe: auto`), see docs/quantization.md for the measurements behind them:
- gpt-oss as released (MXFP4 experts): mlp-only, NVIDIA's recipe (`hf_ptq.py --qformat
  nvfp4_mlp_only --cast_mxfp4_to_nvfp4`: on gpt-oss the MLP *is* the experts; attention stays
  bf16 as in the release).
- other targets: DEFAULT_RECIPES / DEFAULT_KEEP_MODULES below, the recipe that keeps the
  embedded pair inside the acceptance gate: mlp-only for both formats, and for NVFP4 the MLP's
  down_proj left in 16 bits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from dflash_trt.errors import DFlashError

RecipeName = Literal["auto", "full", "mlp-only", "experts-only"]
RECIPES = ("full", "mlp-only", "experts-only")

# --quant -> the ModelOpt preset of that format over every linear layer.
FULL_PRESETS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
# recipe -> the ModelOpt preset whose enabled quantizer names define the selection.
SELECTION_PRESETS = {"mlp-only": "NVFP4_MLP_ONLY_CFG", "experts-only": "NVFP4_EXPERTS_ONLY_CFG"}
KV_PRESETS = {"fp8": "FP8_KV_CFG"}

# --quant -> default recipe for dense targets and MoE targets whose experts ship in 16 bits.
DEFAULT_RECIPES: dict[str, str] = {"fp8": "mlp-only", "nvfp4": "mlp-only"}
DEFAULT_KEEP_LAYERS: dict[str, tuple[int, ...]] = {"fp8": (), "nvfp4": ()}
# Why NVFP4 keeps down_proj (scripts/quant_recipes.py --sensitivity, docs/quantization.md): on the
# embedded pair down_proj alone carries half of mlp-only's logit KL and all of its teacher-forced
# tau drop (4.2% vs 3.8% for the whole MLP; gate_proj + up_proj: 1.3%). down_proj's input is the
# gated product, the activations with the largest outliers, which a 4-bit grid with one scale per
# 16 values rounds hardest (the same reason llama.cpp's K-quant mixes give ffn_down more bits).
# No single decoder layer stands out enough to keep instead: the first/last two layers kept cut the
# KL by a third and not the tau drop. FP8 weights cost no measurable tau (teacher-forced drop
# -1.2% [-3.0%, +0.8%]), so FP8 keeps NVIDIA's mlp-only as is.
DEFAULT_KEEP_MODULES: dict[str, tuple[str, ...]] = {"fp8": (), "nvfp4": ("down_proj",)}
# Linear layers of a decoder layer a recipe may keep (Llama / Qwen names; MoE experts use the MLP's).
KEEPABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Targets that ship MXFP4 experts (gpt-oss): NVIDIA's recipe for both formats.
MXFP4_DEFAULT_RECIPE = "mlp-only"


@dataclass(frozen=True)
class ResolvedRecipe:
    name: str  # full | mlp-only | experts-only
    keep_layers: tuple[int, ...]
    defaulted: bool  # True when chosen by `auto`
    keep_modules: tuple[str, ...] = ()  # linear layers left in 16 bits in every decoder layer

    def describe(self) -> str:
        keep = f", layers {list(self.keep_layers)} kept in 16 bits" if self.keep_layers else ""
        keep += f", {'/'.join(self.keep_modules)} kept in 16 bits" if self.keep_modules else ""
        return f"{self.name}{keep}" + (" (default)" if self.defaulted else "")


def resolve_recipe(quant: str, recipe: str, keep_layers: list[int] | None, *, is_moe: bool,
                   native_experts: str | None, num_layers: int,
                   keep_modules: list[str] | None = None) -> ResolvedRecipe | None:
    """The recipe a build uses (None for --quant none); DFlashError for one that cannot apply.

    `auto` adds the format's default kept layers / modules; a recipe named explicitly is ModelOpt's
    selection as is, plus only what keep_layers / keep_modules say."""
    if quant == "none":
        return None
    defaulted = recipe == "auto"
    if defaulted:
        name = MXFP4_DEFAULT_RECIPE if native_experts == "mxfp4" else DEFAULT_RECIPES[quant]
        # gpt-oss as released: NVIDIA's recipe exactly (the lossless cast covers every expert tensor)
        keep = tuple(DEFAULT_KEEP_LAYERS[quant]) if native_experts is None else ()
        modules = tuple(DEFAULT_KEEP_MODULES[quant]) if native_experts is None else ()
    else:
        name, keep, modules = recipe, (), ()
    if keep_layers is not None:
        keep = tuple(keep_layers)
    if keep_modules is not None:
        modules = tuple(keep_modules)
    unknown = [m for m in modules if m not in KEEPABLE_MODULES]
    if unknown:
        raise DFlashError(f"keep_modules {unknown} are not linear layers of a decoder layer; use some of "
                          f"{', '.join(KEEPABLE_MODULES)}")
    if native_experts == "mxfp4" and modules:
        raise DFlashError("keep_modules does not apply to a target with MXFP4 experts (the cast converts every "
                          "expert tensor); use keep_layers")
    if name == "experts-only" and not is_moe:
        raise DFlashError("recipe experts-only quantizes MoE experts, and this target is dense (no experts); "
                          "use recipe mlp-only or full")
    bad = [i for i in keep if not -num_layers <= i < num_layers]
    if bad:
        raise DFlashError(f"keep_layers {bad} outside the target's {num_layers} layers; use indices 0..{num_layers - 1} "
                          "(or negative from the end)")
    keep = tuple(i if i >= 0 else num_layers + i for i in keep)
    return ResolvedRecipe(name, tuple(sorted(set(keep))), defaulted, tuple(dict.fromkeys(modules)))


def _preset(name: str) -> dict[str, Any]:
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise DFlashError(f"quantization needs nvidia-modelopt ({e}); pip install 'dflash-trt[quant]'")
    return copy.deepcopy(getattr(mtq, name))


def _format_rules(full: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(weight quantizer cfg, input quantizer cfg) of a format's full preset."""
    rules = full["quant_cfg"]
    weight = next(r["cfg"] for r in rules if r.get("quantizer_name") == "*weight_quantizer")
    act = next(r["cfg"] for r in rules if r.get("quantizer_name") == "*input_quantizer")
    return weight, act


def modelopt_config(quant: str, kv_cache_quant: str, recipe: ResolvedRecipe,
                    static_expert_weights: bool = False) -> dict[str, Any]:
    """The ModelOpt quantize config (0.47: `quant_cfg` is an ordered list; later rules win).

    `static_expert_weights`: expert weight quantizers calibrate per-block amax statically, as
    ModelOpt's MXFP4 -> NVFP4 cast needs (hf_ptq's force_weight_quantizers_static): the cast then
    pins those amax values to the source's MXFP4 exponents (dflash_trt.engine.mxfp4_cast).
    """
    full = _preset(FULL_PRESETS[quant])
    if recipe.name == "full":
        cfg = full
    else:
        weight, act = _format_rules(full)
        selection = _preset(SELECTION_PRESETS[recipe.name])
        rules = []
        for r in selection["quant_cfg"]:
            name = r.get("quantizer_name", "")
            if "cfg" in r and name.endswith("weight_quantizer"):
                rules.append({"quantizer_name": name, "cfg": copy.deepcopy(weight)})
            elif "cfg" in r and name.endswith("input_quantizer"):
                rules.append({"quantizer_name": name, "cfg": copy.deepcopy(act)})
            else:
                rules.append(copy.deepcopy(r))  # the "*" disable first, the standard exclusions after
        cfg = {**full, "quant_cfg": rules}
    rules = list(cfg["quant_cfg"])
    for i in recipe.keep_layers:
        rules.append({"quantizer_name": f"*layers.{i}.*", "enable": False})
    for m in recipe.keep_modules:  # its weight and input quantizers: `mlp.down_proj.weight_quantizer`, and
        # fused experts' `experts.down_proj_weight_quantizer` (ModelOpt's gpt-oss plugin); the leading dot
        # keeps `up_proj` from matching `gate_up_proj`
        rules.append({"quantizer_name": f"*.{m}*", "enable": False})
    if static_expert_weights:
        for k, r in enumerate(rules):
            bs = (r.get("cfg") or {}).get("block_sizes")
            if "experts" in r.get("quantizer_name", "") and r["quantizer_name"].endswith("weight_quantizer") \
                    and isinstance(bs, dict):
                rules[k] = {**r, "cfg": {**r["cfg"], "block_sizes": {**bs, "type": "static"}}}
    if kv_cache_quant != "none":
        rules += list(_preset(KV_PRESETS[kv_cache_quant])["quant_cfg"])
    return {**cfg, "quant_cfg": rules}
