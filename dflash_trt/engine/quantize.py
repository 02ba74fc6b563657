"""Post-training quantization of the target with ModelOpt, exported as a unified HF checkpoint.

`mtq.quantize(model, cfg, forward_loop)` inserts fake-quant modules and calibrates their amax on
the calibration prompts; `export_hf_checkpoint` then writes real low-precision weights plus
`hf_quant_config.json` -- the format TensorRT-LLM (>= 1.x) and vLLM load directly. ModelOpt's
default configs already keep lm_head, embeddings and MoE routers unquantized, as upstream
recipes do. FP8 KV-cache quantization adds ModelOpt's `*[kv]_bmm_quantizer` entries.

On a CPU: FP8 calibration works end to end; NVFP4 calibration and export work, but a forward of
the fake-quantized NVFP4 model asserts "amax must be a CUDA tensor" -- nothing here runs one (the
acceptance gate runs the EXPORTED weights through dflash_trt.engine.dequant instead).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

# --quant -> the ModelOpt config constant (modelopt 0.47: quant_cfg is a list of rule dicts).
MODELOPT_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
MODELOPT_KV_CONFIGS = {"fp8": "FP8_KV_CFG"}


def modelopt_config(quant: str, kv_cache_quant: str) -> dict[str, Any]:
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise DFlashError(f"--quant {quant} needs nvidia-modelopt ({e}); pip install 'dflash-trt[quant]'")
    cfg = copy.deepcopy(getattr(mtq, MODELOPT_CONFIGS[quant]))
    if kv_cache_quant != "none":
        kv = getattr(mtq, MODELOPT_KV_CONFIGS[kv_cache_quant])["quant_cfg"]
        rules = cfg["quant_cfg"]
        # 0.47 uses a list of {"quantizer_name": ..., ...} rules; older releases used a dict.
        cfg["quant_cfg"] = list(rules) + list(kv) if isinstance(rules, list) else {**rules, **kv}
    return cfg


def quantize_and_export(model: Any, quant: str, kv_cache_quant: str, calib_ids: list[list[int]],
                        export_dir: Path, dtype: Any = None, progress: bool = True) -> None:
    """Calibrate `model` in place on `calib_ids` and export it to `export_dir` (unified HF format)."""
    import torch
    from tqdm import tqdm

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    if not getattr(model.config, "architectures", None):
        # export_hf_checkpoint needs it to write a loadable config.json.
        model.config.architectures = [type(model).__name__]
    cfg = modelopt_config(quant, kv_cache_quant)
    device = next(model.parameters()).device

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for ids in tqdm(calib_ids, desc=f"calibrate {quant}", unit="prompt", disable=not progress, file=sys.stderr):
                m(torch.tensor([ids], device=device))

    # ModelOpt prints progress to stdout; keep stdout clean for --json consumers.
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
        export_hf_checkpoint(model, dtype=dtype, export_dir=export_dir)
