"""`dflash_trt.json`: the manifest that makes an engine directory self-describing.

Layout of an engine directory (written atomically; the manifest is written LAST, so its
presence means the build completed):

    engine/
      dflash_trt.json        this manifest
      target/                unified HF checkpoint (ModelOpt export when quantized)
      draft/                 DFlash drafter, z-lab format
      llm_api_options.yaml   TensorRT-LLM LLM-API args incl. speculative_config (DFlash)
      launch/                trtllm-serve / vLLM / SGLang commands for the same engine
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.errors import DFlashError

if TYPE_CHECKING:
    from dflash_trt.draft_len_schedule import DraftLenSchedule

MANIFEST_NAME = "dflash_trt.json"
FORMAT_VERSION = 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mapping(Strict):
    """How the target is split across GPUs (TensorRT-LLM's parallel sizes)."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)

    @property
    def world_size(self) -> int:
        """MPI ranks = GPUs used. Expert parallelism reuses the TP ranks (ep divides tp*pp)."""
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def tasks_per_node(self) -> int:
        return min(self.world_size, self.gpus_per_node)


class Quantization(Strict):
    weights: Literal["none", "fp8", "nvfp4"] = "none"
    kv_cache: Literal["none", "fp8"] = "none"
    # Added by the build area for issue 20 (absent in older manifests):
    recipe: str | None = None  # full | mlp-only | experts-only (dflash_trt.engine.recipes)
    keep_layers: list[int] = Field(default_factory=list)  # decoder layers left in 16 bits
    keep_modules: list[str] = Field(default_factory=list)  # linear layers (down_proj) left in 16 bits in every layer
    source_format: str | None = None  # MXFP4 when the target shipped MXFP4 experts (gpt-oss)
    expert_format: str | None = None  # MoE experts as written: mxfp4 | nvfp4 | fp8 | bf16 ...
    dtype: str | None = None  # unquantized tensors (bfloat16 / float16; float32 only for gpu cpu)
    report: dict[str, Any] | None = None  # quantized module count, MXFP4 -> NVFP4 cast block counts


class Limits(Strict):
    max_batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_draft_len: int = Field(15, ge=1)
    max_num_tokens: int | None = Field(None, ge=1)


class DraftInfo(Strict):
    path: str = "draft"
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    family: str | None = None  # dflash | dflash2 (runtime/drafters/families.py); None: an older manifest


class SpeculationInfo(Strict):
    """How the node speculates (speculative_config beyond the drafter), and why: the draft-length
    schedule with the cost model's inputs and predictions (engine/schedule_plan.py), and the
    opt-in sampled verification and acceptance-rate floor."""

    source: str  # derived | given | off | none
    max_draft_len: int = Field(ge=1)  # = limits.max_draft_len
    requested_max_draft_len: int = Field(ge=1)  # before the schedule lowered it (the same when it did not)
    draft_len_schedule: dict[int, int] | None = None  # as written in llm_api_options.yaml
    rejection_sampling: bool = False  # use_rejection_sampling
    acceptance_rate_window: int | None = None  # acceptance_rate_window_size
    acceptance_rate_threshold: float | None = None
    model: dict[str, Any] | None = None  # the step-cost model's inputs (GPU, mapping, dims, acceptance) and buckets
    notes: list[str] = Field(default_factory=list)
    # what the floor at 1 changed (the schedule before it, the batches it lifted from 0) and its cost
    # by the model (engine/schedule_plan.py floor_for_trtllm); None: nothing floored
    floor: dict[str, Any] | None = None
    # DFlashDecodingConfig fields beyond the drafter's: {"attention_backend": {"written": "FA4", "why": ...},
    # "context_recompute_tail": {"written": null, "why": "not measured ..."}, ...} (engine/release_fields.py)
    fields: dict[str, dict[str, Any]] | None = None


class TargetInfo(Strict):
    path: str = "target"
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int


class EngineManifest(Strict):
    format_version: int = FORMAT_VERSION
    name: str
    created: str  # ISO-8601 UTC
    gpu: str  # b300 | b200 | h200 | h100 | cpu
    mapping: Mapping
    quantization: Quantization
    limits: Limits
    target: TargetInfo
    draft: DraftInfo
    llm_api_options: str = "llm_api_options.yaml"
    min_tensorrt_llm_version: str  # oldest release accepting every key of llm_api_options (trtllm_versions)
    versions: dict[str, str]  # library -> version used by the build
    spec: dict[str, Any]  # the resolved build spec, as printed
    files: dict[str, str]  # relative path -> sha256 of every other file in the directory
    # Optional build reports (added by the build area; absent in older manifests):
    plan: dict[str, Any] | None = None  # memory plan per GPU (dflash_trt.engine.plan.MemoryPlan)
    acceptance: dict[str, Any] | None = None  # tau before/after quantization (acceptance gate)
    timings_s: dict[str, float] = Field(default_factory=dict)  # seconds per build phase
    build_device: str | None = None  # where calibration and the gate ran (cpu, or the GPUs)
    # "key" / "key=value" of llm_api_options -> first TensorRT-LLM release with it (why the minimum is what it is)
    tensorrt_llm_requirements: dict[str, str] | None = None
    speculation: SpeculationInfo | None = None  # absent in older manifests
    # the release llm_api_options.yaml was written for (build --tensorrt-llm-release; absent in older manifests)
    tensorrt_llm_release: str | None = None

    def draft_len_schedule(self) -> "DraftLenSchedule | None":
        """The engine's draft-length schedule (None: none), for a runtime that serves as the node does."""
        from dflash_trt.draft_len_schedule import DraftLenSchedule

        mapping = self.speculation.draft_len_schedule if self.speculation else None
        return DraftLenSchedule.from_mapping(mapping) if mapping else None


def load_manifest(engine_dir: str | Path) -> EngineManifest:
    """Read and validate `engine_dir/dflash_trt.json` (DFlashError with a fix on any problem)."""
    from dflash_trt.config import load_config

    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST_NAME
    if not path.is_file():
        hint = " (an interrupted build leaves no manifest; rebuild)" if engine_dir.is_dir() else ""
        raise DFlashError(f"{engine_dir} is not a dflash-trt engine directory: {MANIFEST_NAME} missing{hint}; run `dflash-trt build`")
    manifest = load_config(EngineManifest, path, what="engine manifest",
                           fix="rebuild the engine with this dflash-trt version")
    if manifest.format_version != FORMAT_VERSION:
        raise DFlashError(f"{path}: format_version {manifest.format_version} is not {FORMAT_VERSION}; rebuild the engine")
    return manifest
