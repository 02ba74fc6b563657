"""A tiny gpt-oss checkpoint in the layout the real one ships in, written by the tests themselves.

The released openai/gpt-oss-* checkpoints store the MoE experts in MXFP4 and everything else in
bf16; transformers' `integrations/mxfp4.py` (5.14) defines the layout:
- `model.layers.N.mlp.experts.gate_up_proj_blocks` uint8 [E, 2*I, H/32, 16] (two E2M1 codes per
  byte, element 2i in the low nibble), `..._scales` uint8 [E, 2*I, H/32] (E8M0, bias 127);
- `..._down_proj_blocks` uint8 [E, H, I/32, 16], `..._down_proj_scales` uint8 [E, H, I/32];
  i.e. [E, out, in] -- the transpose of transformers' GptOssExperts parameters [E, in, out];
- config.json `quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}`.

Experts are quantized with ModelOpt's own MXFP4 quantizer (MXFP4QTensor). Hidden 64 and expert
width 96 differ on purpose: a square expert would hide a transposition bug.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def save_tiny_mxfp4_gpt_oss(root: Path, seed: int = 0, block_size: int = 8) -> tuple[Path, Path]:
    """(target_dir, draft_dir): an MXFP4 gpt-oss target and a random drafter for it."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor
    from safetensors.torch import load_file, save_file

    from dflash_trt.runtime.tiny import random_draft, tiny_target

    model = tiny_target("gpt_oss", seed=seed, hidden_size=64, intermediate_size=96, vocab_size=160)
    with torch.no_grad():  # experts of different magnitudes: the E8M0 scales then vary per block
        for layer in model.model.layers:
            e = layer.mlp.experts
            for w in (e.gate_up_proj, e.down_proj):
                w.mul_(torch.logspace(-2, 1, w.shape[-1]).view(1, 1, -1))
    tdir, ddir = root / "gpt-oss-tiny", root / "draft"
    model.save_pretrained(tdir)
    random_draft(model.config, num_layers=1, block_size=block_size, seed=seed).save_pretrained(ddir)
    state = load_file(str(tdir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = value.transpose(1, 2).contiguous().to(torch.bfloat16)  # [E, out, in]
            E, rows, cols = w.shape
            qt, scales = MXFP4QTensor.quantize(w, 32)
            out[key + "_blocks"] = qt._quantized_data.view(E, rows, cols // 32, 16)
            out[key + "_scales"] = scales.view(E, rows, cols // 32)
        else:
            out[key] = value.to(torch.bfloat16)
    save_file(out, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    cfg["dtype"] = "bfloat16"
    (tdir / "config.json").write_text(json.dumps(cfg, indent=2))
    return tdir, ddir


def transformers_reference(tdir: Path) -> torch.nn.Module:
    """The source model as transformers itself loads it (its MXFP4 dequantization), in float32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.bfloat16,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    return model.float().eval()
