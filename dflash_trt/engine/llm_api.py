"""`llm_api_options.yaml` (TensorRT-LLM LLM-API args) and the launch commands of an engine.

Field names and placement follow tensorrt_llm/llmapi/llm_args.py (TorchLlmArgs, KvCacheConfig,
CudaGraphConfig, MoeConfig, DFlashDecodingConfig) as of NVIDIA/TensorRT-LLM commit 0004396 (1.3
line). Those models are pydantic with extra="forbid": one unknown or misplaced key and
`trtllm-serve --config` refuses the file, so `verify` re-checks the file against the tables below.

Which release accepts the file is data: `trtllm_fields.json` (read by `trtllm_versions`) records
each key's first published TensorRT-LLM version and upstream's default. Keys equal to the default
are left out, so an engine only needs the release that has every key it actually writes. The file
is written for one release (`build --tensorrt-llm-release`, default the container's): the fields
that serve from it (engine/release_fields.py), never a key it lacks (the gate in
`llm_api_options`), never a DFlash draft length of 0 (schedule_plan's floor; `verify` refuses one)
and never the overlap scheduler off.

Paths inside the file are relative to the engine directory; the launch scripts `cd` there first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_trt.draft_len_schedule import DraftLenSchedule
from dflash_trt.engine.hardware import GPUS, moe_backend
from dflash_trt.engine.recompute_tail import RecomputeTailMeasurement
from dflash_trt.engine.release_fields import FieldChoice, release_fields
from dflash_trt.engine.trtllm_versions import engine_release, requirements, strip_defaults, unmet, upstream_default
from dflash_trt.errors import DFlashError

# The keys this project writes or accepts, per section (a subset of upstream's fields).
TOP_LEVEL_KEYS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size",
    "gpus_per_node", "max_batch_size", "max_seq_len", "max_num_tokens", "max_input_len", "dtype",
    "kv_cache_config", "cuda_graph_config", "moe_config", "speculative_config", "attn_backend",
    "enable_chunked_prefill", "disable_overlap_scheduler", "trust_remote_code",
    # Throughput knobs of upstream's recipes (TorchLlmArgs; see trtllm_fields.json for sources).
    "enable_attention_dp", "stream_interval", "num_postprocess_workers",
})
SECTION_KEYS: dict[str, frozenset[str]] = {
    "kv_cache_config": frozenset({"dtype", "free_gpu_memory_fraction", "enable_block_reuse", "max_tokens",
                                  "tokens_per_block", "max_attention_window"}),
    "cuda_graph_config": frozenset({"batch_sizes", "max_batch_size", "enable_padding"}),
    "moe_config": frozenset({"backend", "max_num_tokens"}),
    "speculative_config": frozenset({"decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
                                     "target_layer_ids", "attention_backend", "draft_len_schedule",
                                     "acceptance_rate_window_size", "acceptance_rate_threshold",
                                     "use_rejection_sampling", "context_recompute_tail"}),
}
# Keys upstream has that this project must never write, and why (checked before "unknown").
FORBIDDEN_KEYS: dict[tuple[str, str], str] = {
    ("speculative_config", "spec_dec_variant"): (
        "TensorRT-LLM tells DFlash2 from DFlash by the drafter checkpoint under decoding_type: DFlash "
        "(DFlashForCausalLM: dflash_config conv/selector keys or a DFlash2 architecture); spec_dec_variant "
        "(DecodingBaseConfig, 1.4.0rc1) has no DFlash meaning and older releases refuse it: remove it"),
    ("speculative_config", "moe_backend"): (
        "DFlash drafters are dense: DecodingBaseConfig.moe_backend (1.4.0rc1) has nothing to choose, and older "
        "releases refuse it: remove it"),
    ("speculative_config", "skip_ctx_buffer_budget_check"): (
        "it skips a context-buffer budget check TensorRT-LLM does not document (1.4.0rc1; older releases refuse "
        "it): remove it"),
    ("speculative_config", "max_concurrency"): (
        "TensorRT-LLM implements max_concurrency as a draft_len_schedule that drafts 0 above it, and a one-model "
        "DFlash worker at 0 drafts stops refreshing its context buffers (PR 16888, open): remove it and rebuild "
        "(the build writes a schedule floored at 1 up to max_batch_size)"),
}
OVERLAP_WHY = ("one-model DFlash runs with TensorRT-LLM's overlap scheduler (SpeculativeDecodingMode.DFLASH."
               "support_overlap_scheduler()): the host schedules step n+1 while the GPU runs step n")
ENUMS: dict[tuple[str, str], frozenset[str]] = {
    ("speculative_config", "decoding_type"): frozenset({"DFlash"}),
    # DFlashDecodingConfig / DFlashForCausalLM (tests/upstream/tensorrt_llm_node.json): FA4 from 1.3.0rc27
    ("speculative_config", "attention_backend"): frozenset({"VANILLA", "TRTLLM", "FA4"}),
    ("kv_cache_config", "dtype"): frozenset({"auto", "fp8", "float16", "bfloat16", "nvfp4"}),
    ("moe_config", "backend"): frozenset({"AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "VANILLA", "TRITON"}),
}


# flash_attn_with_kvcache (VANILLA) and TRTLLM-gen take fp16/bf16 only (tests/upstream/tensorrt_llm_node.json)
TRTLLM_DTYPES = frozenset({"bfloat16", "float16"})


def tensorrt_llm_refusal(manifest: Any) -> str | None:
    """Why TensorRT-LLM cannot run this engine (None: it can). A CPU engine is float32 and for the
    reference runtime: deploy, doctor, serve and the launchers refuse to hand it to TensorRT-LLM."""
    dtype = manifest.quantization.dtype
    if manifest.gpu != "cpu" and (dtype is None or dtype in TRTLLM_DTYPES):
        return None
    return (f"engine {manifest.name!r} is built for {manifest.gpu} in {dtype or 'float32'}, and TensorRT-LLM's DFlash "
            "kernels run float16/bfloat16 on a GPU only: serve it with the pytorch backend, or rebuild it with "
            "--gpu h100|h200|b200|b300")


def block_reuse(spec: Any) -> bool:
    """Whether the engine's KV cache reuses prefix blocks (prefix caching): the spec's
    enable_block_reuse where it has one, else TensorRT-LLM's default (true)."""
    given = getattr(spec, "enable_block_reuse", None)
    return bool(upstream_default("kv_cache_config.enable_block_reuse") if given is None else given)


def speculative_fields(spec: Any, release: str | None = None, *, non_causal_sliding: bool = False,
                       head_dim: int | None = None, measurement: RecomputeTailMeasurement | None = None
                       ) -> list[FieldChoice]:
    """The DFlashDecodingConfig fields an engine of `spec` writes for `release` (release_fields)."""
    return release_fields(spec, release or engine_release(spec), non_causal_sliding=non_causal_sliding,
                          head_dim=head_dim, block_reuse=block_reuse(spec), measurement=measurement)


def llm_api_options(spec: Any, *, is_moe: bool, max_draft_len: int, max_num_tokens: int, mask_token_id: int,
                    target_layer_ids: list[int], draft_path: str = "./draft", dtype: str | None = None,
                    expert_format: str | None = None, schedule: DraftLenSchedule | None = None,
                    non_causal_sliding: bool = False, head_dim: int | None = None, release: str | None = None,
                    fields: Sequence[FieldChoice] | None = None) -> dict[str, Any]:
    """The LLM-API kwargs (minus `model`, given on the command line) for this build, for TensorRT-LLM
    `release` (default: the spec's, trtllm_versions.engine_release).

    `dtype`: the engine's unquantized dtype, written explicitly (TensorRT-LLM's "auto" would
    follow config.json). `expert_format` (mxfp4 | nvfp4 | fp8 | bf16...): picks the MoE backend
    as TensorRT-LLM's gpt-oss guide does (hardware.moe_backend). `schedule`: the engine's
    draft_len_schedule as decided for `release` (schedule_plan.decide: int keys, the smallest maps
    to `max_draft_len`, floored at 1). `fields`: the DFlashDecodingConfig fields beyond the
    drafter's (release_fields; computed from `non_causal_sliding` / `head_dim` when not given).
    Keys equal to upstream's default are left out (`strip_defaults`): each written key is one a
    release may lack, and the manifest's minimum TensorRT-LLM version follows what is written; so
    rejection sampling and the acceptance-rate floor appear only when asked for. A key `release`
    does not accept is refused in one line (the gate); `verify`'s check runs on the result.
    """
    release = release or engine_release(spec)
    if fields is None:
        fields = speculative_fields(spec, release, non_causal_sliding=non_causal_sliding, head_dim=head_dim)
    gpu = GPUS[spec.gpu]
    opts: dict[str, Any] = {
        "tensor_parallel_size": spec.tp,
        "pipeline_parallel_size": spec.pp,
    }
    if dtype is not None:
        opts["dtype"] = dtype
    if is_moe:
        opts["moe_expert_parallel_size"] = spec.ep
    opts.update({
        "max_batch_size": spec.max_batch_size,
        "max_seq_len": spec.max_seq_len,
        "max_num_tokens": max_num_tokens,
        # 'auto' keeps the checkpoint's kv_cache_quant_algo (hf_quant_config.json); fp8 forces it.
        "kv_cache_config": {
            "dtype": "fp8" if spec.kv_cache_quant == "fp8" else "auto",
            "free_gpu_memory_fraction": spec.free_gpu_memory_fraction,
            "enable_block_reuse": block_reuse(spec),
        },
        # Decode-only CUDA graphs up to the batch size; padding rounds odd batches up to a graph.
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": spec.max_batch_size},
    })
    backend = moe_backend(spec.gpu, expert_format) if expert_format else gpu.moe_backend
    if is_moe and backend:
        opts["moe_config"] = {"backend": backend}
    opts.update({
        "enable_attention_dp": spec.enable_attention_dp,
        "stream_interval": spec.stream_interval,
        "num_postprocess_workers": spec.num_postprocess_workers,
        # never written (upstream's false): DFlash overlaps the host's scheduling with the GPU's step
        "disable_overlap_scheduler": False,
    })
    opts["speculative_config"] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len,
        "speculative_model": draft_path,
        # Written explicitly (upstream would read them from draft/config.json) so the engine
        # directory states what runs, and a swapped drafter is caught by verify's hashes.
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    for f in fields:
        if f.value is not None:
            opts["speculative_config"][f.key] = f.value
    if schedule is not None:
        schedule.check_against(max_draft_len)
        opts["speculative_config"]["draft_len_schedule"] = schedule.to_mapping()
    opts["speculative_config"]["use_rejection_sampling"] = bool(spec.rejection_sampling)
    if spec.acceptance_rate_window is not None:
        opts["speculative_config"]["acceptance_rate_window_size"] = spec.acceptance_rate_window
        opts["speculative_config"]["acceptance_rate_threshold"] = spec.acceptance_rate_threshold
    opts = strip_defaults(opts)
    too_new = unmet(requirements(opts), release)
    if too_new:
        key, first = next(iter(too_new.items()))
        raise DFlashError(f"TensorRT-LLM {release} refuses speculative options it does not have: {key} (first in "
                          f"{first}); build for --tensorrt-llm-release {first} or later, or leave that setting out")
    check_llm_api_options(opts, where=f"llm_api_options for TensorRT-LLM {release}")
    return opts


def render_yaml(opts: dict[str, Any], header: str) -> str:
    import yaml

    body = yaml.safe_dump(opts, sort_keys=False, default_flow_style=None)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


def check_llm_api_options(opts: Any, where: str = "llm_api_options.yaml") -> None:
    """DFlashError naming the first key TensorRT-LLM would refuse (unknown, misplaced, bad enum)."""
    if not isinstance(opts, dict):
        raise DFlashError(f"{where}: must be a YAML mapping; rebuild the engine")
    for (section, sub), why in FORBIDDEN_KEYS.items():
        if isinstance(opts.get(section), dict) and sub in opts[section]:
            raise DFlashError(f"{where}: {section}.{sub} must not be written: {why}")
    for key, value in opts.items():
        if key in ("model", "backend"):
            raise DFlashError(f"{where}: {key!r} belongs on the trtllm-serve command line, not in the options file")
        if key not in TOP_LEVEL_KEYS:
            owner = next((s for s, keys in SECTION_KEYS.items() if key in keys), None)
            hint = f"; it belongs under {owner}" if owner else ""
            raise DFlashError(f"{where}: unknown top-level key {key!r}{hint} (TensorRT-LLM rejects unknown keys)")
        if key in SECTION_KEYS:
            if not isinstance(value, dict):
                raise DFlashError(f"{where}: {key} must be a mapping, got {type(value).__name__}")
            for sub, subval in value.items():
                if sub not in SECTION_KEYS[key]:
                    owner = "top level" if sub in TOP_LEVEL_KEYS else None
                    hint = f"; it belongs at the {owner}" if owner else ""
                    raise DFlashError(f"{where}: unknown key {key}.{sub}{hint} (TensorRT-LLM rejects unknown keys)")
                allowed = ENUMS.get((key, sub))
                if allowed is not None and subval not in allowed:
                    raise DFlashError(f"{where}: {key}.{sub}={subval!r} is not one of {sorted(allowed)}")
    spec = opts.get("speculative_config")
    if not spec or spec.get("decoding_type") != "DFlash" or not spec.get("speculative_model"):
        raise DFlashError(f"{where}: speculative_config needs decoding_type: DFlash and speculative_model; rebuild")
    check_speculation_rules(spec, where)
    if opts.get("disable_overlap_scheduler") is True:
        raise DFlashError(f"{where}: disable_overlap_scheduler: true turns off what {OVERLAP_WHY}; remove it")
    zero_draft_line = zero_draft_refusal(opts)
    if zero_draft_line:
        raise DFlashError(f"{where}: {zero_draft_line}")
    requirements(opts)  # every key has a recorded first TensorRT-LLM version


def zero_draft_refusal(opts: dict[str, Any]) -> str | None:
    """Why TensorRT-LLM would draft 0 at a batch size this file serves, with the fix (None: it never
    does, or the release the file needs floors it itself: trtllm_fields.json behaviours)."""
    from dflash_trt.engine.trtllm_versions import behaviour_release, zero_draft_batches

    zero = zero_draft_batches(opts)
    if not zero or behaviour_release("dflash_zero_draft_len_safe") is not None:
        return None
    spec = opts.get("speculative_config") or {}
    served = zero[-1][1]
    what = (f"draft_len_schedule {spec['draft_len_schedule']}" if spec.get("draft_len_schedule") is not None
            else f"max_concurrency {spec.get('max_concurrency')}")
    ranges = ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in zero)
    floored = (DraftLenSchedule.from_mapping(spec["draft_len_schedule"]).floored(served).to_mapping()
               if spec.get("draft_len_schedule") is not None else None)
    return (f"speculative_config.{what} drafts 0 at batch sizes {ranges} (max_batch_size {served}), where a "
            "one-model DFlash worker stops refreshing its context buffers and acceptance collapses once drafting "
            "resumes (TensorRT-LLM PR 16888, in no release); rebuild the engine with this dflash-trt, which floors "
            "the schedule at 1 up to max_batch_size" + (f" ({floored})" if floored else ""))


def check_speculation_rules(spec: dict[str, Any], where: str) -> None:
    """DecodingBaseConfig's validators (llm_args.py, tests/upstream/tensorrt_llm_node.json): a schedule
    with int keys whose smallest maps to max_draft_len and no value above it (max_concurrency, the
    other half of upstream's mutually exclusive pair, is never accepted: FORBIDDEN_KEYS); the
    acceptance-rate floor a window >= 1 with a threshold in [0, 1]."""
    schedule = spec.get("draft_len_schedule")
    if schedule is not None:
        if not isinstance(schedule, dict) or not all(isinstance(b, int) and isinstance(k, int)
                                                     for b, k in schedule.items()):
            raise DFlashError(f"{where}: speculative_config.draft_len_schedule={schedule!r} must map int batch sizes "
                              "to int draft lengths; rebuild the engine")
        try:
            DraftLenSchedule.from_mapping(schedule).check_against(int(spec.get("max_draft_len") or 0))
        except DFlashError as e:
            raise DFlashError(f"{where}: speculative_config.draft_len_schedule: {e}") from None
    window, threshold = spec.get("acceptance_rate_window_size"), spec.get("acceptance_rate_threshold")
    if (window is None) != (threshold is None):
        raise DFlashError(f"{where}: speculative_config has only one of acceptance_rate_window_size and "
                          "acceptance_rate_threshold; the floor needs both (rebuild with --acceptance-rate-window N "
                          "--acceptance-rate-threshold X)")
    if window is not None and (not isinstance(window, int) or window < 1
                               or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1):
        raise DFlashError(f"{where}: acceptance_rate_window_size={window!r} / acceptance_rate_threshold={threshold!r}: "
                          "need a window >= 1 and a threshold in [0, 1]; rebuild the engine")


def launch_scripts(spec: Any, *, is_moe: bool, max_draft_len: int, block_size: int,
                   schedule: DraftLenSchedule | None = None, family: str = "dflash",
                   vllm_schedule: DraftLenSchedule | None | str = "same") -> dict[str, str]:
    """The same engine as trtllm-serve, vLLM and SGLang commands (bash, run from anywhere).

    Flag names are those of the peers' argument parsers, recorded with their source in
    `launch_flags.json` (tests check every flag emitted here against it). `schedule` (the engine's
    draft_len_schedule) is what SGLang's note names; `vllm_schedule` ("same": `schedule`) becomes
    vLLM's num_speculative_tokens_per_batch_size: the schedule before TensorRT-LLM's floor, 0 where
    drafting loses, since vLLM 0.33 keeps DFlash's context at 0 drafts
    (tests/upstream/peers_speculation.json, vllm zero_range). SGLang has no per-batch-size draft
    length for DFLASH and its script says so. Neither peer's overlap is turned off: vLLM's async
    scheduling and SGLang's overlap scheduler stay at their defaults, on for DFlash wherever the
    installed release allows. `family` "dflash2": what each peer needs for it.
    """
    vllm_schedule = schedule if isinstance(vllm_schedule, str) else vllm_schedule
    head = "#!/usr/bin/env bash\n# Generated by dflash-trt build. Paths are relative to the engine directory.\nset -euo pipefail\n"
    cd = "cd \"$(dirname \"$0\")/..\"\n"
    multi = spec.tp * spec.pp > spec.gpus_per_node
    trt = head + cd
    if spec.gpu == "cpu":
        trt = head + ("echo \"error: this engine is built for the CPU (float32): TensorRT-LLM's DFlash kernels run "
                      "float16/bfloat16 on a GPU only; serve it with dflash-trt serve, or rebuild with --gpu "
                      "h100|h200|b200|b300\" >&2\nexit 2\n")
    elif multi:
        trt += "# Multi-node: run under `srun --mpi=pmix` with one task per GPU (see dflash-trt deploy slurm).\n"
        trt += "exec trtllm-llmapi-launch trtllm-serve ./target --config ./llm_api_options.yaml --host 0.0.0.0 --port \"${PORT:-8000}\" \"$@\"\n"
    else:
        trt += "exec trtllm-serve ./target --config ./llm_api_options.yaml --host 0.0.0.0 --port \"${PORT:-8000}\" \"$@\"\n"
    return {"launch/trtllm-serve.sh": trt,
            "launch/vllm.sh": head + cd + _vllm_command(spec, is_moe, max_draft_len, block_size, vllm_schedule, family),
            "launch/sglang.sh": head + _sglang_command(spec, is_moe, max_draft_len, block_size, cd, schedule, family)}


def _vllm_command(spec: Any, is_moe: bool, max_draft_len: int, block_size: int, schedule: DraftLenSchedule | None,
                  family: str) -> str:
    import json

    notes: list[str] = []
    tokens = max_draft_len
    what = f"The engine's draft_len_schedule {schedule.to_mapping()}" if schedule is not None else ""
    if family == "dflash2":
        # The DFlash2 conv's block is 1 + num_speculative_tokens (qwen3_dflash2.py): the trained block,
        # whatever the engine's K; a K below it is then the per-batch-size schedule's job.
        tokens = block_size - 1
        if schedule is None and max_draft_len < tokens:
            schedule = DraftLenSchedule(((spec.max_batch_size, max_draft_len),))
            what = f"The engine's max_draft_len {max_draft_len} at every batch size (below the drafter's block)"
        notes.append("# DFlash2 drafter: vLLM runs its candidate selector on Model Runner V2 only (V1 refuses "
                     "'DFlash candidate-head drafts', config/vllm.py); V2 needs Triton and a GPU.\n"
                     "export VLLM_USE_V2_MODEL_RUNNER=1\n")
    speculative: dict[str, Any] = {"method": "dflash", "model": "./draft", "num_speculative_tokens": tokens}
    if spec.gpu != "cpu":
        # The drafter's attention is non-causal: pick a backend that supports it for the DRAFTER
        # only (SpeculativeConfig.attention_backend) and leave the target's to vLLM's choice.
        speculative["attention_backend"] = "flash_attn"
    if schedule is not None:
        ranges = schedule.vllm_ranges(spec.max_batch_size)
        speculative["num_speculative_tokens_per_batch_size"] = [list(r) for r in ranges]
        tail = ("; vLLM carries the last range past its end, so the batches above the largest key draft 0 "
                "explicitly" if ranges[-1][2] == 0 and len(ranges) > len(schedule.steps) else "")
        notes.append(f"# {what} as inclusive (start, end, drafts) batch-size ranges (TensorRT-LLM: smallest key "
                     f">= the batch){tail}.\n")
        if any(n == 0 for _, _, n in ranges):
            notes.append("# A 0 range is safe here: vLLM 0.33 keeps DFlash's drafter context at 0 drafts (V1 "
                         "SpecDecodeBaseProposer.propose runs the context pass and returns no drafts; V2 "
                         "DFlashSpeculator.propose stores the context K/V and skips the query), so these ranges keep "
                         "the cost model's 0s, which the TensorRT-LLM schedule floors at 1 (PR 16888).\n")
    if spec.rejection_sampling:
        # TensorRT-LLM's use_rejection_sampling: sampled drafts verified against their probabilities
        # (vLLM's default "greedy" is rejection sampling with a one-hot draft, also lossless).
        speculative["draft_sample_method"] = "probabilistic"
    if spec.acceptance_rate_window is not None:
        notes.append("# acceptance_rate_window_size / acceptance_rate_threshold: vLLM 0.33 has no such floor; "
                     "speculation stays on here.\n")
    notes.append("# Async scheduling (the host schedules step n+1 while the GPU runs step n) is left to vLLM's default, "
                 "on for DFlash wherever the installed release allows it (0.33 config/vllm.py: unset -> on"
                 + (", but off on Model Runner V1 with pipeline parallel" if spec.pp > 1 else "")
                 + "); --async-scheduling would refuse to start where it cannot.\n")
    return ("".join(notes) + f"exec vllm serve ./target --speculative-config '{json.dumps(speculative)}' "
            f"--tensor-parallel-size {spec.tp} --pipeline-parallel-size {spec.pp} "
            f"--max-model-len {spec.max_seq_len} --max-num-seqs {spec.max_batch_size} "
            + ("--enable-expert-parallel " if is_moe and spec.ep > 1 else "")
            + ("--kv-cache-dtype fp8 " if spec.kv_cache_quant == "fp8" else "")
            + "--port \"${PORT:-8000}\" \"$@\"\n")


def _sglang_command(spec: Any, is_moe: bool, max_draft_len: int, block_size: int, cd: str,
                    schedule: DraftLenSchedule | None, family: str) -> str:
    if spec.pp > 1:
        # SGLang's DFLASH worker refuses pp_size != 1 (speculative_hook.py); say so before loading.
        return ("echo \"error: SGLang's DFLASH speculative decoding supports pipeline parallel size 1 only and this "
                f"engine is built for PP {spec.pp}; serve it with launch/trtllm-serve.sh or launch/vllm.sh, or rebuild "
                "with --pp 1\" >&2\nexit 2\n")
    notes: list[str] = []
    if schedule is not None:
        notes.append(f"# SGLang 0.5.23 has no per-batch-size draft length for DFLASH (--speculative-adaptive adapts "
                     "EAGLE/EAGLE3 only: srt/speculative/adaptive_spec_params.py), so every batch verifies the "
                     f"drafts below; the engine's draft_len_schedule {schedule.to_mapping()} applies on "
                     "launch/trtllm-serve.sh and launch/vllm.sh.\n")
    draft_tokens = min(block_size, max_draft_len + 1)
    if family == "dflash2":
        # --speculative-num-draft-tokens re-blocks the DFlash2 convolutions (DFlash2 model set_block_size,
        # srt/models/dflash.py): the trained block keeps their taps where training put them.
        draft_tokens = block_size
        notes.append("# DFlash2 drafter: SGLang picks it from the drafter's architectures (DFlash2DraftModel), "
                     "no flag; its convolutions run on the trained block (the draft tokens below); at "
                     "temperature > 0 it samples the selector's walk and verifies by rejection sampling.\n")
    if spec.rejection_sampling and family != "dflash2":
        notes.append("# Sampled requests: SGLang's DFLASH drafts greedily (a point mass) and verifies losslessly; "
                     "it has no switch for sampled DFlash v1 drafts.\n")
    if spec.acceptance_rate_window is not None:
        notes.append("# acceptance_rate_window_size / acceptance_rate_threshold: SGLang has no such floor for "
                     "DFLASH; speculation stays on here.\n")
    notes.append("# The overlap scheduler is SGLang's default for DFLASH (spec v2, dflash_worker_v2.py: draft and verify "
                 "preparation on separate streams); it is not turned off here.\n")
    flags = [f"--tp-size {spec.tp}"]
    if is_moe and spec.ep > 1:
        flags.append(f"--ep-size {spec.ep}")
    if spec.enable_attention_dp:
        # Attention data parallel across the TP ranks; DFLASH with DP attention needs the DP LM head.
        flags.append(f"--attn-dp-size {spec.tp} --enable-dp-lm-head")
    if spec.stream_interval != 1:
        flags.append(f"--stream-interval {spec.stream_interval}")
    if spec.kv_cache_quant == "fp8":
        flags.append("--kv-cache-dtype fp8_e4m3")
    return cd + "".join(notes) + (
        "exec python -m sglang.launch_server --model-path ./target --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path ./draft --speculative-num-draft-tokens {draft_tokens} "
        + " ".join(flags)
        + f" --context-length {spec.max_seq_len} --port \"${{PORT:-30000}}\" \"$@\"\n"
    )
