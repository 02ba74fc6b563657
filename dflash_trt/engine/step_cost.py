"""The step-cost model: seconds of one decoding step on one GPU of the engine, from the hardware tables.

A DFlash step verifies b rows x (k+1) tokens in one target pass and, when k > 0, runs the drafter
once; a plain step is the target pass with k = 0 and no drafter. Each pass is a roofline:

    pass seconds = max(bytes / bandwidth, sum over operand formats of flops / peak) + all-reduce + launch

with every figure PER GPU of a TP x EP mapping:

- bytes: the weights the pass reads (q/k/v/o: H x heads_per_rank x head_dim; dense MLP 3HI / tp; the
  lm_head V x H / tp, vocab-parallel), plus each row's KV cache at `context_tokens` (sliding layers
  capped at their window), in the formats `build` writes (hardware.WEIGHT_FORMATS);
- MoE: a batch of T tokens, each routed to top_k of E experts, activates on average
  E * (1 - (1 - top_k/E)^T) DISTINCT experts, and only those are read: one row reads top_k experts,
  a wide batch reads all E. Each rank holds E/ep experts split moe_tp = tp/ep ways, so the rank
  reads activated * 3 * H * I_e / tp parameters (the expectation; the busiest rank reads more);
- flops: 2 x tokens x the parameters each token multiplies (top_k experts for MoE), plus attention
  scores (4 x queries x context x heads_per_rank x head_dim per layer), each GEMM at the peak of its
  weight format (FP4 where the GPU has it for NVFP4/MXFP4, FP8, else BF16: Hopper dequantizes MXFP4);
- all-reduce: tp > 1 sums the attention and the MLP outputs of every layer over NVLink, a ring's
  2 (tp-1)/tp x T x H x 2 bytes per GPU in one direction (half the bidirectional NVLink figure)
  plus a latency per all-reduce;
- launch: a fixed cost per pass and per layer (kernels, scheduling, sampling), what keeps a tiny
  model's step from costing nothing.

The drafter (plan.DraftShape, bf16) runs sharded like the target: TensorRT-LLM builds the draft
layers with the engine's own model config and mapping (DFlashForCausalLM) and all-gathers the
TP-sharded draft logits (shared/design/upstream-2026-08.md C); the memory plan still counts it
whole on every GPU, the safe side for memory. It reads its weights, its context K/V and the
target's lm_head (V x H / tp) for its k draft logits, runs the full block of B query positions
(DFlash drafts the whole trained block in one pass), and projects the (at most k+1) tokens the
previous step committed into its context.

`ep` does not change the expectation: E/ep experts split tp/ep ways read the same bytes per rank;
only which rank is busiest changes, which an expectation does not see.

The efficiencies and launch costs are assumptions (`CostAssumptions`), not measurements: the model
ranks draft lengths against each other and against plain decoding on one GPU, where most of them
cancel. `predict_step_seconds` is the entry point a measurement script compares against (issue 44:
the ratio of measured to predicted step costs on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_trt.engine.checks import kv_heads_per_rank
from dflash_trt.engine.hardware import GPUS, KV_BYTES, QUANT_TO_FORMAT, WEIGHT_FORMATS, Gpu
from dflash_trt.errors import DFlashError

BF16 = 2.0


@dataclass(frozen=True)
class CostAssumptions:
    """What the tables do not say. Defaults are round figures for CUDA-graph decoding (TensorRT-LLM's
    one-model path); a measurement on a GPU replaces them."""

    context_tokens: int = 1024  # KV tokens each row attends to (prompt + answer so far)
    bandwidth_efficiency: float = 0.8  # achieved / marketed HBM bandwidth
    compute_efficiency: float = 0.6  # achieved / peak dense tensor-core FLOP/s
    fixed_pass_s: float = 100e-6  # per target pass: scheduling, sampling, host sync
    per_layer_s: float = 15e-6  # per decoder layer (target or drafter): the kernels' floor
    allreduce_latency_s: float = 8e-6  # per all-reduce (NVLink one-shot / two-shot)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


DEFAULT_ASSUMPTIONS = CostAssumptions()


@dataclass(frozen=True)
class ModelDims:
    """A transformer as the cost model sees it: shapes and the formats its weights are stored in.

    A target (`from_arch`) or a DFlash drafter (`from_draft`); whole-model figures, the mapping
    divides them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (unused for MoE)
    vocab: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sliding_window: int | None = None
    sliding_layers: int = 0
    attention_format: str = "bf16"  # q/k/v/o weights (a WEIGHT_FORMATS key)
    mlp_format: str = "bf16"  # dense MLP or MoE experts
    mlp_bf16_share: float = 0.0  # share of MLP/expert parameters kept in bf16 (keep_modules: down_proj = 1/3)
    kv_bytes: float = BF16  # bytes per KV-cache element
    context_layers: int = 0  # a drafter's fc reads context_layers x H features per context token
    block_size: int = 0  # a drafter's query block B (0: a target)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_arch(cls, arch: Any, quant: str = "none", recipe: str | None = None, kv_cache_quant: str = "none",
                  keep_modules: tuple[str, ...] = (), expert_format: str | None = None) -> "ModelDims":
        """A target (engine.archs.ArchSpec) as `build` writes it: the MLP/experts in the --quant
        format (MoE experts in `expert_format`, e.g. gpt-oss's shipped MXFP4 with --quant none),
        attention quantized only by the `full` recipe, the KV cache in --kv-cache-quant."""
        quant_fmt = QUANT_TO_FORMAT[quant]
        mlp_fmt = (expert_format or quant_fmt) if arch.is_moe else quant_fmt
        if mlp_fmt not in WEIGHT_FORMATS:  # a 16-bit checkpoint dtype ("bfloat16", "float16")
            mlp_fmt = "bf16"
        kept = sum(1 for m in ("gate_proj", "up_proj", "down_proj") if m in keep_modules) / 3
        return cls(layers=arch.num_layers, hidden=arch.hidden_size, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, intermediate=arch.intermediate_size, vocab=arch.vocab_size,
                   num_experts=arch.num_experts, experts_per_token=arch.experts_per_token,
                   expert_intermediate=arch.expert_intermediate_size, sliding_window=arch.sliding_window,
                   sliding_layers=arch.num_sliding_layers,
                   attention_format=quant_fmt if recipe == "full" else "bf16", mlp_format=mlp_fmt,
                   mlp_bf16_share=kept if mlp_fmt != "bf16" else 0.0, kv_bytes=KV_BYTES[kv_cache_quant])

    @classmethod
    def from_draft(cls, shape: Any, vocab: int, block_size: int) -> "ModelDims":
        """A DFlash drafter (engine.plan.DraftShape): bf16, no lm_head of its own (the target's)."""
        return cls(layers=shape.num_layers, hidden=shape.hidden_size, heads=shape.num_heads,
                   kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, intermediate=shape.intermediate_size,
                   vocab=vocab, context_layers=shape.num_context_layers, block_size=block_size)


def distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts a batch of `tokens` activates when each token picks `top_k` of
    `num_experts` (uniform routing): E * (1 - (1 - top_k/E)^tokens). 1 token: top_k; many: E."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass
class PassCost:
    """One forward pass on one GPU: bytes read, FLOPs by weight format, and the fixed terms."""

    bytes: float = 0.0
    flops: dict[str, float] = field(default_factory=dict)  # operand format -> FLOPs
    allreduce_s: float = 0.0
    launch_s: float = 0.0

    def add_flops(self, fmt: str, n: float) -> None:
        self.flops[fmt] = self.flops.get(fmt, 0.0) + n

    def memory_s(self, gpu: Gpu, a: CostAssumptions) -> float:
        return self.bytes / (gpu.bandwidth_tb_s * 1e12 * a.bandwidth_efficiency)

    def compute_s(self, gpu: Gpu, a: CostAssumptions) -> float:
        return sum(n / (gpu.peak_flops(fmt) * a.compute_efficiency) for fmt, n in self.flops.items())

    def seconds(self, gpu: Gpu, a: CostAssumptions) -> float:
        return max(self.memory_s(gpu, a), self.compute_s(gpu, a)) + self.allreduce_s + self.launch_s

    def bound(self, gpu: Gpu, a: CostAssumptions) -> str:
        return "compute" if self.compute_s(gpu, a) > self.memory_s(gpu, a) else "memory"


def _fmt_bytes(fmt: str) -> float:
    return WEIGHT_FORMATS[fmt].bytes_per_param


def _mlp_bytes(dims: ModelDims, params: float) -> float:
    """Bytes of `params` MLP/expert parameters, the kept share in bf16."""
    share = dims.mlp_bf16_share
    return params * ((1 - share) * _fmt_bytes(dims.mlp_format) + share * BF16)


def _allreduce_s(gpu: Gpu, tp: int, tokens: float, hidden: int, a: CostAssumptions) -> float:
    """One ring all-reduce of [tokens, hidden] bf16 activations over tp GPUs."""
    if tp <= 1:
        return 0.0
    if gpu.nvlink_gb_s is None:
        raise DFlashError(f"{gpu.name} has no NVLink figure in engine/hardware.py; the step-cost model needs one for "
                          f"tp={tp}")
    one_way = gpu.nvlink_gb_s * 1e9 / 2
    return a.allreduce_latency_s + 2 * (tp - 1) / tp * tokens * hidden * BF16 / one_way


def target_pass(gpu: Gpu, dims: ModelDims, tp: int, ep: int, rows: int, tokens_per_row: int,
                a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> PassCost:
    """The target over `rows` x `tokens_per_row` tokens (k+1 for a DFlash verify, 1 for plain), per GPU."""
    T = rows * tokens_per_row
    H, hd = dims.hidden, dims.head_dim
    heads_r, kv_r = dims.heads // tp, kv_heads_per_rank(dims.kv_heads, tp)
    attn_params = 2 * H * heads_r * hd + 2 * H * kv_r * hd  # q, o, k, v on this rank
    cost = PassCost()
    cost.bytes += dims.layers * attn_params * _fmt_bytes(dims.attention_format)
    cost.add_flops(dims.attention_format, 2 * T * dims.layers * attn_params)
    # Each row reads its KV once per layer (FlashAttention-style), sliding layers up to the window.
    ctx = a.context_tokens
    window_ctx = min(ctx, dims.sliding_window) if dims.sliding_window else ctx
    full_layers = dims.layers - dims.sliding_layers
    kv_per_token = 2 * kv_r * hd * dims.kv_bytes
    cost.bytes += rows * kv_per_token * (full_layers * ctx + dims.sliding_layers * window_ctx)
    cost.add_flops("bf16", 4 * T * heads_r * hd * (full_layers * ctx + dims.sliding_layers * window_ctx))
    if dims.is_moe:
        expert_params = 3 * H * dims.expert_intermediate
        active = distinct_experts(dims.num_experts, dims.experts_per_token, T)
        cost.bytes += dims.layers * _mlp_bytes(dims, active * expert_params / tp)
        cost.add_flops(dims.mlp_format, 2 * T * dims.layers * dims.experts_per_token * expert_params / tp)
        router = H * dims.num_experts  # replicated on every rank
        cost.bytes += dims.layers * router * BF16
        cost.add_flops("bf16", 2 * T * dims.layers * router)
    else:
        mlp_params = 3 * H * dims.intermediate / tp
        cost.bytes += dims.layers * _mlp_bytes(dims, mlp_params)
        cost.add_flops(dims.mlp_format, 2 * T * dims.layers * mlp_params)
    lm_head = dims.vocab * H / tp  # vocab-parallel, bf16, every token's logits (verification reads them all)
    cost.bytes += lm_head * BF16
    cost.add_flops("bf16", 2 * T * lm_head)
    cost.allreduce_s = 2 * dims.layers * _allreduce_s(gpu, tp, T, H, a)  # after attention and after the MLP
    cost.launch_s = a.fixed_pass_s + dims.layers * a.per_layer_s
    return cost


def draft_pass(gpu: Gpu, draft: ModelDims, target_vocab: int, tp: int, rows: int, k: int,
               a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> PassCost:
    """The DFlash drafter for `rows` rows drafting k tokens each, per GPU (sharded over tp)."""
    H, hd = draft.hidden, draft.head_dim
    queries = rows * max(draft.block_size, k + 1)  # the full trained block B per row
    committed = rows * (k + 1)  # the previous step's tokens entering the context (at most k+1 a row)
    heads_r, kv_r = draft.heads / tp, kv_heads_per_rank(draft.kv_heads, tp)
    q_params = 2 * H * heads_r * hd  # q, o
    kv_params = 2 * H * kv_r * hd  # k, v: the block's and the new context's
    mlp_params = 3 * H * draft.intermediate / tp
    fc_params = draft.context_layers * H * H / tp
    cost = PassCost()
    cost.bytes += (draft.layers * (q_params + kv_params + mlp_params) + fc_params) * BF16
    cost.add_flops("bf16", 2 * queries * draft.layers * (q_params + kv_params + mlp_params)
                   + 2 * committed * (draft.layers * kv_params + fc_params))
    ctx = a.context_tokens
    cost.bytes += rows * draft.layers * 2 * kv_r * hd * BF16 * ctx  # its context K/V, bf16
    cost.add_flops("bf16", 4 * queries * heads_r * hd * draft.layers * (ctx + draft.block_size))
    lm_head = target_vocab * H / tp  # the target's lm_head, for the k draft positions
    cost.bytes += lm_head * BF16
    cost.add_flops("bf16", 2 * rows * k * lm_head)
    cost.allreduce_s = 2 * draft.layers * _allreduce_s(gpu, tp, queries, H, a)
    cost.launch_s = draft.layers * a.per_layer_s
    return cost


@dataclass
class StepCost:
    """One DFlash step (k > 0: verify + drafter) or plain step (k = 0) on one GPU."""

    batch: int
    k: int
    verify: PassCost
    draft: PassCost | None
    seconds: float
    bound: str  # what bounds the target pass: "memory" | "compute"


def step_cost(gpu: str | Gpu, target: ModelDims, tp: int, ep: int, batch: int, k: int,
              draft: ModelDims | None = None, assumptions: CostAssumptions | None = None) -> StepCost:
    """The step of `batch` rows drafting k tokens each (see the module docstring)."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    if g.bandwidth_tb_s is None or not g.peak_tflops:
        raise DFlashError(f"--gpu {g.name} has no bandwidth/compute figures: the step-cost model is for the GPUs in "
                          "engine/hardware.py (b300, b200, h200, h100)")
    if batch < 1 or k < 0:
        raise DFlashError(f"step cost needs batch >= 1 and k >= 0, got batch={batch} k={k}")
    a = assumptions or DEFAULT_ASSUMPTIONS
    verify = target_pass(g, target, tp, ep, batch, k + 1, a)
    drafting = draft_pass(g, draft, target.vocab, tp, batch, k, a) if (k > 0 and draft is not None) else None
    seconds = verify.seconds(g, a) + (drafting.seconds(g, a) if drafting else 0.0)
    return StepCost(batch, k, verify, drafting, seconds, verify.bound(g, a))


def predict_step_seconds(gpu: str | Gpu, target: ModelDims, tp: int, ep: int, batch: int, k: int,
                         draft: ModelDims | None = None, assumptions: CostAssumptions | None = None) -> float:
    """Predicted seconds of one step on one GPU: `batch` rows, k drafts each (k = 0: plain decoding).

    The function a measurement script calls: build `target` with ModelDims.from_arch (e.g. from
    engine.archs.resolve_arch("gpt-oss-120b")[0]) and `draft` with ModelDims.from_draft, time the
    same step on the GPU, and report measured / predicted."""
    return step_cost(gpu, target, tp, ep, batch, k, draft, assumptions).seconds


