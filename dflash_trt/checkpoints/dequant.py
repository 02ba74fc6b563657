"""Dequantize the weight formats an engine ships (FP8, NVFP4, MXFP4) to float, in plain torch.

This is how the reference runtime (and the acceptance gate) runs exactly the weights an engine
ships: every quantized tensor is dequantized, activations stay in float. It is weight-only:
input_scale / k_scale / v_scale (activation and KV-cache scales used by TensorRT-LLM's kernels)
are read and ignored. No ModelOpt import: the runtime runs without the [quant] extra.
`dflash_trt.checkpoints.streaming.load_checkpoint` applies these per tensor while loading.

Formats (the tensors `modelopt.torch.export.export_hf_checkpoint` writes):
- FP8: `W` float8_e4m3fn, `weight_scale` FP32 (per tensor, or per output channel):
  w = W.float() * weight_scale.
- NVFP4: `W` uint8 holding two E2M1 codes per byte (element 2i in the LOW nibble, 2i+1 in the
  HIGH nibble), `weight_scale` FP8-E4M3 per block of 16 elements along the packed axis,
  `weight_scale_2` FP32 per tensor: w = e2m1(W) * weight_scale * weight_scale_2.
  E2M1 code = sign bit (8) + magnitude index into [0, 0.5, 1, 1.5, 2, 3, 4, 6].
Scale names: `<module>.weight` -> `<module>.weight_scale[_2]`; fused MoE parameters such as
`<experts>.gate_up_proj` -> `<experts>.gate_up_proj_weight_scale[_2]`. The packed axis is the one
whose length is half the float model's (the last axis for nn.Linear [out, in]; axis -2 for
GptOss experts stored [E, in, out]).
- MXFP4 (gpt-oss as released; transformers' `integrations/mxfp4.py` defines the layout):
  `<experts>.gate_up_proj_blocks` uint8 [E, rows, cols/32, 16] (two E2M1 codes per byte, same
  nibble order as NVFP4) and `<experts>.gate_up_proj_scales` uint8 [E, rows, cols/32] (E8M0:
  one power of two 2^(s - 127) per block of 32): w[e, r, c] = e2m1 * 2^(s - 127). The float
  parameter is the transpose, [E, cols, rows] (GptOssExperts keeps [E, in, out]).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
IGNORED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "_input_scale")
SUPPORTED_ALGOS = ("FP8", "NVFP4", "MXFP4")
MXFP4_BLOCK = 32
E8M0_BIAS = 127
MXFP4_SUFFIXES = ("_blocks", "_scales")


def read_quant_algo(directory: Path) -> str | None:
    """FP8 | NVFP4 (a ModelOpt export) | MXFP4 (gpt-oss as released) | None (a float checkpoint)."""
    hq = directory / "hf_quant_config.json"
    if hq.is_file():
        algo = (json.loads(hq.read_text(encoding="utf-8")).get("quantization") or {}).get("quant_algo")
        return str(algo) if algo else None
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    qc = cfg.get("quantization_config") or {}
    if qc:
        if qc.get("quant_method") == "mxfp4":
            return "MXFP4"
        if qc.get("quant_method") != "modelopt":
            raise DFlashError(
                f"{directory}: quantization_config.quant_method={qc.get('quant_method')!r}; the reference runtime "
                "dequantizes ModelOpt FP8/NVFP4 and MXFP4 (gpt-oss) checkpoints only; rebuild with "
                "`dflash-trt build --quant fp8|nvfp4`"
            )
        return str(qc.get("quant_algo")) if qc.get("quant_algo") else None
    return None


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] float32 E2M1 values (low nibble first)."""
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., 2n]
    return lut[codes]


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    if s.dim() == 1 and s.numel() == w.shape[0] and s.numel() > 1:
        s = s.view(-1, *([1] * (w.dim() - 1)))  # per output channel
    return w.float() * s


def dequant_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """Unpack along the axis whose float length is twice the packed one; apply both scales."""
    axes = [a for a in range(packed.dim())
            if packed.shape[a] * 2 == shape[a] and all(packed.shape[b] == shape[b] for b in range(packed.dim()) if b != a)]
    if len(packed.shape) != len(shape) or not axes:
        raise ValueError(f"packed shape {tuple(packed.shape)} does not match float shape {shape}")
    axis = axes[-1]  # prefer the last axis (nn.Linear) when several fit
    q = packed.movedim(axis, -1)  # [..., n/2]
    s = block_scale.movedim(axis, -1).float()  # [..., n/16]
    vals = unpack_e2m1(q)  # [..., n]
    blocks = vals.view(*vals.shape[:-1], -1, NVFP4_BLOCK)  # [..., n/16, 16]
    if blocks.shape[:-1] != s.shape:
        raise ValueError(f"block scales {tuple(block_scale.shape)} do not match {tuple(packed.shape)} packed weights")
    # Combine the two scales first (ModelOpt's order, so results match it bit for bit).
    w = (blocks * (s * scale_2.float()).unsqueeze(-1)).view(vals.shape)
    return w.movedim(-1, axis)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 E2M1 pairs + [..., G] uint8 E8M0 exponents -> [..., G * 32] float32.

    Exact: every E2M1 value times a power of two is a float32 (and a bfloat16) number.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(want [..., G, {MXFP4_BLOCK // 2}] and [..., G])")
    vals = unpack_e2m1(blocks)  # [..., G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    return torch.ldexp(vals, exponents.unsqueeze(-1)).flatten(-2)  # [..., G * 32]


def scale_name(key: str, suffix: str) -> str:
    return key[: -len("weight")] + suffix if key.endswith(".weight") else f"{key}_{suffix}"


def dequantize_tensor(key: str, shape: tuple[int, ...], algo: str | None, has: Callable[[str], bool],
                      get: Callable[[str], torch.Tensor], dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, list[str]] | None:
    """The value of parameter `key` (float `shape`) in `dtype` on `device`, and the checkpoint keys
    it was made from; None when the checkpoint holds nothing for `key`.

    `has`/`get` read one tensor at a time (the streaming loader passes a safetensors reader), so
    no whole state dict is ever held. Quantized tensors are moved to `device` first (a GPU
    dequantizes them there) and stacked expert tensors are dequantized one expert at a time:
    unpacking a whole gpt-oss-120b gate_up_proj at once would take ~25 GB of index and float32
    temporaries for a 4.2 GB bf16 result. Raises ValueError / KeyError for a tensor that does not
    fit; the caller names the file.
    """
    if has(key):
        t = get(key)
        if t.dtype == torch.float8_e4m3fn:
            sk = scale_name(key, "weight_scale")
            scale = get(sk).to(device)
            per_row = scale.dim() == 1 and scale.numel() == t.shape[0] and scale.numel() > 1
            return _by_expert(t.to(device), shape, dtype,
                              lambda w, e: dequant_fp8(w, scale[e : e + 1] if per_row else scale)), [key, sk]
        if t.dtype == torch.uint8 and algo == "NVFP4":
            sk, sk2 = scale_name(key, "weight_scale"), scale_name(key, "weight_scale_2")
            block, scale_2 = get(sk).to(device), get(sk2).to(device)
            return _by_expert(t.to(device), shape, dtype,
                              lambda w, e: dequant_nvfp4(w, block[e : e + 1] if w.dim() == 3 else block, scale_2,
                                                         (w.shape[0], *shape[1:]) if w.dim() == 3 else shape)), \
                [key, sk, sk2]
        return t.to(device=device, dtype=dtype), [key]
    blocks_key, scales_key = (key + s for s in MXFP4_SUFFIXES)
    if algo == "MXFP4" and has(blocks_key):
        blocks, scales = get(blocks_key).to(device), get(scales_key).to(device)
        if blocks.dim() != 4:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)}: expected [experts, rows, blocks, 16]")
        # The release stores [E, out, in] and GptOssExperts keeps [E, in, out]: always transposed,
        # as transformers' convert_moe_packed_tensors does (a shape test would miss square experts).
        return _by_expert(blocks, shape, dtype,
                          lambda b, e: dequant_mxfp4(b, scales[e : e + 1]).transpose(-1, -2)), [blocks_key, scales_key]
    return None


def _by_expert(packed: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               dequant: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`dequant(packed[e:e+1], e)` for each leading index of a stacked (3-D+) tensor, written into
    one `dtype` result; a 2-D tensor in one piece."""
    if packed.dim() < 3:
        return dequant(packed, 0).to(dtype)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    for e in range(packed.shape[0]):
        piece = dequant(packed[e : e + 1], e)
        if tuple(piece.shape[1:]) != tuple(shape[1:]):
            raise ValueError(f"dequantized shape {tuple(piece.shape[1:])} per expert, config.json implies "
                             f"{tuple(shape[1:])}")
        out[e : e + 1] = piece
    return out
