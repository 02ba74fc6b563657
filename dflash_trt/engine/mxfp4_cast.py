"""The lossless MXFP4 -> NVFP4 cast of gpt-oss's experts, NVIDIA's way.

ModelOpt's recipe (`examples/hf_ptq/hf_ptq.py --qformat nvfp4_mlp_only --cast_mxfp4_to_nvfp4`,
NVIDIA/Model-Optimizer PR #1372): calibrate with the expert weight quantizers in static-block
NVFP4 mode, then pin each one's two-level scale to the source's MXFP4 exponents before export:

- per tensor: global_amax = 6 * 448 * 2^(k_max - 8), i.e. weight_scale_2 = 2^m with m = k_max - 8;
- per NVFP4 block of 16: amax = 6 * 2^k_j, i.e. an FP8 block scale 2^(k_j - m), exact in E4M3
  while k_max - k_j <= 17.

Then FP8 block scale x weight_scale_2 = 2^k_j, the MXFP4 block's own scale, and every E2M1 code
is kept: the dequantized NVFP4 expert equals the dequantized MXFP4 expert bit for bit (blocks out
of that window, rare, get the data-derived amax and are counted as not lossless). The numerics
are ModelOpt's (`modelopt.torch.quantization.utils.numeric_utils`); the loop over the quantizers
is the glue hf_ptq's example keeps outside the installed package. Activation scales
(input_scale) are what calibration still measures: the cast does not give them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trt.errors import DFlashError


@dataclass
class CastReport:
    tensors: int
    blocks: int
    lossless_blocks: int

    @property
    def lossless(self) -> bool:
        return self.blocks == self.lossless_blocks

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "mxfp4_blocks": self.blocks, "lossless_blocks": self.lossless_blocks}


def quantizer_name(scales_key: str) -> str:
    """`<experts>.gate_up_proj_scales` -> `<experts>.gate_up_proj_weight_quantizer` (the module
    name ModelOpt's GptOssExperts wrapper gives the weight quantizer)."""
    return scales_key[: -len("_scales")] + "_weight_quantizer"


def pin_expert_scales(model: Any, source_dir: Path) -> CastReport:
    """Override the calibrated NVFP4 expert weight scales with the closed-form ones of the MXFP4
    source; call between `mtq.quantize` and `export_hf_checkpoint`."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.utils.numeric_utils import (
        mxfp4_to_nvfp4_global_amax,
        mxfp4_to_nvfp4_per_block_amax,
    )

    from dflash_trt.checkpoints.streaming import CheckpointReader

    modules = dict(model.named_modules())
    report = CastReport(0, 0, 0)
    with CheckpointReader(source_dir) as ckpt:
        for key in sorted(k for k in ckpt.keys() if k.endswith("_scales")):
            name = quantizer_name(key)
            wq = modules.get(name)
            if not isinstance(wq, TensorQuantizer) or not wq.is_enabled:
                raise DFlashError(f"MXFP4 -> NVFP4 cast: {name} is not an enabled NVFP4 weight quantizer; the recipe "
                                  "must quantize the experts (recipe mlp-only, experts-only or full)")
            amax = getattr(wq, "_amax", None)
            if not isinstance(amax, torch.Tensor) or amax.numel() <= 1 or not hasattr(wq, "global_amax"):
                raise DFlashError(f"MXFP4 -> NVFP4 cast: {name} has no static per-block amax after calibration "
                                  "(ModelOpt static-block NVFP4 expected); this ModelOpt version is not supported")
            scales = ckpt.get(key)
            global_amax, info = mxfp4_to_nvfp4_global_amax(scales)
            per_block = mxfp4_to_nvfp4_per_block_amax(ckpt.get(key[: -len("_scales")] + "_blocks"), scales)
            if per_block.numel() != amax.numel():
                raise DFlashError(f"MXFP4 -> NVFP4 cast: {name} has {amax.numel()} NVFP4 blocks but the source's "
                                  f"scales give {per_block.numel()}; the checkpoint and its config disagree")
            wq.global_amax = torch.tensor(float(global_amax), dtype=torch.float32, device=amax.device)
            with torch.no_grad():
                amax.copy_(per_block.to(device=amax.device, dtype=amax.dtype).view_as(amax))
            report.tensors += 1
            report.blocks += info["n_total_blocks"]
            report.lossless_blocks += info["n_lossless_blocks"]
    if report.tensors == 0:
        raise DFlashError(f"{source_dir}: quantization_config says mxfp4 but no *_scales tensors were found; "
                          "the checkpoint is not in the released MXFP4 layout")
    return report
