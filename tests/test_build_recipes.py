"""The default recipe of each --quant: which linear layers it quantizes (no full build).

The defaults are the ones that keep the embedded pair inside the acceptance gate
(docs/quantization.md has the measurements): mlp-only for both formats, NVFP4 with down_proj
left in 16 bits; gpt-oss as released gets NVIDIA's nvfp4_mlp_only unchanged.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.engine.recipes import modelopt_config, resolve_recipe
from dflash_trt.errors import DFlashError


def _quantized_projections(quant: str, recipe) -> set[str]:
    """Names (q_proj ... down_proj) of the linear layers ModelOpt quantizes under the recipe."""
    import modelopt.torch.quantization as mtq

    from dflash_trt.runtime.tiny import tiny_target

    model = tiny_target("llama", seed=3)
    mtq.quantize(model, modelopt_config(quant, "none", recipe), lambda m: m(torch.tensor([[1, 2, 3, 4, 5, 6]])))
    on = {n for n, mod in model.named_modules() if n.endswith("weight_quantizer") and mod.is_enabled}
    assert all(".layers." in n for n in on)  # lm_head and embeddings never
    return {n.split(".")[-2] for n in on}


@pytest.mark.parametrize("quant, expected", [("fp8", {"gate_proj", "up_proj", "down_proj"}),
                                             ("nvfp4", {"gate_proj", "up_proj"})])
def test_default_recipe_quantizes_the_mlp_and_nvfp4_keeps_down_proj(quant, expected):
    r = resolve_recipe(quant, "auto", None, is_moe=False, native_experts=None, num_layers=4)
    assert r.name == "mlp-only" and r.defaulted and r.keep_layers == ()
    assert r.keep_modules == (("down_proj",) if quant == "nvfp4" else ())
    assert _quantized_projections(quant, r) == expected


def test_an_explicit_recipe_is_modelopts_selection_as_is():
    r = resolve_recipe("nvfp4", "mlp-only", None, is_moe=False, native_experts=None, num_layers=4)
    assert r.keep_modules == () and not r.defaulted
    assert _quantized_projections("nvfp4", r) == {"gate_proj", "up_proj", "down_proj"}
    # and keep_modules opts the default out or in by name
    assert resolve_recipe("nvfp4", "auto", None, is_moe=False, native_experts=None, num_layers=4,
                          keep_modules=[]).keep_modules == ()
    full = resolve_recipe("fp8", "full", None, is_moe=False, native_experts=None, num_layers=4, keep_modules=["v_proj"])
    assert _quantized_projections("fp8", full) == {"q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_gpt_oss_as_released_keeps_nvidias_recipe_unchanged():
    r = resolve_recipe("nvfp4", "auto", None, is_moe=True, native_experts="mxfp4", num_layers=36)
    assert (r.name, r.keep_layers, r.keep_modules) == ("mlp-only", (), ())
    with pytest.raises(DFlashError, match="MXFP4"):
        resolve_recipe("nvfp4", "auto", None, is_moe=True, native_experts="mxfp4", num_layers=36,
                       keep_modules=["down_proj"])
    with pytest.raises(DFlashError, match="not linear layers"):
        resolve_recipe("nvfp4", "auto", None, is_moe=False, native_experts=None, num_layers=4, keep_modules=["w2"])


def test_plan_counts_nvfp4s_kept_down_proj_in_bf16():
    """Llama-3.1-8B (build/archs: hidden 4096, intermediate 14336, 32 layers), one GPU: each layer's
    down_proj [4096, 14336] kept in bf16 is 2 bytes a weight, where NVFP4 is 4 bits plus one FP8
    scale per 16 weights (0.5625 bytes) and two FP32 per-tensor scales (8 bytes)."""
    from dflash_trt.engine.builder import prepare
    from dflash_trt.engine.spec import resolve_spec

    def plan(recipe: str):
        spec = resolve_spec(None, {"target": "llama-3.1-8b", "quant": "nvfp4", "gpu": "b200", "recipe": recipe})
        return prepare(spec, need_checkpoints=False).plan

    auto, plain = plan("auto"), plan("mlp-only")
    weights = 4096 * 14336
    per_layer = 2 * weights - (weights // 2 + weights // 16 + 8)  # 84,410,360 bytes
    assert auto.target_quantized_bytes - plain.target_quantized_bytes == 32 * per_layer
    assert auto.recipe == "mlp-only (down_proj bf16)" and plain.recipe == "mlp-only"
