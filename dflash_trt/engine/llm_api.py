"""`llm_api_options.yaml` (TensorRT-LLM LLM-API args) and the launch commands of an engine.

Field names and placement follow tensorrt_llm/llmapi/llm_args.py (TorchLlmArgs, KvCacheConfig,
CudaGraphConfig, MoeConfig, DFlashDecodingConfig) as of NVIDIA/TensorRT-LLM commit 0004396 (1.3
line). Those models are pydantic with extra="forbid": one unknown or misplaced key and
`trtllm-serve --config` refuses the file, so `verify` re-checks the file against the tables below.

Which release accepts the file is data: `trtllm_fields.json` (read by `trtllm_versions`) records
each key's first published TensorRT-LLM version and upstream's default. Keys equal to the default
are left out, so an engine only needs the release that has every key it actually writes.

Paths inside the file are relative to the engine directory; the launch scripts `cd` there first.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.engine.hardware import GPUS, moe_backend
from dflash_trt.engine.trtllm_versions import requirements, strip_defaults
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
                                     "target_layer_ids", "attention_backend", "max_concurrency",
                                     "acceptance_rate_window_size", "acceptance_rate_threshold"}),
}
ENUMS: dict[tuple[str, str], frozenset[str]] = {
    ("speculative_config", "decoding_type"): frozenset({"DFlash"}),
    # DFlashDecodingConfig / DFlashForCausalLM accept these two only (tests/upstream/tensorrt_llm_node.json)
    ("speculative_config", "attention_backend"): frozenset({"VANILLA", "TRTLLM"}),
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


def llm_api_options(spec: Any, *, is_moe: bool, max_draft_len: int, max_num_tokens: int, mask_token_id: int,
                    target_layer_ids: list[int], draft_path: str = "./draft", dtype: str | None = None,
                    expert_format: str | None = None) -> dict[str, Any]:
    """The LLM-API kwargs (minus `model`, given on the command line) for this build.

    `dtype`: the engine's unquantized dtype, written explicitly (TensorRT-LLM's "auto" would
    follow config.json). `expert_format` (mxfp4 | nvfp4 | fp8 | bf16...): picks the MoE backend
    as TensorRT-LLM's gpt-oss guide does (hardware.moe_backend). Keys equal to upstream's default
    are left out (`strip_defaults`): each written key is one a release may lack, and the
    manifest's minimum TensorRT-LLM version follows what is written.
    """
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
    })
    opts["speculative_config"] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len,
        "speculative_model": draft_path,
        # Written explicitly (upstream would read them from draft/config.json) so the engine
        # directory states what runs, and a swapped drafter is caught by verify's hashes.
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
        "attention_backend": dflash_attention_backend(spec),
    }
    return strip_defaults(opts)


def dflash_attention_backend(spec: Any) -> str:
    """DFlashDecodingConfig.attention_backend: the spec's choice, or the GPU's default ("auto")."""
    choice = spec.dflash_attention_backend
    gpu = GPUS[spec.gpu]
    if choice == "TRTLLM" and gpu.family != "blackwell":
        # upstream's TRTLLM path checks is_sm_100f: SM100/SM103 only (dflash_attention.py)
        raise DFlashError(f"dflash_attention_backend TRTLLM needs a Blackwell GPU (SM100/SM103) and this engine is "
                          f"for {spec.gpu}; use auto or VANILLA (FlashAttention), or build for --gpu b200/b300")
    return gpu.dflash_attention_backend if choice == "auto" else choice


def render_yaml(opts: dict[str, Any], header: str) -> str:
    import yaml

    body = yaml.safe_dump(opts, sort_keys=False, default_flow_style=None)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


def check_llm_api_options(opts: Any, where: str = "llm_api_options.yaml") -> None:
    """DFlashError naming the first key TensorRT-LLM would refuse (unknown, misplaced, bad enum)."""
    if not isinstance(opts, dict):
        raise DFlashError(f"{where}: must be a YAML mapping; rebuild the engine")
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
    requirements(opts)  # every key has a recorded first TensorRT-LLM version


def launch_scripts(spec: Any, *, is_moe: bool, max_draft_len: int, block_size: int) -> dict[str, str]:
    """The same engine as trtllm-serve, vLLM and SGLang commands (bash, run from anywhere).

    Flag names are those of the peers' argument parsers, recorded with their source in
    `launch_flags.json` (tests check every flag emitted here against it).
    """
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
    return {"launch/trtllm-serve.sh": trt, "launch/vllm.sh": head + cd + _vllm_command(spec, is_moe, max_draft_len),
            "launch/sglang.sh": head + _sglang_command(spec, is_moe, max_draft_len, block_size, cd)}


def _vllm_command(spec: Any, is_moe: bool, max_draft_len: int) -> str:
    import json

    speculative = {"method": "dflash", "model": "./draft", "num_speculative_tokens": max_draft_len}
    if spec.gpu != "cpu":
        # The drafter's attention is non-causal: pick a backend that supports it for the DRAFTER
        # only (SpeculativeConfig.attention_backend) and leave the target's to vLLM's choice.
        speculative["attention_backend"] = "flash_attn"
    return (f"exec vllm serve ./target --speculative-config '{json.dumps(speculative)}' "
            f"--tensor-parallel-size {spec.tp} --pipeline-parallel-size {spec.pp} "
            f"--max-model-len {spec.max_seq_len} --max-num-seqs {spec.max_batch_size} "
            + ("--enable-expert-parallel " if is_moe and spec.ep > 1 else "")
            + ("--kv-cache-dtype fp8 " if spec.kv_cache_quant == "fp8" else "")
            + "--port \"${PORT:-8000}\" \"$@\"\n")


def _sglang_command(spec: Any, is_moe: bool, max_draft_len: int, block_size: int, cd: str) -> str:
    if spec.pp > 1:
        # SGLang's DFLASH worker refuses pp_size != 1 (speculative_hook.py); say so before loading.
        return ("echo \"error: SGLang's DFLASH speculative decoding supports pipeline parallel size 1 only and this "
                f"engine is built for PP {spec.pp}; serve it with launch/trtllm-serve.sh or launch/vllm.sh, or rebuild "
                "with --pp 1\" >&2\nexit 2\n")
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
    return cd + (
        "exec python -m sglang.launch_server --model-path ./target --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path ./draft --speculative-num-draft-tokens {min(block_size, max_draft_len + 1)} "
        + " ".join(flags)
        + f" --context-length {spec.max_seq_len} --port \"${{PORT:-30000}}\" \"$@\"\n"
    )
