"""GPUs and weight formats as data: every capability check in `build`/`plan` reads these tables.

Numbers are per GPU, from NVIDIA's product pages (see shared/design/upstream.md). HBM is the
marketed capacity in decimal GB; the driver reports a few percent less, which the planner's
runtime reserve absorbs.

Peak dense tensor-core throughput (no 2:4 sparsity) and NVLink bandwidth feed the step-cost model
(engine/step_cost.py) that derives the draft-length schedule. Sources, per GPU, dense:
- H100 SXM / H200 SXM (the same GH100 compute): BF16 989.4, FP8 1978.9 TFLOPS, no FP4; NVLink 4
  900 GB/s (glennklockwood.com/garden/processors/h100, "Matrix" column from NVIDIA's H100
  datasheet, where 1979 / 3958 are the sparse figures; H200 "the same as H100 ... with HBM3e").
- B200 (HGX B200): BF16 2250, FP8 4500, FP4 9000 TFLOPS (the HGX B200 table: 36 / 72 / 144 PF
  for 8 GPUs with sparsity, FP4 72 PF without); NVLink 5 1.8 TB/s (fibermall.com/blog/?p=17161).
- B300 (HGX B300, Blackwell Ultra): BF16 2250, FP8 4500, FP4 13000 TFLOPS ("dense FP4 performance
  is up (13 PF on B300 vs. 9.0 PF on B200)", glennklockwood.com/garden/processors/B300); NVLink 5
  1.8 TB/s (acecloud.ai/blog/nvidia-hgx-b300: "NVLink 5, 1.8 TB/s bidirectional per GPU").
NVLink figures are NVIDIA's bidirectional totals; one direction carries half (step_cost uses that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GpuName = Literal["b300", "b200", "h200", "h100", "cpu"]
QuantName = Literal["none", "fp8", "nvfp4"]
KvQuantName = Literal["none", "fp8"]

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    name: str
    family: str  # "blackwell" | "hopper" | "cpu"
    hbm_bytes: float | None  # None: host memory, not planned (the reference runtime)
    bandwidth_tb_s: float | None
    fp8: bool  # native FP8 tensor cores (weights and KV cache)
    fp4: bool  # native NVFP4 tensor cores
    emulated: bool  # True: the reference runtime dequantizes, nothing runs natively
    moe_backend: str | None  # TensorRT-LLM moe_config.backend for this family
    dflash_attention_backend: str  # DFlashDecodingConfig.attention_backend preferred on this family
    runtime_reserve_bytes: float  # CUDA context, NCCL/cuBLAS workspaces, CUDA graphs
    # Peak dense tensor-core TFLOPS by operand format ("bf16", "fp8", "fp4"; absent: not native).
    peak_tflops: dict[str, float] = field(default_factory=dict, hash=False)
    nvlink_gb_s: float | None = None  # NVLink bandwidth per GPU, both directions together (GB/s)

    def peak_flops(self, operand: str) -> float:
        """FLOP/s of a GEMM whose weights are in `operand` (bf16 | fp8 | fp4 | a WEIGHT_FORMATS name):
        the format's own tensor cores where the GPU has them, else the bf16 ones (weights
        dequantized on the fly, as the MXFP4 experts run on Hopper)."""
        kind = {"nvfp4": "fp4", "mxfp4": "fp4"}.get(operand, operand)
        return 1e12 * self.peak_tflops.get(kind, self.peak_tflops["bf16"])


# MoE backends (TensorRT-LLM PyTorch backend): Blackwell uses TRTLLM; on Hopper CUTLASS does
# both TP and EP for the expert weights (TRITON supports EP only, so it is not a safe default).
# DFlash attention, the family's preferred backend (engine/release_fields.py falls back to VANILLA
# where the release or the drafter does not allow it): TRTLLM on Blackwell SM100/SM103, FA4 on
# Hopper SM90, VANILLA (FlashAttention) on the CPU reference.
GPUS: dict[str, Gpu] = {
    "b300": Gpu("b300", "blackwell", 288 * GB, 8.0, True, True, False, "TRTLLM", "TRTLLM", 4 * GIB,
                {"bf16": 2250.0, "fp8": 4500.0, "fp4": 13000.0}, 1800.0),
    "b200": Gpu("b200", "blackwell", 180 * GB, 8.0, True, True, False, "TRTLLM", "TRTLLM", 4 * GIB,
                {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}, 1800.0),
    "h200": Gpu("h200", "hopper", 141 * GB, 4.8, True, False, False, "CUTLASS", "FA4", 4 * GIB,
                {"bf16": 989.4, "fp8": 1978.9}, 900.0),
    "h100": Gpu("h100", "hopper", 80 * GB, 3.35, True, False, False, "CUTLASS", "FA4", 4 * GIB,
                {"bf16": 989.4, "fp8": 1978.9}, 900.0),
    # The CPU "GPU" is the reference runtime: every format is dequantized to float in torch.
    "cpu": Gpu("cpu", "cpu", None, None, True, True, True, None, "VANILLA", 0.0),
}


@dataclass(frozen=True)
class WeightFormat:
    """Bytes of one quantized weight matrix: `bytes_per_param * numel + per_tensor_bytes`."""

    name: str
    bytes_per_param: float
    per_tensor_bytes: int
    needs: str | None  # Gpu capability flag it needs natively ("fp8" / "fp4"), None for bf16
    hf_quant_algo: str | None  # hf_quant_config.json quantization.quant_algo


# - bf16: 2 B/param.
# - FP8 (E4M3): 1 B/param + per-tensor FP32 weight_scale and input_scale (8 B).
# - NVFP4: E2M1 = 0.5 B/param + one FP8-E4M3 scale per 16 elements (1/16 B/param) + per-tensor
#   FP32 weight_scale_2 and input_scale (8 B).
# - MXFP4 (gpt-oss's released experts): 0.5 B/param + one E8M0 scale per 32 elements.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 2.0, 0, None, None),
    "fp8": WeightFormat("fp8", 1.0, 8, "fp8", "FP8"),
    "nvfp4": WeightFormat("nvfp4", 0.5 + 1 / 16, 8, "fp4", "NVFP4"),
    "mxfp4": WeightFormat("mxfp4", 0.5 + 1 / 32, 0, None, None),
}

# MoE backend by (GPU family, expert weight format), where it differs from the family's default:
# TensorRT-LLM's gpt-oss deployment guide serves the released MXFP4 experts with TRTLLM on
# Blackwell and TRITON on Hopper (CUTLASS does not take MXFP4 weights there). Upstream's
# TRITON backend shards experts by expert parallelism only (no moe_tp).
MOE_BACKENDS: dict[tuple[str, str], str] = {("blackwell", "mxfp4"): "TRTLLM", ("hopper", "mxfp4"): "TRITON"}
EP_ONLY_MOE_BACKENDS = frozenset({"TRITON"})


def moe_backend(gpu: str, expert_format: str) -> str | None:
    """moe_config.backend for experts in `expert_format` on `gpu` (None: the reference runtime)."""
    g = GPUS[gpu]
    return MOE_BACKENDS.get((g.family, expert_format), g.moe_backend)


# --quant -> format of the quantized linear layers ("none" keeps the checkpoint's own format).
QUANT_TO_FORMAT: dict[str, str] = {"none": "bf16", "fp8": "fp8", "nvfp4": "nvfp4"}
KV_BYTES: dict[str, float] = {"none": 2.0, "fp8": 1.0}  # KV-cache element size (bf16 or FP8)
