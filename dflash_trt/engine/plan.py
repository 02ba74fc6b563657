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


def _stage_layers(arch: ArchSpec, pp: int) -> list[list[int]]:
    per = math.ceil(arch.num_layers / pp)
    return [list(range(s * per, min((s + 1) * per, arch.num_layers))) for s in range(pp)]


def _linear(fmt: WeightFormat, params: float, tensors: int) -> float:
    return fmt.bytes_per_param * params + fmt.per_tensor_bytes * tensors


def _projections(fmt: WeightFormat, sizes: dict[str, float], tensors: int, keep_modules: tuple[str, ...]) -> float:
    """Bytes of one layer's projections (name -> params), those in keep_modules in bf16."""
    bf16 = WEIGHT_FORMATS["bf16"]
    return sum(_linear(bf16 if name in keep_modules else fmt, n, tensors) for name, n in sizes.items())


def _kept_on_fullest_stage(stages: list[list[int]], keep: tuple[int, ...]) -> int:
    fullest = max(stages, key=len)
    return sum(1 for i in fullest if i in set(keep))


def plan_memory(arch: ArchSpec, spec: BuildSpec, draft: DraftShape, max_draft_len: int, max_num_tokens: int,
                recipe: ResolvedRecipe | None = None) -> MemoryPlan:
    gpu = GPUS[spec.gpu]
    tp, pp, ep = spec.tp, spec.pp, spec.ep
    H, hd, V = arch.hidden_size, arch.head_dim, arch.vocab_size
    kvr = kv_heads_per_rank(arch.num_kv_heads, tp)
    q_width = arch.num_heads // tp * hd
    bf16 = WEIGHT_FORMATS["bf16"]
    quant_fmt = WEIGHT_FORMATS[QUANT_TO_FORMAT[spec.quant]]
    recipe_name = recipe.name if recipe is not None else "none"
    attn_fmt = quant_fmt if recipe_name == "full" else bf16
    experts = expert_format(arch, spec.quant, "bfloat16")
    expert_fmt = WEIGHT_FORMATS[experts] if experts in WEIGHT_FORMATS else bf16
    notes: list[str] = []

    stages = _stage_layers(arch, pp)
    L_r = max(len(s) for s in stages)
    kept = _kept_on_fullest_stage(stages, recipe.keep_layers if recipe is not None else ())
    L_q = L_r - kept  # layers quantized as the recipe says; `kept` layers are all bf16
    mods = recipe.keep_modules if recipe is not None else ()
    if mods:  # the plan's one-line recipe says what stays 16-bit
        recipe_name += f" ({'/'.join(mods)} bf16)"

    # -- target weights on the fullest stage ---------------------------------------------------
    attn_params = 2 * H * q_width + 2 * H * kvr * hd  # q, o, k, v
    attn_sizes = {"q_proj": H * q_width, "o_proj": H * q_width, "k_proj": H * kvr * hd, "v_proj": H * kvr * hd}
    quantized = L_q * _projections(attn_fmt, attn_sizes, 1, mods) + kept * _linear(bf16, attn_params, 4)
    unq = L_r * (2 * H) * BF16  # input/post-attention norms
    if arch.attention_bias:
        unq += L_r * (q_width + 2 * kvr * hd + H) * BF16
    if arch.model_type == "gpt_oss":
        unq += L_r * (arch.num_heads // tp) * BF16  # attention sinks, one per head
    if arch.is_moe:
        moe_tp = tp // ep
        E, Ie = arch.num_experts, arch.expert_intermediate_size
        expert_params = E * 3 * H * Ie / tp
        # gpt-oss fuses its experts: one gate_up_proj and one down_proj tensor per layer
        expert_tensors = 2 if arch.model_type == "gpt_oss" else E // ep * 3
        thirds = {p: expert_params / 3 for p in ("gate_proj", "up_proj", "down_proj")}
        expert_bytes = L_q * _projections(expert_fmt, thirds, expert_tensors / 3, mods)  # each third in its format
        expert_bytes += kept * _linear(bf16, expert_params, expert_tensors)  # exported dequantized
        quantized += expert_bytes
        unq += L_r * (E * H + E) * BF16  # router weight + bias, replicated
        if arch.model_type == "gpt_oss":  # expert biases: gate_up (2*I_e, split moe_tp) and down (H)
            unq += L_r * (E // ep) * (2 * Ie / moe_tp + H) * BF16
        widest = arch.experts_per_token * 2 * Ie // moe_tp
        if arch.native_expert_format and experts != arch.native_expert_format:
            shipped = WEIGHT_FORMATS[arch.native_expert_format]
            ratio = expert_fmt.bytes_per_param / shipped.bytes_per_param
            if ratio >= 1.5:  # fp8 (1.9x) or 16-bit experts; NVFP4 is within 6% of MXFP4
                notes.append(f"{experts.upper()} experts take {ratio:.1f}x the bytes of the shipped "
                             f"{arch.native_expert_format.upper()} ones ({expert_bytes / GB:,.2f} GB vs "
                             f"{L_r * _linear(shipped, expert_params, expert_tensors) / GB:,.2f} GB per GPU); "
                             "--quant none keeps them as shipped, --quant nvfp4 casts them losslessly")
    else:
        expert_bytes = 0.0
        mlp_params = 3 * H * arch.intermediate_size / tp
        mlp_sizes = {p: mlp_params / 3 for p in ("gate_proj", "up_proj", "down_proj")}
        quantized += L_q * _projections(quant_fmt, mlp_sizes, 1, mods) + kept * _linear(bf16, mlp_params, 3)
        widest = 2 * arch.intermediate_size // tp
    embed = V * H * BF16
    lm_head = 0.0 if (arch.tie_word_embeddings and pp == 1) else math.ceil(V / tp) * H * BF16
    unq += (embed + lm_head + H * BF16) if pp == 1 else max(embed, lm_head + H * BF16)

    draft_bytes = draft.num_params() * BF16

    # -- KV cache --------------------------------------------------------------------------------
    kvb = KV_BYTES[spec.kv_cache_quant]
    S = spec.max_seq_len
    window = arch.sliding_window
    best = (0.0, 0.0)
    for layers in stages:
        n_swa = sum(1 for i in layers if window and i < len(arch.layer_types) and arch.layer_types[i] == "sliding_attention")
        n_full = len(layers) - n_swa
        per_tok_full = 2 * n_full * kvr * hd * kvb
        per_tok_swa = 2 * n_swa * kvr * hd * kvb
        per_seq = per_tok_full * S + per_tok_swa * min(window or S, S)
        if per_seq > best[1]:
            best = (per_tok_full + per_tok_swa, per_seq)
    draft_kv_tok = 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * BF16
    kv_per_token = best[0] + draft_kv_tok
    kv_per_seq = best[1] + draft_kv_tok * S

    # -- reserve ---------------------------------------------------------------------------------
    act_width = H + max(q_width + 2 * kvr * hd, widest)
    activations = max_num_tokens * act_width * BF16 * 2
    logits = spec.max_batch_size * (max_draft_len + 1) * math.ceil(V / tp) * 4
    reserve = gpu.runtime_reserve_bytes + activations + logits

    weights = quantized + unq + draft_bytes
    budget: float | None = None
    toks: int | None = None
    seqs: int | None = None
    if gpu.hbm_bytes is None:
        verdict, fits = "n/a: reference runtime on the host (dequantized weights, no HBM budget)", True
    else:
        free = gpu.hbm_bytes - weights - reserve
        budget = max(0.0, free) * spec.free_gpu_memory_fraction
        seqs = int(budget // kv_per_seq) if kv_per_seq else 0
        toks = int(budget // (kv_per_seq / S)) if kv_per_seq else 0
        if free <= 0:
            verdict, fits = (f"DOES NOT FIT: weights + reserve = {(weights + reserve) / GB:.1f} GB > "
                             f"{gpu.hbm_bytes / GB:.0f} GB HBM; raise --tp/--pp or quantize"), False
        elif seqs < spec.max_batch_size:
            verdict, fits = (f"TIGHT: KV cache holds {seqs} sequences of {S} tokens < max_batch_size "
                             f"{spec.max_batch_size}; lower --max-seq-len/--max-batch-size or add GPUs"), True
        else:
            verdict, fits = (f"fits: KV cache holds {seqs} sequences of {S} tokens (>= max_batch_size "
                             f"{spec.max_batch_size})"), True
        if draft.estimated:
            notes.append(f"drafter size estimated: {draft.num_layers} Qwen3-style layers at the target's width (no "
                         "drafter dir)")
        if kvr * tp > arch.num_kv_heads:
            notes.append(f"{arch.num_kv_heads} KV heads replicated over {tp} TP ranks (1 per rank)")
    return MemoryPlan(
        gpu=spec.gpu, tp=tp, pp=pp, ep=ep, quant=spec.quant, kv_cache_quant=spec.kv_cache_quant,
        layers_per_rank=L_r, kv_heads_per_rank=kvr, target_quantized_bytes=quantized, target_unquantized_bytes=unq,
        draft_bytes=draft_bytes, kv_bytes_per_token=kv_per_token, kv_bytes_per_sequence=kv_per_seq,
        reserve_bytes=reserve, hbm_bytes=gpu.hbm_bytes, kv_budget_bytes=budget, kv_tokens_fit=toks,
        sequences_fit=seqs, verdict=verdict, fits=fits, draft_estimated=draft.estimated, notes=notes,
        recipe=recipe_name, expert_format=experts if arch.is_moe else None, expert_bytes=expert_bytes,
        draft_kv_bytes_per_token=draft_kv_tok)


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
