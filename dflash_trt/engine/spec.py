"""The build spec: a typed, strict recipe (YAML under build/) that CLI flags override.

Resolution order: built-in defaults < the YAML file (`--spec`) < flags given on the command line.
Unknown or misplaced keys are errors (pydantic extra="forbid"), reported as one line by the
one config loader (dflash_trt/config.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dflash_trt.draft_len_schedule import DraftLenSchedule

from dflash_trt.engine.devices import DeviceName
from dflash_trt.engine.hardware import GpuName, KvQuantName, QuantName
from dflash_trt.engine.recipes import RecipeName
from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import DtypeChoice


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationSpec(_Strict):
    """Prompts ModelOpt calibrates on; the acceptance gate measures tau on them too."""

    prompts: str | list[str] | None = Field(
        None, description="JSONL/JSON/TXT file or a list of strings; default: the project's train prompts")
    num_samples: int = Field(16, ge=1, description="how many prompts to calibrate on")
    max_length: int = Field(256, ge=8, description="prompt tokens per calibration sample (truncated)")


class GateSpec(_Strict):
    """The acceptance gate: tau before vs after quantization (every prompt of a look decoded
    together on the batched runtime, each as the reference loop decodes it), decided by a
    group-sequential test with 2.5% error each side (dflash_trt.engine.sequential): look 1 decodes
    `num_prompts` x `max_new_tokens` (the 39 eval prompts x 96 tokens: the embedded pair's drop known
    to about +-6 points); while undecided, each further look decodes a wave of `num_prompts` more
    held-out prompts (the gate split's 117), up to `max_looks` looks within `budget_s`
    (docs/quantization.md)."""

    enabled: bool | None = Field(None, description="default: on for quantized builds; on a --quant none build "
                                 "it only checks that the drafter fits the target")
    max_tau_drop: float = Field(0.10, ge=0.0, lt=1.0, description="largest allowed relative drop of tau (the "
                                "upper end of a look's interval must stay below)")
    accept_tau_drop: bool = Field(False, description="record a larger drop instead of failing the build")
    min_tau: float = Field(1.2, ge=1.0, description="refuse a pair whose unquantized tau is surely below this "
                           "(a drafter that does not fit the target)")
    prompts: str | list[str] | None = Field(
        None, description="prompts the gate decodes (file or list); default: the project's held-out prompts")
    # 39: the whole eval split, one wave. At 24 prompts x 96 tokens the embedded pair's drop was known
    # to +-5.7 to +-6.6 points (free-running text diverges after the first changed greedy choice); at
    # 39, +-5.4 to +-6; a nvfp4 drop of 4-7% needs the later waves (docs/quantization.md).
    num_prompts: int = Field(39, ge=2, description="prompts each look decodes: look 1 the first ones of the "
                             "source, each later look the next ones")
    max_new_tokens: int = Field(96, ge=2, description="tokens per gate prompt")
    max_looks: int = Field(4, ge=1, description="planned looks of the sequential test: its 2.5% error each side is "
                           "spent over them (engine/sequential.py); a look runs only while undecided")
    budget_s: float = Field(330.0, gt=0, description="seconds the gate may decode: it plans the looks this pays "
                            "for (a look ~ twice look 1's unquantized pass), and a look that would end past this is "
                            "not started (the gate is then inconclusive)")


class BuildSpec(_Strict):
    name: str | None = Field(None, description="engine name (default: derived from target, quant, gpu)")
    target: str | None = Field(None, description="target checkpoint dir, or a known architecture (plan only)")
    draft: str | None = Field(None, description="DFlash drafter dir (z-lab format)")
    out: str | None = Field(None, description="engine output directory")
    gpu: GpuName = "cpu"
    gpus_per_node: int = Field(8, ge=1)
    nodes: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    quant: QuantName = "none"
    recipe: RecipeName = Field("auto", description="which layers --quant applies to: full | mlp-only | "
                               "experts-only (auto: mlp-only, nvfp4 with down_proj kept; NVIDIA's nvfp4_mlp_only "
                               "for gpt-oss)")
    keep_layers: list[int] | None = Field(None, description="decoder layers left in 16 bits (default: the recipe's)")
    keep_modules: list[str] | None = Field(None, description="linear layers (e.g. down_proj) left in 16 bits in every "
                                           "decoder layer (default: the recipe's; nvfp4 keeps down_proj)")
    kv_cache_quant: KvQuantName = "none"
    dtype: DtypeChoice = Field(
        "auto", description="dtype of unquantized tensors in the engine (auto: the checkpoint's 16-bit dtype; "
        "float32 only for --gpu cpu)")
    device: DeviceName = Field("auto", description="where the build runs the model (calibration, gate): auto "
                               "(every visible GPU, else the CPU) | cpu | cuda")
    compute_dtype: DtypeChoice = Field(
        "auto", description="dtype the build RUNS its models in (calibration, gate); the engine's tensors are in "
        "`dtype` either way (auto: `dtype` where the build device multiplies it natively, else float32: a CPU "
        "without native bf16, where float32 runs 2-5x faster and holds twice the memory)")
    max_batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_draft_len: int | None = Field(None, ge=1, description="default: drafter block_size - 1")
    max_num_tokens: int | None = Field(None, ge=1, description="default: max(8192, batch * (draft + 1))")
    free_gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    # TensorRT-LLM serving knobs (upstream's throughput recipes); written only when not upstream's default.
    enable_attention_dp: bool = Field(False, description="attention data parallel across the TP ranks (MoE throughput)")
    stream_interval: int = Field(1, ge=1, description="tokens between streamed responses")
    num_postprocess_workers: int = Field(0, ge=0, description="detokenization worker processes of trtllm-serve")
    dflash_attention_backend: Literal["auto", "VANILLA", "TRTLLM", "FA4"] = Field(
        "auto", description="DFlashDecodingConfig.attention_backend (auto: TRTLLM on Blackwell, VANILLA elsewhere and "
        "for drafters with non-causal sliding layers; FA4: Hopper only)")
    tensorrt_llm_release: str | None = Field(
        None, description="the TensorRT-LLM release the engine is built for: llm_api_options.yaml carries only the "
        "keys it accepts, and the fields that serve from it (default: the dflash-trt container's, "
        "deploy/container/image.json; `dflash-trt plan` shows what each release would get)")
    # Speculation on the node (TensorRT-LLM's DecodingBaseConfig; engine/schedule_plan.py).
    draft_len_schedule: str | dict[int, int] = Field(
        "auto", description="TensorRT-LLM draft_len_schedule: auto (derived for the GPU from the step-cost model and "
        "the acceptance profile), off, or BATCH:DRAFT_LEN pairs such as 4:7,16:3 (a mapping in YAML)")
    acceptance_profile: str | list[float] | None = Field(
        None, description="per-position acceptance the schedule is derived from: P(a>=1),P(a>=2),... or tau:X "
        "(default: the acceptance gate's measurement, else a stated default)")
    rejection_sampling: bool = Field(False, description="TensorRT-LLM use_rejection_sampling (a prototype upstream): "
                                     "sampled requests verified by rejection sampling instead of exact match")
    acceptance_rate_window: int | None = Field(None, ge=1, description="acceptance_rate_window_size: steps in the "
                                               "rolling acceptance rate (with acceptance_rate_threshold)")
    acceptance_rate_threshold: float | None = Field(None, ge=0.0, le=1.0, description="acceptance_rate_threshold: "
                                                    "speculation turns off for good below this rolling rate")
    draft_num_layers: int = Field(5, ge=1, description="drafter depth assumed by `plan` when no drafter dir")
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    gate: GateSpec = Field(default_factory=GateSpec)

    @field_validator("draft_len_schedule")
    @classmethod
    def _schedule_form(cls, v: str | dict[int, int]) -> str | dict[int, int]:
        """auto | off | a schedule (the same one-line refusals as --draft-len-schedule)."""
        if isinstance(v, str) and v.strip().lower() in ("auto", "off"):
            return v.strip().lower()
        try:
            parsed = DraftLenSchedule.from_mapping(v) if isinstance(v, dict) else DraftLenSchedule.parse(v)
        except DFlashError as e:
            raise ValueError(str(e)) from None
        return "off" if parsed is None else parsed.to_mapping()

    @model_validator(mode="after")
    def _acceptance_floor_pair(self) -> "BuildSpec":
        if (self.acceptance_rate_window is None) != (self.acceptance_rate_threshold is None):
            raise ValueError("acceptance_rate_window and acceptance_rate_threshold come together "
                             "(--acceptance-rate-window N --acceptance-rate-threshold X): TensorRT-LLM turns "
                             "speculation off once the rolling rate over N steps falls below X")
        return self


def resolve_spec(spec_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> BuildSpec:
    """Defaults < YAML < overrides (dotted keys like "gate.max_tau_drop"; None = not given)."""
    from dflash_trt.config import load_config

    return load_config(BuildSpec, spec_file, overrides, what="build spec")
