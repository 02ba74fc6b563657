"""Post-training quantization of the target with ModelOpt, exported as a unified HF checkpoint.

`mtq.quantize(model, cfg, forward_loop)` inserts fake-quant modules and calibrates their amax on
the calibration prompts; `export_hf_checkpoint` then writes real low-precision weights plus
`hf_quant_config.json` -- the format TensorRT-LLM (>= 1.x) and vLLM load directly. Which layers
are quantized is the recipe's (dflash_trt.engine.recipes); lm_head, embeddings and MoE routers
always stay in 16 bits, as upstream recipes keep them. FP8 KV-cache quantization adds ModelOpt's
`*[kv]_bmm_quantizer` entries. An MXFP4 source (gpt-oss) quantized to NVFP4 gets ModelOpt's
lossless cast of its experts (dflash_trt.engine.mxfp4_cast) between calibration and export.

The model may sit on the CPU or be spread over GPUs (a device map): calibration feeds token ids
to the embedding's device and accelerate's hooks carry activations through. The export writes
shards of at most EXPORT_SHARD_SIZE, so host memory holds one shard beside the model.

ModelOpt is imported with this module, which the builder imports BEFORE it loads a model: the
first import of ModelOpt keeps the frames on the stack at that moment alive (its plugin loader
holds a failed optional import's traceback), and a model referenced from one of them -- such as
this function's `model` argument, had it imported ModelOpt itself -- is never freed.

On a CPU: FP8 calibration works end to end; NVFP4 calibration and export work, but a forward of
the fake-quantized NVFP4 model asserts "amax must be a CUDA tensor" -- nothing here runs one (the
acceptance gate runs the EXPORTED weights through dflash_trt.checkpoints.dequant instead).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

from dflash_trt.checkpoints.placement import home_device
from dflash_trt.checkpoints.quiet import quiet_transformers
from dflash_trt.engine.recipes import ResolvedRecipe, modelopt_config
from dflash_trt.errors import DFlashError

EXPORT_SHARD_SIZE = "2GB"


def quantize_and_export(model: Any, quant: str, kv_cache_quant: str, recipe: ResolvedRecipe,
                        calib_ids: list[list[int]], export_dir: Path, dtype: Any = None, progress: bool = True,
                        mxfp4_source: Path | None = None,
                        before_export: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Calibrate `model` in place on `calib_ids` and export it to `export_dir` (unified HF format).

    Returns a report: quantized module count, and for an MXFP4 source cast to NVFP4 the cast's
    lossless-block count. `before_export(model)` sees the calibrated fake-quant model (weights AND
    activations quantized as ModelOpt simulates them; FP8 runs on a CPU) before export packs it.
    """
    import torch
    from tqdm import tqdm

    from dflash_trt.engine.mxfp4_cast import pin_expert_scales

    if not getattr(model.config, "architectures", None):
        # export_hf_checkpoint needs it to write a loadable config.json.
        model.config.architectures = [type(model).__name__]
    cast = mxfp4_source is not None and quant == "nvfp4"
    cfg = modelopt_config(quant, kv_cache_quant, recipe, static_expert_weights=cast)
    device = home_device(model)

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for ids in tqdm(calib_ids, desc=f"calibrate {quant}", unit="prompt", disable=not progress, file=sys.stderr):
                m(torch.tensor([ids], device=device))

    report: dict[str, Any] = {}
    # ModelOpt prints progress to stdout; keep stdout clean for --json consumers.
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
        report["quantized_modules"] = _count_quantized(model)
        if report["quantized_modules"] == 0:
            raise DFlashError(f"recipe {recipe.name} quantized no layer of this target ({type(model).__name__}); "
                              "use recipe full")
        if cast:
            report["mxfp4_cast"] = pin_expert_scales(model, mxfp4_source).to_dict()
        if before_export is not None:
            before_export(model)
        if dtype is not None:
            _cast_parameters(model, dtype)
        with quiet_transformers(progress, prints_to=sys.stderr):
            export_hf_checkpoint(model, dtype=dtype, export_dir=export_dir, max_shard_size=EXPORT_SHARD_SIZE)
    return report


def _cast_parameters(model: Any, dtype: Any) -> None:
    """Every parameter of `model` in `dtype`, and its config saying so: a model that ran in float32
    (a CPU without native bf16, see engine.builder's compute dtype) exports as the one loaded in
    `dtype` would. ModelOpt casts only the weights it quantizes; the embeddings, norms and lm_head
    would stay float32. In place, one parameter at a time (no second copy of the model); the
    quantizers' amax buffers stay float32, as they are in a bf16 model."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    model.config.dtype = dtype


def _count_quantized(model: Any) -> int:
    """Modules with at least one enabled weight quantizer."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    owners = set()
    for name, mod in model.named_modules():
        if isinstance(mod, TensorQuantizer) and mod.is_enabled and name.endswith("weight_quantizer"):
            owners.add(name.rpartition(".")[0])
    return len(owners)
