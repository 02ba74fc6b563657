"""Dequantize the weight formats an engine ships (FP8, NVFP4, MXFP4) to float, in plain torch.

This is how the reference runtime (and the acceptance gate) runs exactly the weights an engine
ships: every quantized tensor is dequantized, activations stay in float. It is weight-only:
input_scale / k_scale / v_scale (activation and KV-cache scales used by TensorRT-LLM's kernels)
are read and ignored. No ModelOpt import: the runtime runs without the [quant] extra.
`dflash_trt.checkpoints.streaming.load_checkpoint` applies these per tensor while loading.

Formats (the tensors `modelopt.torch.export.export_hf_checkpoint` writes):
- FP8: `W` float8_e4m3fn [..., R, C] and an FP32 scale, w = W.float() * scale, the scale one of
  - per tensor: one value (ModelOpt `FP8`; one per expert [E] for stacked experts);
  - per output channel: [R] (ModelOpt `FP8_PER_CHANNEL_PER_TOKEN`; [E, R] or [E, C] for experts);
  - per block: [..., ceil(R/bm), ceil(C/bn)], one value per bm x bn tile (ModelOpt `FP8_PB_WO`,
    `weight_scale` kept as [ceil(R/bm), 1, ceil(C/bn), 1]; transformers' fine-grained FP8, quantization_config `quant_method: fp8`,
    `weight_block_size` [bm, bn], `weight_scale_inv`: despite its name also multiplied). The
    block is the config's, else 128 x 128 (both producers' default) when the grid fits it.
- NVFP4: `W` uint8 holding two E2M1 codes per byte (element 2i in the LOW nibble, 2i+1 in the
  HIGH nibble), `weight_scale` FP8-E4M3 per block of 16 elements along the packed axis,
  `weight_scale_2` FP32 per tensor: w = e2m1(W) * weight_scale * weight_scale_2.
  E2M1 code = sign bit (8) + magnitude index into [0, 0.5, 1, 1.5, 2, 3, 4, 6].
Scale names: `<module>.weight` -> `<module>.weight_scale[_2]`; fused MoE parameters such as
`<experts>.gate_up_proj` -> `<experts>.gate_up_proj_weight_scale[_2]` (transformers' FP8:
`<module>.weight_scale_inv`, `<experts>.gate_up_proj_scale_inv`). The packed axis is the one
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
import math
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
# activation and KV-cache scales (ModelOpt's; transformers' static FP8 `activation_scale`)
IGNORED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "_input_scale", "activation_scale")
FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")  # weight-only here: one dequantizer
SUPPORTED_ALGOS = (*FP8_ALGOS, "NVFP4", "MXFP4")
DEFAULT_FP8_BLOCK = (128, 128)
MXFP4_BLOCK = 32
E8M0_BIAS = 127
MXFP4_SUFFIXES = ("_blocks", "_scales")


def read_quant_algo(directory: Path) -> str | None:
    """A ModelOpt export's quant_algo (FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, ...) |
    FP8 (transformers' fine-grained FP8) | MXFP4 (gpt-oss as released) | None (a float checkpoint)."""
    hq = directory / "hf_quant_config.json"
    if hq.is_file():
        algo = (json.loads(hq.read_text(encoding="utf-8")).get("quantization") or {}).get("quant_algo")
        return str(algo).upper() if algo else None  # ModelOpt writes fp8_pb_wo in lower case
    qc = _quantization_config(directory)
    if qc:
        if qc.get("quant_method") == "mxfp4":
            return "MXFP4"
        if qc.get("quant_method") == "fp8":
            return "FP8"
        if qc.get("quant_method") != "modelopt":
            raise DFlashError(
                f"{directory}: quantization_config.quant_method={qc.get('quant_method')!r}; the reference runtime "
                "dequantizes ModelOpt FP8/NVFP4, transformers' FP8 and MXFP4 (gpt-oss) checkpoints only; rebuild "
                "with `dflash-trt build --quant fp8|nvfp4`"
            )
        return str(qc.get("quant_algo")).upper() if qc.get("quant_algo") else None
    return None


def read_fp8_block(directory: Path) -> tuple[int, int] | None:
    """The [bm, bn] tile of a checkpoint's FP8 block scales when its config names one
    (transformers' `weight_block_size`); None: per-tensor/per-channel scales, or derived."""
    block = _quantization_config(directory).get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise DFlashError(f"{directory}/config.json: quantization_config.weight_block_size={block!r}; want two "
                          "positive integers [rows, cols]")
    return int(block[0]), int(block[1])


def _quantization_config(directory: Path) -> dict:
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return qc if isinstance(qc, dict) else {}


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] float32 E2M1 values (low nibble first), on `packed`'s device."""
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32,
                       device=packed.device)
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., 2n]
    return lut[codes]


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float8 `w` [..., R, C] times its FP32 `scale` (any layout of the module doc) -> float32.

    Every layout is a grid of tiles: per tensor one R x C tile, per output channel R tiles of
    1 x C, per block ceil(R/bm) x ceil(C/bn) tiles of bm x bn (the last ones cut short). A scale
    whose shape fits none raises ValueError (never a silent broadcast).
    """
    s = scale.float()
    if s.numel() == 1:
        return w.float() * s.reshape(())
    R, C = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    grid = _fp8_grid(tuple(w.shape), tuple(s.shape))
    bm, bn = _fp8_tile(R, C, grid, block)
    gr, gc = grid
    s = s.reshape(*lead, gr, 1, gc, 1)
    full = w.float()
    if (gr * bm, gc * bn) != (R, C):  # the last tiles are cut short: pad, scale, crop (ModelOpt's way)
        full = torch.nn.functional.pad(full, (0, gc * bn - C, 0, gr * bm - R))
    out = (full.reshape(*lead, gr, bm, gc, bn) * s).reshape(*lead, gr * bm, gc * bn)
    return out[..., :R, :C]


def _fp8_grid(w_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) tile grid a scale of `s_shape` lays over a weight of `w_shape`."""
    R, C = w_shape[-2:]
    lead = w_shape[:-2]
    if s_shape in ((R,), (*lead, R), (R, 1), (*lead, R, 1)):  # per output channel (ModelOpt: rows)
        if s_shape[-1] == R and lead and R == C:
            raise ValueError(f"per-channel scale {s_shape} of a square {w_shape} weight: rows or columns is "
                             "ambiguous")
        return R, 1
    if lead and s_shape == (*lead, C):  # stacked experts scaled along their last axis (ModelOpt's BMM style)
        return 1, C
    if len(s_shape) >= 2 and s_shape[:-2] in ((), lead):  # per block
        return s_shape[-2], s_shape[-1]
    if len(s_shape) >= 4 and s_shape[:-4] in ((), lead) and s_shape[-3] == s_shape[-1] == 1:
        return s_shape[-4], s_shape[-2]  # per block as ModelOpt's FP8_PB_WO export keeps it: [gr, 1, gc, 1]
    raise ValueError(f"FP8 scale {s_shape} fits no layout of a {w_shape} weight (per tensor, per channel, per block)")


def _fp8_tile(R: int, C: int, grid: tuple[int, int], block: tuple[int, int] | None) -> tuple[int, int]:
    """The tile (bm, bn) of a grid over an R x C weight: the config's block, else 128 x 128 (ModelOpt's
    and transformers' default) when the grid fits it, else an exact division (transformers' rule)."""
    gr, gc = grid
    if grid == (R, 1):
        return 1, C
    if grid == (1, C):
        return R, 1
    candidates = [block] if block is not None else [DEFAULT_FP8_BLOCK, (R // gr, C // gc)]
    for bm, bn in candidates:
        if bm > 0 and bn > 0 and (math.ceil(R / bm), math.ceil(C / bn)) == grid:
            return bm, bn
    raise ValueError(f"FP8 block scales {gr} x {gc} do not tile a {R} x {C} weight "
                     + (f"in {block[0]} x {block[1]} blocks" if block else "in 128 x 128 blocks or any exact division")
                     + " (config.json's quantization_config.weight_block_size names the block)")


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


def fp8_scale_names(key: str) -> tuple[str, str]:
    """Where an FP8 weight's scale is stored: ModelOpt's name, then transformers' (`_scale_inv`)."""
    return scale_name(key, "weight_scale"), (key + "_scale_inv")


def dequantize_tensor(key: str, shape: tuple[int, ...], algo: str | None, has: Callable[[str], bool],
                      get: Callable[[str], torch.Tensor], dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", fp8_block: tuple[int, int] | None = None,
                      ) -> tuple[torch.Tensor, list[str]] | None:
    """The value of parameter `key` (float `shape`) in `dtype` on `device`, and the checkpoint keys
    it was made from; None when the checkpoint holds nothing for `key`.

    `has`/`get` read one tensor at a time (the streaming loader passes a safetensors reader), so
    no whole state dict is ever held. Quantized tensors are moved to `device` first (a GPU
    dequantizes them there) and stacked expert tensors are dequantized one expert at a time:
    unpacking a whole gpt-oss-120b gate_up_proj at once would take ~25 GB of index and float32
    temporaries for a 4.2 GB bf16 result. `fp8_block`: the checkpoint's FP8 block (read_fp8_block).
    Raises ValueError / KeyError for a tensor that does not fit; the caller names the file.
    """
    if has(key):
        t = get(key)
        if t.dtype == torch.float8_e4m3fn:
            names = fp8_scale_names(key)
            sk = next((n for n in names if has(n)), None)
            if sk is None:
                raise KeyError(names[0])
            scale = get(sk).to(device)
            # stacked experts with scales of their own (leading [E]): each expert takes its slice
            per_expert = t.dim() >= 3 and scale.dim() >= 1 and scale.numel() > 1 and scale.shape[0] == t.shape[0]
            return _by_expert(t.to(device), shape, dtype,
                              lambda w, e: dequant_fp8(w, scale[e : e + 1] if per_expert else scale, fp8_block)), \
                [key, sk]
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
