"""Load a ModelOpt unified HF checkpoint (FP8 or NVFP4) as a plain float HF model, in torch.

This is how the reference runtime (and the acceptance gate) runs exactly the weights an engine
ships: every quantized tensor is dequantized, activations stay in float. It is weight-only:
input_scale / k_scale / v_scale (activation and KV-cache scales used by TensorRT-LLM's kernels)
are read and ignored, which the acceptance gate's tolerance covers.

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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
IGNORED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "_input_scale")
SUPPORTED_ALGOS = ("FP8", "NVFP4")


def read_quant_algo(directory: Path) -> str | None:
    """quant_algo from hf_quant_config.json (or config.json's quantization_config); None if float."""
    hq = directory / "hf_quant_config.json"
    if hq.is_file():
        algo = (json.loads(hq.read_text(encoding="utf-8")).get("quantization") or {}).get("quant_algo")
        return str(algo) if algo else None
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    qc = cfg.get("quantization_config") or {}
    if qc:
        if qc.get("quant_method") != "modelopt":
            raise DFlashError(
                f"{directory}: quantization_config.quant_method={qc.get('quant_method')!r}; the reference runtime "
                "dequantizes ModelOpt FP8/NVFP4 checkpoints only, rebuild with `dflash-trt build --quant fp8|nvfp4`"
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


def _scale_name(key: str, suffix: str) -> str:
    return key[: -len("weight")] + suffix if key.endswith(".weight") else f"{key}_{suffix}"


def dequantize_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], algo: str,
                     where: Path) -> dict[str, torch.Tensor]:
    """Float state dict with the keys of `expected` (the float model's), from an exported one."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, ref in expected.items():
        if key not in state:
            continue
        t = state[key]
        used.add(key)
        try:
            if t.dtype == torch.float8_e4m3fn:
                sk = _scale_name(key, "weight_scale")
                out[key] = dequant_fp8(t, state[sk])
                used.add(sk)
            elif t.dtype == torch.uint8 and algo == "NVFP4":
                sk, sk2 = _scale_name(key, "weight_scale"), _scale_name(key, "weight_scale_2")
                out[key] = dequant_nvfp4(t, state[sk], state[sk2], tuple(ref.shape))
                used.update((sk, sk2))
            else:
                out[key] = t
        except KeyError as e:
            raise DFlashError(f"{where}: quantized tensor {key} has no scale {e}; the export is incomplete, rebuild")
        except ValueError as e:
            raise DFlashError(f"{where}: tensor {key}: {e}; the checkpoint does not match its config.json, rebuild")
        if tuple(out[key].shape) != tuple(ref.shape):
            raise DFlashError(f"{where}: tensor {key} has shape {tuple(out[key].shape)} but config.json implies "
                              f"{tuple(ref.shape)}; rebuild the engine")
    leftover = [k for k in state if k not in used and not k.endswith(IGNORED_SUFFIXES)]
    if leftover:
        raise DFlashError(f"{where}: {len(leftover)} tensors the model does not use (first: {leftover[0]}); "
                          "config.json and the weights disagree, rebuild")
    return out


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: random init, only slower
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def load_quantized_target(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A HF causal LM with dequantized weights; plain load_target for float checkpoints."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_trt.runtime.checkpoint import load_state_dict, read_json
    from dflash_trt.runtime.loading import _quiet_transformers, load_target

    directory = Path(directory)
    algo = read_quant_algo(directory)
    if algo is None:
        return load_target(directory, dtype, device)
    if algo not in SUPPORTED_ALGOS:
        raise DFlashError(f"{directory}: quant_algo {algo} is not supported by the reference runtime "
                          f"(only {', '.join(SUPPORTED_ALGOS)}); rebuild with --quant fp8 or nvfp4")
    raw = read_json(directory / "config.json", what="target config")
    raw = {k: v for k, v in raw.items() if k not in ("quantization_config", "transformers_version")}
    model_type = raw.pop("model_type", None)
    try:
        cfg = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as e:
        raise DFlashError(f"{directory}: cannot build a {model_type!r} config ({str(e).splitlines()[0]})")
    with _quiet_transformers(), torch.device("cpu"), _no_init():
        # Every weight is overwritten below: skipping the random init saves time and memory.
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    expected = model.state_dict()
    exported = load_state_dict(directory)
    state = dequantize_state(exported, expected, algo, directory)
    del exported
    missing = [k for k in expected if k not in state]
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if [k for k in missing if k not in tied]:
        first = [k for k in missing if k not in tied][0]
        raise DFlashError(f"{directory}: weights missing {first}; the export is incomplete, rebuild the engine")
    model.load_state_dict(state, strict=False, assign=True)  # assign: no second copy of the weights
    if tied:
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
