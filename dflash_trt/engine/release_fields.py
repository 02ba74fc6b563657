"""Which DFlashDecodingConfig fields an engine writes for its TensorRT-LLM release, and why.

Every field is written only where it serves and only for a release that has it
(trtllm_fields.json records each field's first release and its source):

- ``attention_backend`` (the drafter's attention; ``auto`` picks the GPU's preferred backend
  where the release and the drafter allow it): TRTLLM (TRTLLM-gen FMHA) on Blackwell (SM100/SM103)
  for drafters without non-causal sliding layers (PR 19159 refuses those); FA4 (FlashAttention-4,
  CuTe DSL; PR 18553, a draft-path speed-up) on Hopper (SM90 only) for a head_dim FA4 takes on SM90
  (8..256, a multiple of 8: dflash_attention.validate_dflash_fa4_runtime); VANILLA
  (flash_attn_with_kvcache) everywhere else, and for a release without the preferred value.
- ``context_recompute_tail`` (1.4.0rc1): the measured tail (engine/recompute_tail.py), only where
  prefix caching is on (kv_cache_config.enable_block_reuse, upstream's default true): without a
  cache hit there is nothing to recompute. No measurement, nothing written.
- ``moe_backend`` (1.4.0rc1): the drafter's MoE backend; DFlash drafters are dense: never.
- ``skip_ctx_buffer_budget_check`` (1.4.0rc1): skips a safety check whose semantics upstream does
  not document: never.
- ``spec_dec_variant`` (1.4.0rc1): no DFlash meaning (DFlash2 is read from the checkpoint): never,
  and refused in a file (llm_api.FORBIDDEN_KEYS).

The overlap scheduler is not a DFlashDecodingConfig field: ``disable_overlap_scheduler`` stays at
upstream's false (never written), and `verify` refuses a file that turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trt.engine.hardware import GPUS
from dflash_trt.engine.recompute_tail import RecomputeTailMeasurement
from dflash_trt.errors import DFlashError

FA4_HEAD_DIMS = (8, 256)  # dflash_attention.validate_dflash_fa4_runtime on SM90: 8 <= head_dim <= 256, % 8 == 0
NEVER = {
    "moe_backend": "DFlash drafters are dense: no MoE backend to choose",
    "skip_ctx_buffer_budget_check": "skips a context-buffer budget check upstream does not document; no engine "
                                    "needs it skipped",
    "spec_dec_variant": "no DFlash meaning (TensorRT-LLM reads DFlash2 from the drafter checkpoint)",
}


@dataclass(frozen=True)
class FieldChoice:
    """One speculative_config field: the value written (None: not written) and why."""

    key: str
    value: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"written": self.value, "why": self.why}


def fa4_takes(head_dim: int | None) -> bool:
    """Whether FA4 runs a drafter of this head_dim on SM90 (None: unknown, assumed so)."""
    lo, hi = FA4_HEAD_DIMS
    return head_dim is None or (lo <= head_dim <= hi and head_dim % 8 == 0)


def dflash_attention_backend(spec: Any, non_causal_sliding: bool = False, head_dim: int | None = None,
                             release: str | None = None) -> str:
    """DFlashDecodingConfig.attention_backend: the spec's choice, or the GPU's preferred one where
    `release` (None: any) and the drafter allow it (module docstring); one line for a choice
    upstream does not run."""
    return _attention(spec, non_causal_sliding, head_dim, release)[0]


def _attention(spec: Any, non_causal_sliding: bool, head_dim: int | None, release: str | None) -> tuple[str, str]:
    from dflash_trt.engine.trtllm_versions import accepts

    choice = spec.dflash_attention_backend
    gpu = GPUS[spec.gpu]
    if choice == "TRTLLM" and gpu.family != "blackwell":
        # upstream's TRTLLM path checks is_sm_100f: SM100/SM103 only (dflash_attention.py)
        raise DFlashError(f"dflash_attention_backend TRTLLM needs a Blackwell GPU (SM100/SM103) and this engine is "
                          f"for {spec.gpu}; use auto or VANILLA (FlashAttention), or build for --gpu b200/b300")
    if choice == "FA4" and gpu.family != "hopper":
        raise DFlashError(f"dflash_attention_backend FA4 runs on SM90 (H100/H200) only in TensorRT-LLM's DFlash and "
                          f"this engine is for {spec.gpu}; use auto or VANILLA")
    if choice == "FA4" and not fa4_takes(head_dim):
        raise DFlashError(f"dflash_attention_backend FA4 takes head_dim {FA4_HEAD_DIMS[0]}..{FA4_HEAD_DIMS[1]} in "
                          f"multiples of 8 on SM90 and this drafter's is {head_dim}; use auto or VANILLA")
    if non_causal_sliding and choice == "TRTLLM":
        raise DFlashError("dflash_attention_backend TRTLLM refuses drafters with non-causal sliding-window layers "
                          "(TensorRT-LLM PR 19159) and this drafter has them; use auto or VANILLA"
                          + (" (or FA4)" if gpu.family == "hopper" else ""))
    if choice != "auto":
        return choice, "given (dflash_attention_backend)"
    preferred = gpu.dflash_attention_backend
    if preferred == "TRTLLM" and non_causal_sliding:
        return "VANILLA", "the drafter has non-causal sliding-window layers, which TRTLLM refuses (PR 19159)"
    if preferred == "FA4" and not fa4_takes(head_dim):
        return "VANILLA", f"FA4 takes no head_dim {head_dim} on SM90"
    if preferred != "VANILLA" and release is not None and not accepts(release, "speculative_config.attention_backend",
                                                                      preferred):
        return "VANILLA", f"TensorRT-LLM {release} has no attention_backend {preferred}"
    why = {"TRTLLM": "TRTLLM-gen FMHA on Blackwell (SM100/SM103)",
           "FA4": "FlashAttention-4 (CuTe DSL, PR 18553) on SM90"}.get(preferred, "FlashAttention (flash_attn_with_kvcache)")
    return preferred, why


def release_fields(spec: Any, release: str, *, non_causal_sliding: bool = False, head_dim: int | None = None,
                   block_reuse: bool = True, measurement: RecomputeTailMeasurement | None = None
                   ) -> list[FieldChoice]:
    """The DFlashDecodingConfig fields beyond the drafter's own for `release`, each with why."""
    from dflash_trt.engine.trtllm_versions import accepts, table

    backend, why = _attention(spec, non_causal_sliding, head_dim, release)
    out = [FieldChoice("attention_backend", backend, why)]
    key = "speculative_config.context_recompute_tail"
    first = table()["fields"][key]["first_version"]
    if not accepts(release, key):
        out.append(FieldChoice("context_recompute_tail", None, f"TensorRT-LLM {release} has no such field "
                                                               f"(first: {first})"))
    elif measurement is None:
        out.append(FieldChoice("context_recompute_tail", None, "not measured (no engine/context_recompute_tail.json)"))
    elif not block_reuse:
        out.append(FieldChoice("context_recompute_tail", None, "prefix caching is off "
                               "(kv_cache_config.enable_block_reuse false): no cache hit to recompute after"))
    elif measurement.recommended == 0:
        out.append(FieldChoice("context_recompute_tail", None, "the measurement recommends 0 (upstream's default): "
                               + measurement.summary()))
    else:
        out.append(FieldChoice("context_recompute_tail", measurement.recommended, measurement.summary()))
    for name, reason in NEVER.items():
        out.append(FieldChoice(name, None, reason))
    return out
