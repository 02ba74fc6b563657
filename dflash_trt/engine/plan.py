"""Memory plan per GPU: what one rank holds, and how much KV cache fits in what is left.

Byte formulas (per rank; H = hidden, hd = head_dim, L_r = layers on the fullest pipeline stage):
- quantized linear layers: WeightFormat.bytes_per_param * params + per_tensor_bytes per layer
  (bf16 2 B; FP8 1 B + FP32 weight/input scales; NVFP4 0.5 B + 1 FP8 scale / 16 elements + FP32
  weight_scale_2/input_scale; MXFP4 0.5 B + 1 E8M0 scale / 32 elements).
- attention q/o: H * (heads/tp * hd) each; k/v: H * (kv_heads_per_rank * hd) each, where
  kv_heads_per_rank = kv/tp, or 1 when KV heads are replicated (tp % kv == 0).
- dense MLP: 3 * H * I / tp. MoE experts: each rank holds E/ep experts split moe_tp = tp/ep ways,
  i.e. E * 3 * H * I_e / tp parameters, whatever the ep/moe_tp split.
- unquantized (bf16, as upstream recipes keep them): embedding V*H (replicated, first stage),
  lm_head V*H/tp (vocab-parallel, last stage; shared with the embedding when tied and pp == 1),
  MoE router E*H + E (replicated), norms 2H per layer + H, biases and attention sinks.
- which layers are quantized follows the build's recipe (dflash_trt.engine.recipes): `full`
  quantizes attention too; `mlp-only` / `experts-only` keep attention in bf16; `keep_layers` keep
  whole layers in bf16; `keep_modules` keep that projection (e.g. down_proj, a third of the MLP /
  expert parameters) in bf16 in every layer. Expert weights are in the format `build` writes: the checkpoint's own
  (MXFP4 for gpt-oss as released) with --quant none, else the --quant format. gpt-oss's experts
  are fused (gate_up_proj, down_proj per layer), so their FP32 per-tensor scales count twice per
  layer, not per expert.
- drafter: bf16, replicated on every rank (it is small; TensorRT-LLM runs it in the same executor).
- KV bytes per token = 2 (K and V) * L_r * kv_heads_per_rank * hd * kv_bytes; sliding-window
  layers hold at most `sliding_window` tokens per sequence. The DFlash drafter also keeps its
  context K/V per token: 2 * draft_layers * draft_kv_heads * draft_hd * 2 B.
- reserve: runtime (CUDA context, NCCL/cuBLAS workspaces, CUDA graphs; per-GPU table) +
  activations max_num_tokens * (H + widest per-rank projection) * 2 B * 2 live buffers +
  logits max_batch_size * (max_draft_len + 1) * ceil(V/tp) * 4 B (FP32).
- KV budget = (HBM - weights - drafter - reserve) * free_gpu_memory_fraction, the share
  TensorRT-LLM's kv_cache_config gives the cache of what is free after loading.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dflash_trt.engine.archs import ArchSpec
from dflash_trt.engine.checks import expert_format, kv_heads_per_rank
from dflash_trt.engine.hardware import GB, GPUS, KV_BYTES, QUANT_TO_FORMAT, WEIGHT_FORMATS, WeightFormat
from dflash_trt.engine.recipes import ResolvedRecipe
from dflash_trt.engine.spec import BuildSpec

BF16 = 2.0


@dataclass(frozen=True)
class DraftShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_context_layers: int  # len(target_layer_ids): the fc input is num_context_layers * H
    estimated: bool = False

    @staticmethod
    def from_config(cfg: dict[str, Any]) -> "DraftShape":
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        ids = (cfg.get("dflash_config") or {}).get("target_layer_ids") or [0] * int(cfg.get("num_hidden_layers", 1))
        return DraftShape(int(cfg["num_hidden_layers"]), hidden, heads, int(cfg.get("num_key_value_heads", heads)),
                          int(cfg.get("head_dim") or hidden // heads), int(cfg["intermediate_size"]), len(ids))

    @staticmethod
    def estimate(arch: ArchSpec, num_layers: int) -> "DraftShape":
        """z-lab's recipe: Qwen3-style layers at the target's width, one context layer per draft layer."""
        return DraftShape(num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                          arch.intermediate_size, num_layers, estimated=True)

    def num_params(self) -> int:
        H, hd = self.hidden_size, self.head_dim
        attn = 2 * H * self.num_heads * hd + 2 * H * self.num_kv_heads * hd + 2 * hd  # q,o,k,v + q/k norms
        layer = attn + 3 * H * self.intermediate_size + 2 * H
        return self.num_layers * layer + self.num_context_layers * H * H + 2 * H  # + fc, hidden_norm, norm


@dataclass(kw_only=True)  # twenty-odd fields: built by name only
class MemoryPlan:
    gpu: str
    tp: int
    pp: int
    ep: int
    quant: str
    kv_cache_quant: str
    layers_per_rank: int
    kv_heads_per_rank: int
    target_quantized_bytes: float
    target_unquantized_bytes: float
    draft_bytes: float
    kv_bytes_per_token: float  # all attention layers on the rank, target + drafter context
    kv_bytes_per_sequence: float  # at max_seq_len, sliding-window layers capped
    reserve_bytes: float
    hbm_bytes: float | None
    kv_budget_bytes: float | None
    kv_tokens_fit: int | None
    sequences_fit: int | None
    verdict: str
    fits: bool
    draft_estimated: bool
    notes: list[str]
    recipe: str = "none"
    expert_format: str | None = None
    expert_bytes: float = 0.0  # MoE expert weights per GPU (in target_quantized_bytes)
    draft_kv_bytes_per_token: float = 0.0

    @property
    def drafter_line(self) -> str:
        """How the drafter is counted, in one line (plan output and manifest)."""
        return (f"drafter: replicated on every GPU (not sharded), {self.draft_bytes / GB:,.3f} GB of bf16 weights; its "
                f"context K/V {self.draft_kv_bytes_per_token / 1024:,.1f} KiB/token in bf16 (the model dtype, not "
                "--kv-cache-quant), counted in the KV budget")

    @property
    def target_bytes(self) -> float:
        return self.target_quantized_bytes + self.target_unquantized_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_bytes"] = self.target_bytes
        d["drafter"] = self.drafter_line
        return d


# ---------------------------------------------------------------------------------------------
# The pieces: what the fullest rank holds, its weights, its KV cache, its reserve, the verdict
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """The rank every figure of the plan is for: one TP rank of the fullest pipeline stage."""

    stages: tuple[tuple[int, ...], ...]  # the target's layer ids on each pipeline stage
    layers: int  # layers on the fullest stage
    kept_layers: int  # of those, the recipe's keep_layers: whole layers left in bf16
    kv_heads: int  # KV heads per rank (kv/tp, or 1 when they are replicated: tp % kv == 0)
    q_width: int  # query (and output) projection width per rank: heads/tp * head_dim
    keep_modules: tuple[str, ...]  # projections the recipe leaves in bf16 in every layer

    @property
    def quantized_layers(self) -> int:
        """Layers whose projections follow the recipe's formats (the others are kept whole)."""
        return self.layers - self.kept_layers


def rank_layout(arch: ArchSpec, spec: BuildSpec, recipe: ResolvedRecipe | None = None) -> RankLayout:
    """Layers split into ceil(L/pp)-layer pipeline stages; the fullest stage sets the per-rank figures."""
    per = math.ceil(arch.num_layers / spec.pp)
    stages = tuple(tuple(range(s * per, min((s + 1) * per, arch.num_layers))) for s in range(spec.pp))
    fullest = max(stages, key=len)
    keep = set(recipe.keep_layers if recipe is not None else ())
    return RankLayout(stages=stages, layers=len(fullest), kept_layers=sum(1 for i in fullest if i in keep),
                      kv_heads=kv_heads_per_rank(arch.num_kv_heads, spec.tp),
                      q_width=arch.num_heads // spec.tp * arch.head_dim,
                      keep_modules=tuple(recipe.keep_modules) if recipe is not None else ())


def _linear(fmt: WeightFormat, params: float, tensors: float) -> float:
    return fmt.bytes_per_param * params + fmt.per_tensor_bytes * tensors


def _projections(fmt: WeightFormat, sizes: dict[str, float], tensors: float, keep_modules: tuple[str, ...]) -> float:
    """Bytes of one layer's projections (name -> params), those in keep_modules in bf16."""
    bf16 = WEIGHT_FORMATS["bf16"]
    return sum(_linear(bf16 if name in keep_modules else fmt, n, tensors) for name, n in sizes.items())


@dataclass(frozen=True)
class TargetWeights:
    """The target's bytes on the rank."""

    quantized: float  # linear layers in the recipe's formats, scales included (MoE experts too)
    unquantized: float  # bf16: embedding, lm_head, norms, router, biases, attention sinks
    experts: float  # MoE expert weights (part of `quantized`); 0 for a dense target
    notes: tuple[str, ...] = ()


def target_weights(arch: ArchSpec, spec: BuildSpec, rank: RankLayout, recipe_name: str = "none") -> TargetWeights:
    """Linear layers as the recipe quantizes them (attention only under `full`; kept layers and
    keep_modules in bf16), MoE experts in the format `build` writes, the rest in bf16."""
    bf16 = WEIGHT_FORMATS["bf16"]
    quant_fmt = WEIGHT_FORMATS[QUANT_TO_FORMAT[spec.quant]]
    attn_fmt = quant_fmt if recipe_name == "full" else bf16
    hidden, head_dim, tp = arch.hidden_size, arch.head_dim, spec.tp
    layers, kept, mods = rank.layers, rank.kept_layers, rank.keep_modules
    kv_width = rank.kv_heads * head_dim
    attn_sizes = {"q_proj": hidden * rank.q_width, "o_proj": hidden * rank.q_width,
                  "k_proj": hidden * kv_width, "v_proj": hidden * kv_width}
    attn_params = 2 * hidden * rank.q_width + 2 * hidden * kv_width
    quantized = (rank.quantized_layers * _projections(attn_fmt, attn_sizes, 1, mods)
                 + kept * _linear(bf16, attn_params, 4))
    unquantized = layers * (2 * hidden) * BF16  # input/post-attention norms
    if arch.attention_bias:
        unquantized += layers * (rank.q_width + 2 * kv_width + hidden) * BF16
    if arch.model_type == "gpt_oss":
        unquantized += layers * (arch.num_heads // tp) * BF16  # attention sinks, one per head
    notes: list[str] = []
    experts = 0.0
    if arch.is_moe:
        experts, router, expert_biases, note = _moe_experts(arch, spec, rank)
        quantized += experts
        unquantized += router
        unquantized += expert_biases
        notes += [note] if note else []
    else:
        mlp_params = 3 * hidden * arch.intermediate_size / tp
        mlp_sizes = {p: mlp_params / 3 for p in ("gate_proj", "up_proj", "down_proj")}
        quantized += rank.quantized_layers * _projections(quant_fmt, mlp_sizes, 1, mods) + kept * _linear(bf16, mlp_params, 3)
    embed = arch.vocab_size * hidden * BF16
    lm_head = 0.0 if (arch.tie_word_embeddings and spec.pp == 1) else math.ceil(arch.vocab_size / tp) * hidden * BF16
    # one stage holds the embedding and the other the lm_head (+ final norm) when pp > 1
    unquantized += (embed + lm_head + hidden * BF16) if spec.pp == 1 else max(embed, lm_head + hidden * BF16)
    return TargetWeights(quantized, unquantized, experts, tuple(notes))


def _moe_experts(arch: ArchSpec, spec: BuildSpec, rank: RankLayout) -> tuple[float, float, float, str | None]:
    """(expert bytes, router bytes, expert-bias bytes, a note when the written experts outweigh the shipped ones).

    Each rank holds E/ep experts split moe_tp = tp/ep ways: E * 3 * H * I_e / tp parameters whatever
    the split. gpt-oss fuses its experts (one gate_up_proj and one down_proj tensor per layer), so
    its per-tensor scales count twice per layer, not per expert."""
    bf16 = WEIGHT_FORMATS["bf16"]
    experts_fmt_name = expert_format(arch, spec.quant, "bfloat16")
    experts_fmt = WEIGHT_FORMATS[experts_fmt_name] if experts_fmt_name in WEIGHT_FORMATS else bf16
    hidden, num_experts, width = arch.hidden_size, arch.num_experts, arch.expert_intermediate_size
    moe_tp = spec.tp // spec.ep
    params = num_experts * 3 * hidden * width / spec.tp
    tensors = 2 if arch.model_type == "gpt_oss" else num_experts // spec.ep * 3
    thirds = {p: params / 3 for p in ("gate_proj", "up_proj", "down_proj")}
    experts = rank.quantized_layers * _projections(experts_fmt, thirds, tensors / 3, rank.keep_modules)
    experts += rank.kept_layers * _linear(bf16, params, tensors)  # exported dequantized
    router = rank.layers * (num_experts * hidden + num_experts) * BF16  # router weight + bias, replicated
    biases = 0.0
    if arch.model_type == "gpt_oss":  # expert biases: gate_up (2*I_e, split moe_tp) and down (H)
        biases = rank.layers * (num_experts // spec.ep) * (2 * width / moe_tp + hidden) * BF16
    note = None
    if arch.native_expert_format and experts_fmt_name != arch.native_expert_format:
        shipped = WEIGHT_FORMATS[arch.native_expert_format]
        ratio = experts_fmt.bytes_per_param / shipped.bytes_per_param
        if ratio >= 1.5:  # fp8 (1.9x) or 16-bit experts; NVFP4 is within 6% of MXFP4
            note = (f"{experts_fmt_name.upper()} experts take {ratio:.1f}x the bytes of the shipped "
                    f"{arch.native_expert_format.upper()} ones ({experts / GB:,.2f} GB vs "
                    f"{rank.layers * _linear(shipped, params, tensors) / GB:,.2f} GB per GPU); "
                    "--quant none keeps them as shipped, --quant nvfp4 casts them losslessly")
    return experts, router, biases, note


@dataclass(frozen=True)
class KvCache:
    """KV-cache bytes on the rank: the target's layers (at the stage whose sequences cost most;
    sliding-window layers hold at most `sliding_window` tokens) plus the drafter's context K/V."""

    target_per_token: float
    target_per_sequence: float  # at max_seq_len
    draft_per_token: float  # bf16 (the model dtype, not --kv-cache-quant)
    max_seq_len: int

    @property
    def per_token(self) -> float:
        return self.target_per_token + self.draft_per_token

    @property
    def per_sequence(self) -> float:
        return self.target_per_sequence + self.draft_per_token * self.max_seq_len


def kv_cache(arch: ArchSpec, spec: BuildSpec, rank: RankLayout, draft: DraftShape) -> KvCache:
    """2 (K and V) * layers * KV heads per rank * head_dim * the KV element size, per token."""
    element = KV_BYTES[spec.kv_cache_quant]
    seq_len, window = spec.max_seq_len, arch.sliding_window
    per_token, per_sequence = 0.0, 0.0
    for layers in rank.stages:
        sliding = sum(1 for i in layers
                      if window and i < len(arch.layer_types) and arch.layer_types[i] == "sliding_attention")
        full_tok = 2 * (len(layers) - sliding) * rank.kv_heads * arch.head_dim * element
        sliding_tok = 2 * sliding * rank.kv_heads * arch.head_dim * element
        seq = full_tok * seq_len + sliding_tok * min(window or seq_len, seq_len)
        if seq > per_sequence:
            per_token, per_sequence = full_tok + sliding_tok, seq
    draft_tok = 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * BF16
    return KvCache(per_token, per_sequence, draft_tok, seq_len)


@dataclass(frozen=True)
class Reserve:
    """GPU memory set aside before the KV budget: the runtime's own, live activations, FP32 logits."""

    runtime: float  # CUDA context, NCCL/cuBLAS workspaces, CUDA graphs (the GPU table's figure)
    activations: float  # max_num_tokens * (H + widest per-rank projection) * 2 B * 2 live buffers
    logits: float  # max_batch_size * (max_draft_len + 1) * ceil(V/tp) * 4 B

    @property
    def total(self) -> float:
        return self.runtime + self.activations + self.logits


def reserve(arch: ArchSpec, spec: BuildSpec, rank: RankLayout, max_draft_len: int, max_num_tokens: int) -> Reserve:
    """The rank's reserve (see :class:`Reserve`); the widest projection is the attention's q/k/v or
    the MLP's gate+up (a token's routed experts' for MoE), per rank."""
    if arch.is_moe:
        widest = arch.experts_per_token * 2 * arch.expert_intermediate_size // (spec.tp // spec.ep)
    else:
        widest = 2 * arch.intermediate_size // spec.tp
    width = arch.hidden_size + max(rank.q_width + 2 * rank.kv_heads * arch.head_dim, widest)
    return Reserve(runtime=GPUS[spec.gpu].runtime_reserve_bytes, activations=max_num_tokens * width * BF16 * 2,
                   logits=spec.max_batch_size * (max_draft_len + 1) * math.ceil(arch.vocab_size / spec.tp) * 4)


@dataclass(frozen=True)
class Verdict:
    """How much KV cache fits beside the weights and the reserve, and what that means."""

    text: str
    fits: bool
    budget: float | None = None  # bytes the KV cache gets; None: the reference runtime (no HBM)
    tokens: int | None = None
    sequences: int | None = None


def verdict(spec: BuildSpec, weights: float, reserve_bytes: float, kv: KvCache) -> Verdict:
    """KV budget = (HBM - weights - reserve) * free_gpu_memory_fraction; it must hold max_batch_size
    sequences of max_seq_len for a comfortable fit, and something for a tight one."""
    hbm = GPUS[spec.gpu].hbm_bytes
    if hbm is None:
        return Verdict("n/a: reference runtime on the host (dequantized weights, no HBM budget)", True)
    free = hbm - weights - reserve_bytes
    budget = max(0.0, free) * spec.free_gpu_memory_fraction
    per_seq, seq_len, batch = kv.per_sequence, spec.max_seq_len, spec.max_batch_size
    seqs = int(budget // per_seq) if per_seq else 0
    toks = int(budget // (per_seq / seq_len)) if per_seq else 0
    if free <= 0:
        return Verdict(f"DOES NOT FIT: weights + reserve = {(weights + reserve_bytes) / GB:.1f} GB > {hbm / GB:.0f} GB "
                       "HBM; raise --tp/--pp or quantize", False, budget, toks, seqs)
    if seqs < batch:
        return Verdict(f"TIGHT: KV cache holds {seqs} sequences of {seq_len} tokens < max_batch_size {batch}; lower "
                       "--max-seq-len/--max-batch-size or add GPUs", True, budget, toks, seqs)
    return Verdict(f"fits: KV cache holds {seqs} sequences of {seq_len} tokens (>= max_batch_size {batch})", True,
                   budget, toks, seqs)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def plan_memory(arch: ArchSpec, spec: BuildSpec, draft: DraftShape, max_draft_len: int, max_num_tokens: int,
                recipe: ResolvedRecipe | None = None) -> MemoryPlan:
    """The per-GPU plan: the pieces above, put together (the module docstring has the formulas)."""
    rank = rank_layout(arch, spec, recipe)
    recipe_name = recipe.name if recipe is not None else "none"
    weights = target_weights(arch, spec, rank, recipe_name)
    draft_bytes = draft.num_params() * BF16
    kv = kv_cache(arch, spec, rank, draft)
    held = reserve(arch, spec, rank, max_draft_len, max_num_tokens)
    decided = verdict(spec, weights.quantized + weights.unquantized + draft_bytes, held.total, kv)
    notes = list(weights.notes)
    if GPUS[spec.gpu].hbm_bytes is not None:
        if draft.estimated:
            notes.append(f"drafter size estimated: {draft.num_layers} Qwen3-style layers at the target's width (no "
                         "drafter dir)")
        if rank.kv_heads * spec.tp > arch.num_kv_heads:
            notes.append(f"{arch.num_kv_heads} KV heads replicated over {spec.tp} TP ranks (1 per rank)")
    if rank.keep_modules:  # the plan's one-line recipe says what stays 16-bit
        recipe_name += f" ({'/'.join(rank.keep_modules)} bf16)"
    return MemoryPlan(
        gpu=spec.gpu, tp=spec.tp, pp=spec.pp, ep=spec.ep, quant=spec.quant, kv_cache_quant=spec.kv_cache_quant,
        layers_per_rank=rank.layers, kv_heads_per_rank=rank.kv_heads, target_quantized_bytes=weights.quantized,
        target_unquantized_bytes=weights.unquantized, draft_bytes=draft_bytes, kv_bytes_per_token=kv.per_token,
        kv_bytes_per_sequence=kv.per_sequence, reserve_bytes=held.total, hbm_bytes=GPUS[spec.gpu].hbm_bytes,
        kv_budget_bytes=decided.budget, kv_tokens_fit=decided.tokens, sequences_fit=decided.sequences,
        verdict=decided.text, fits=decided.fits, draft_estimated=draft.estimated, notes=notes, recipe=recipe_name,
        expert_format=expert_format(arch, spec.quant, "bfloat16") if arch.is_moe else None,
        expert_bytes=weights.experts, draft_kv_bytes_per_token=kv.draft_per_token)


def render_plan(plan: MemoryPlan, arch: ArchSpec, console: Any = None) -> None:
    """Print the plan as a rich table (stderr by default, so stdout stays machine-readable)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    t = Table(title=f"Memory plan per GPU: {arch.name} on {plan.tp * plan.pp}x {plan.gpu} "
                    f"(tp={plan.tp} pp={plan.pp} ep={plan.ep}, weights {plan.quant}, KV {plan.kv_cache_quant})")
    t.add_column("item")
    t.add_column("per GPU", justify="right")
    t.add_column("how")

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x / GB:,.2f} GB"

    t.add_row("target weights (linear layers)", gb(plan.target_quantized_bytes),
              f"{plan.layers_per_rank} layers/rank, {plan.quant} recipe {plan.recipe}, scales included")
    if plan.expert_format:
        t.add_row(f"  of which MoE experts ({plan.expert_format})", gb(plan.expert_bytes), "as build writes them")
    t.add_row("target weights (bf16: embed, lm_head, router, norms)", gb(plan.target_unquantized_bytes), "kept unquantized")
    t.add_row("drafter (bf16, replicated)", gb(plan.draft_bytes), "estimated" if plan.draft_estimated else "from its config")
    t.add_row("activation + workspace reserve", gb(plan.reserve_bytes), "runtime + activations + FP32 logits")
    t.add_row("KV cache per token", f"{plan.kv_bytes_per_token / 1024:,.1f} KiB",
              f"{plan.kv_heads_per_rank} KV heads/rank, target + drafter context")
    t.add_row("KV cache per sequence", gb(plan.kv_bytes_per_sequence), "at max_seq_len, sliding layers capped")
    t.add_row("HBM", gb(plan.hbm_bytes), "")
    t.add_row("KV budget", gb(plan.kv_budget_bytes), "free x free_gpu_memory_fraction")
    t.add_row("KV tokens that fit", "-" if plan.kv_tokens_fit is None else f"{plan.kv_tokens_fit:,}", "")
    t.add_row("verdict", "OK" if plan.fits else "NO", plan.verdict)
    console.print(t)
    console.print(f"  {plan.drafter_line}")
    for n in plan.notes:
        console.print(f"  note: {n}")
