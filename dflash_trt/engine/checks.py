"""Checks that run before any heavy work: the parallel mapping and the quantization vs the GPU.

Each failure is a DFlashError with one line: what failed, the values, and the fix.

Rules (TensorRT-LLM PyTorch backend):
- attention heads must divide evenly over TP ranks: splitting a head in half is not a valid
  shard (ModelOpt's legacy `export_tensorrt_llm_checkpoint(inference_tensor_parallel=N)` would do
  it silently, e.g. SmolLM2's 9 heads at TP 2).
- KV heads: if num_kv_heads % tp == 0 each rank holds num_kv_heads / tp of them; if fewer KV heads
  than ranks, TensorRT-LLM replicates them when tp % num_kv_heads == 0 (each rank keeps ONE KV
  head, shared by tp / num_kv_heads ranks). Anything else cannot be sharded.
- pipeline stages: 1 <= pp <= num_layers (uneven splits are allowed; TRT-LLM spreads the remainder).
- experts: moe_tp_size * moe_ep_size == tp_size, so ep must divide tp, and num_experts % ep == 0.
  Dense targets need ep == 1.
- world size = tp * pp MPI ranks must fit gpus_per_node * nodes.
- quantization: NVFP4 needs FP4 tensor cores (Blackwell); FP8 weights / KV need FP8 (Hopper+).
- dtype: GPU engines keep 16-bit unquantized tensors; float32 is the CPU recipe's only.
- MoE backend: Hopper serves MXFP4 experts with TRITON, which shards experts by expert parallelism
  only, so there moe_tp = tp / ep must be 1.
"""

from __future__ import annotations

from dflash_trt.engine.archs import ArchSpec
from dflash_trt.engine.hardware import EP_ONLY_MOE_BACKENDS, GPUS, QUANT_TO_FORMAT, WEIGHT_FORMATS, Gpu, moe_backend
from dflash_trt.engine.spec import BuildSpec
from dflash_trt.errors import DFlashError


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank stores (replicated when there are fewer KV heads than ranks)."""
    return num_kv_heads // tp if num_kv_heads % tp == 0 else 1


def check_mapping(arch: ArchSpec, spec: BuildSpec) -> None:
    tp, pp, ep = spec.tp, spec.pp, spec.ep
    if arch.num_heads % tp:
        ok = [d for d in range(1, arch.num_heads + 1) if arch.num_heads % d == 0 and d <= 64]
        raise DFlashError(
            f"--tp {tp} would split attention heads: {arch.name} has {arch.num_heads} heads, not divisible by {tp} "
            f"(a head cannot be sharded); use --tp in {ok}"
        )
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise DFlashError(
            f"--tp {tp} cannot shard {kv} KV heads: need num_kv_heads % tp == 0, or tp % num_kv_heads == 0 "
            f"(KV heads replicated); pick a tp that divides {kv} or is a multiple of it"
        )
    if pp > arch.num_layers:
        raise DFlashError(f"--pp {pp} exceeds the {arch.num_layers} layers of {arch.name}; use --pp <= {arch.num_layers}")
    if arch.is_moe:
        if tp % ep:
            raise DFlashError(
                f"--ep {ep} must divide --tp {tp} (TensorRT-LLM splits experts as moe_tp_size * moe_ep_size == "
                f"tp_size); use --ep in {[d for d in range(1, tp + 1) if tp % d == 0]}"
            )
        if arch.num_experts % ep:
            raise DFlashError(
                f"--ep {ep} does not divide the {arch.num_experts} experts of {arch.name}; use an ep that divides "
                f"{arch.num_experts}"
            )
    elif ep != 1:
        raise DFlashError(f"--ep {ep} needs a mixture-of-experts target, but {arch.name} is dense; use --ep 1")
    gpu = GPUS[spec.gpu]
    world = tp * pp
    if gpu.emulated and world != 1:
        raise DFlashError(
            f"--gpu cpu runs the reference runtime on one process, but tp*pp = {world}; use --tp 1 --pp 1, "
            "or pick the GPU the engine will be deployed on (--gpu b300|b200|h200|h100)"
        )
    available = spec.gpus_per_node * spec.nodes
    if world > available:
        raise DFlashError(
            f"world size tp*pp = {tp}*{pp} = {world} exceeds the {available} GPUs available "
            f"(--gpus-per-node {spec.gpus_per_node} x nodes {spec.nodes}); lower --tp/--pp or add nodes"
        )
    if spec.max_seq_len > arch.max_position_embeddings:
        raise DFlashError(
            f"--max-seq-len {spec.max_seq_len} exceeds {arch.name}'s max_position_embeddings "
            f"{arch.max_position_embeddings}; lower --max-seq-len"
        )


def check_quant(spec: BuildSpec) -> None:
    gpu: Gpu = GPUS[spec.gpu]
    fmt = WEIGHT_FORMATS[QUANT_TO_FORMAT[spec.quant]]
    if fmt.needs and not getattr(gpu, fmt.needs):
        hint = " (Hopper has FP8 tensor cores but no FP4); use --quant fp8" if fmt.needs == "fp4" and gpu.fp8 else ""
        raise DFlashError(
            f"--quant {spec.quant} needs native {fmt.needs.upper()} GEMMs, which {spec.gpu} ({gpu.family}) lacks"
            f"{hint or '; use --quant none'}, or target a Blackwell GPU (--gpu b200|b300)"
        )
    if spec.kv_cache_quant == "fp8" and not gpu.fp8:
        raise DFlashError(f"--kv-cache-quant fp8 needs FP8 support, which {spec.gpu} lacks; use --kv-cache-quant none")


def check_limits(spec: BuildSpec, block_size: int | None) -> tuple[int, int]:
    """(max_draft_len, max_num_tokens) resolved from the spec and the drafter's block size."""
    if block_size is not None:  # K's rule lives in SpeculationSettings, the same for every command
        from dflash_trt.speculation import SpeculationSettings

        draft_len = SpeculationSettings.for_block(block_size, spec.max_draft_len).max_draft_len
    else:  # `plan` without a drafter: the published drafters' block of 16
        draft_len = spec.max_draft_len if spec.max_draft_len is not None else 15
    # A decode step of a full batch verifies max_draft_len + 1 tokens per request.
    need = spec.max_batch_size * (draft_len + 1)
    num_tokens = spec.max_num_tokens if spec.max_num_tokens is not None else max(8192, need)
    if num_tokens < need:
        raise DFlashError(
            f"--max-num-tokens {num_tokens} cannot hold one decode step of the full batch: max_batch_size * "
            f"(max_draft_len + 1) = {spec.max_batch_size} * {draft_len + 1} = {need}; raise it to >= {need}"
        )
    return draft_len, num_tokens


def check_dtype(spec: BuildSpec) -> None:
    """A GPU engine in float32 would run in float32 on TensorRT-LLM: twice the memory and bandwidth."""
    if spec.dtype == "float32" and not GPUS[spec.gpu].emulated:
        raise DFlashError(f"--dtype float32 is for the CPU recipe (--gpu cpu); a {spec.gpu} engine keeps its "
                          "unquantized tensors in 16 bits, use --dtype auto (the checkpoint's), bfloat16 or float16")


def expert_format(arch: ArchSpec, quant: str, dtype_name: str) -> str:
    """The format the engine's MoE expert weights are written in."""
    if quant != "none":
        return quant
    return arch.native_expert_format or {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype_name,
                                                                                                       "bf16")


def check_moe_backend(arch: ArchSpec, spec: BuildSpec, experts: str) -> None:
    if not arch.is_moe:
        return
    backend = moe_backend(spec.gpu, experts)
    if backend in EP_ONLY_MOE_BACKENDS and spec.tp // spec.ep != 1:
        raise DFlashError(
            f"{experts.upper()} experts on {spec.gpu} run on TensorRT-LLM's {backend} MoE backend, which splits "
            f"experts by expert parallelism only, but --tp {spec.tp} --ep {spec.ep} splits each expert "
            f"{spec.tp // spec.ep} ways; use --ep {spec.tp}, or --quant fp8 (CUTLASS takes TP and EP)")
