"""The build spec: a typed, strict recipe (YAML under build/) that CLI flags override.

Resolution order: built-in defaults < the YAML file (`--spec`) < flags given on the command line.
Unknown or misplaced keys are errors (pydantic extra="forbid"), reported as one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_trt.engine.hardware import GpuName, KvQuantName, QuantName
from dflash_trt.errors import DFlashError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationSpec(_Strict):
    """Prompts ModelOpt calibrates on; the acceptance gate measures tau on them too."""

    prompts: str | list[str] | None = Field(
        None, description="JSONL/JSON/TXT file or a list of strings; default: the project's train prompts")
    num_samples: int = Field(16, ge=1, description="how many prompts to calibrate on")
    max_length: int = Field(256, ge=8, description="prompt tokens per calibration sample (truncated)")


class GateSpec(_Strict):
    """The acceptance gate: tau before vs after quantization with the reference runtime."""

    enabled: bool = True
    max_tau_drop: float = Field(0.10, ge=0.0, lt=1.0, description="largest allowed relative drop of tau")
    accept_tau_drop: bool = Field(False, description="record a larger drop instead of failing the build")
    num_prompts: int = Field(4, ge=1, description="calibration prompts the gate decodes")
    max_new_tokens: int = Field(32, ge=2)


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
    kv_cache_quant: KvQuantName = "none"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype of unquantized tensors in the engine (auto: the checkpoint's)")
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
        "auto", description="DFlashDecodingConfig.attention_backend (auto: TRTLLM on Blackwell, VANILLA elsewhere)")
    draft_num_layers: int = Field(5, ge=1, description="drafter depth assumed by `plan` when no drafter dir")
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    gate: GateSpec = Field(default_factory=GateSpec)


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise DFlashError(f"build spec: {k} must be a mapping to hold {dotted}")
    d[keys[-1]] = value


def load_spec_file(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise DFlashError(f"build spec {p} not found; pass a YAML file (examples under build/)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise DFlashError(f"build spec {p} is not valid YAML ({' '.join(str(e).split())}); fix the file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DFlashError(f"build spec {p} must be a YAML mapping of keys, got {type(data).__name__}")
    return data


def resolve_spec(spec_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> BuildSpec:
    """Defaults < YAML < overrides (dotted keys like "gate.max_tau_drop"; None = not given)."""
    data = load_spec_file(spec_file) if spec_file else {}
    where = f"build spec {spec_file}" if spec_file else "build options"
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_path(data, key, value)
    try:
        return BuildSpec.model_validate(data)
    except ValidationError as e:
        raise DFlashError(_one_line(e, where))


def _one_line(e: ValidationError, where: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] = BuildSpec
        for part in err["loc"][:-1]:
            ann = model.model_fields.get(str(part))
            if ann is None or not isinstance(ann.annotation, type) or not issubclass(ann.annotation, BaseModel):
                break
            model = ann.annotation
        valid = ", ".join(model.model_fields)
        return f"{where}: unknown key {loc!r}; valid keys here: {valid}"
    value = err.get("input")
    return f"{where}: {loc}={value!r}: {err['msg']}; fix the value"
