"""The memory plan for gpt-oss-120b, checked against a hand computation written out here.

gpt-oss-120b (public config.json): H=2880, 36 layers alternating sliding(128)/full attention,
64 heads x head_dim 64, 8 KV heads, 128 experts (top-4) of width 2880, vocab 201088, untied
lm_head, attention biases + sinks, expert biases. Mapping: tp=8, ep=8 (moe_tp=1), pp=1.
Drafter: none given, so the planner's stated estimate (5 Qwen3-style layers at target width).
The hand computations use recipe `full` (attention quantized too); gpt-oss's experts are fused,
so their FP32 weight_scale_2 / input_scale come once per fused tensor (gate_up_proj, down_proj)
per layer -- what ModelOpt's export writes (tests/test_build_gptoss.py checks plan against build).
"""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.archs import resolve_arch
from dflash_trt.engine.builder import prepare
from dflash_trt.engine.spec import resolve_spec

GIB = 1024**3


def _hand_common():
    """Per-rank pieces that do not depend on the weight format (bytes)."""
    H, L, V = 2880, 36, 201088
    q_width = 64 // 8 * 64  # 8 heads of 64 per rank = 512
    kv_width = 1 * 64  # 8 KV heads / tp 8 = 1 per rank
    attn_params = 2 * H * q_width + 2 * H * kv_width  # q,o + k,v = 3,317,760
    expert_params = 128 * 3 * H * 2880 / 8  # 398,131,200 (E/ep experts, unsplit since moe_tp = 1)
    per_layer_bf16 = (
        2 * H * 2  # two RMSNorms
        + (q_width + 2 * kv_width + H) * 2  # q/k/v/o biases
        + 8 * 2  # attention sinks, 8 heads per rank
        + (128 * H + 128) * 2  # router weight + bias (replicated)
        + 16 * (2 * 2880 + H) * 2  # 16 local experts: gate_up bias (5760) + down bias (2880)
    )
    unquantized = L * per_layer_bf16 + V * H * 2 + math.ceil(V / 8) * H * 2 + H * 2  # + embed, lm_head, final norm
    draft_layer = (2 * H * 64 * 64 + 2 * H * 8 * 64 + 2 * 64) + 3 * H * 2880 + 2 * H
    draft = (5 * draft_layer + 5 * H * H + 2 * H) * 2  # 5 layers + fc(5H -> H) + 2 norms, bf16
    return attn_params, expert_params, unquantized, draft


def _plan(**over):
    arch, _, _ = resolve_arch("gpt-oss-120b")
    spec = resolve_spec(None, {"target": "gpt-oss-120b", "tp": 8, "ep": 8, "kv_cache_quant": "fp8",
                               "max_draft_len": 15, "recipe": "full", **over})
    return arch, prepare(spec, need_checkpoints=False).plan


def test_gpt_oss_120b_on_8x_b300_nvfp4_matches_hand_computation():
    _, plan = _plan(gpu="b300", quant="nvfp4", max_batch_size=256, max_seq_len=16384)
    attn, experts, unq, draft = _hand_common()
    nvfp4 = 0.5 + 1 / 16  # E2M1 + one FP8 scale per 16 weights
    quantized = 36 * (attn * nvfp4 + 4 * 8 + experts * nvfp4 + 2 * 8)  # + FP32 per-tensor scales
    assert plan.target_quantized_bytes == pytest.approx(quantized, rel=1e-12)  # 8.129 GB
    assert plan.target_unquantized_bytes == pytest.approx(unq, rel=1e-12)  # 1.340 GB
    assert plan.draft_bytes == pytest.approx(draft, rel=1e-12)  # 0.597 GB
    # KV (FP8, 1 B): 18 full + 18 sliding layers x 1 KV head x 64 x K,V; drafter context K/V in bf16.
    target_tok = 2 * 36 * 1 * 64 * 1
    draft_tok = 2 * 5 * 8 * 64 * 2
    assert plan.kv_bytes_per_token == target_tok + draft_tok  # 14,848 B
    per_seq = 2 * 18 * 64 * 16384 + 2 * 18 * 64 * 128 + draft_tok * 16384  # sliding layers keep 128 tokens
    assert plan.kv_bytes_per_sequence == per_seq
    # reserve: 4 GiB runtime + 8192 tokens x (H + top-4 x 2 x 2880) x 2 B x 2 + FP32 logits of 256 x 16 rows.
    reserve = 4 * GIB + 8192 * (2880 + 4 * 2 * 2880) * 2 * 2 + 256 * 16 * math.ceil(201088 / 8) * 4
    assert plan.reserve_bytes == reserve
    budget = (288e9 - quantized - unq - draft - reserve) * 0.9
    assert plan.kv_budget_bytes == pytest.approx(budget, rel=1e-12)
    assert plan.sequences_fit == int(budget // per_seq) == 1191
    assert plan.fits and plan.verdict.startswith("fits")


def test_gpt_oss_120b_on_8x_h100_fp8_matches_hand_computation():
    _, plan = _plan(gpu="h100", quant="fp8", max_batch_size=64, max_seq_len=8192)
    attn, experts, unq, draft = _hand_common()
    quantized = 36 * (attn * 1.0 + 4 * 8 + experts * 1.0 + 2 * 8)  # FP8: 1 B + FP32 scales
    assert plan.target_quantized_bytes == pytest.approx(quantized, rel=1e-12)  # 14.45 GB
    assert plan.target_unquantized_bytes == pytest.approx(unq, rel=1e-12)
    per_seq = 2 * 18 * 64 * 8192 + 2 * 18 * 64 * 128 + 2 * 5 * 8 * 64 * 2 * 8192
    reserve = 4 * GIB + 8192 * (2880 + 4 * 2 * 2880) * 2 * 2 + 64 * 16 * math.ceil(201088 / 8) * 4
    budget = (80e9 - quantized - unq - draft - reserve) * 0.9
    assert plan.reserve_bytes == reserve
    assert plan.sequences_fit == int(budget // per_seq) == 509
    assert plan.fits


def test_nvfp4_halves_fp8_expert_bytes_roughly_and_quant_none_keeps_mxfp4():
    _, nv = _plan(gpu="b300", quant="nvfp4", recipe="auto")
    _, fp8 = _plan(gpu="b300", quant="fp8", recipe="auto")
    _, none = _plan(gpu="b300", quant="none", recipe="auto")
    _, experts_params, _, _ = _hand_common()
    assert nv.recipe == fp8.recipe == "mlp-only" and none.recipe == "none"
    assert (nv.expert_format, fp8.expert_format, none.expert_format) == ("nvfp4", "fp8", "mxfp4")
    assert nv.expert_bytes == pytest.approx(36 * (experts_params * (0.5 + 1 / 16) + 2 * 8), rel=1e-12)
    assert fp8.expert_bytes == pytest.approx(36 * (experts_params * 1.0 + 2 * 8), rel=1e-12)
    # The released checkpoint's experts are MXFP4 (0.5 + 1/32 B) and its attention bf16, as the
    # default (mlp-only) recipe keeps it for nvfp4 / fp8 too.
    attn_bf16 = (2 * 2880 * 512 + 2 * 2880 * 64) * 2
    assert none.expert_bytes == pytest.approx(36 * experts_params * (0.5 + 1 / 32), rel=1e-12)
    for plan in (nv, fp8, none):
        assert plan.target_quantized_bytes == pytest.approx(36 * attn_bf16 + plan.expert_bytes, rel=1e-12)
    # fp8 on gpt-oss doubles the expert bytes of the shipped MXFP4: plan says so
    assert any("1.9x the bytes of the shipped MXFP4" in n for n in fp8.notes)
    assert not any("shipped" in n for n in nv.notes + none.notes)


def test_plan_reports_does_not_fit():
    arch, _, _ = resolve_arch("gpt-oss-120b")
    spec = resolve_spec(None, {"target": "gpt-oss-120b", "gpu": "h100", "tp": 1, "quant": "fp8"})
    p = prepare(spec, need_checkpoints=False)
    assert not p.plan.fits and "DOES NOT FIT" in p.plan.verdict
    r = CliRunner().invoke(main, ["plan", "--target", "gpt-oss-120b", "--gpu", "h100", "--quant", "fp8"])
    assert r.exit_code == 3 and "DOES NOT FIT" in r.stderr


def test_plan_cli_prints_the_table_for_the_b300_recipe():
    r = CliRunner().invoke(main, ["plan", "--spec", "gpt-oss-120b-8xb300-nvfp4", "--target", "gpt-oss-120b", "--json"])
    assert r.exit_code == 0, r.stderr
    for row in ("target weights (linear layers)", "of which MoE experts (nvfp4)", "KV cache per token",
                "KV tokens that fit", "verdict", "drafter: replicated on every GPU (not sharded)", "in bf16"):
        assert row in r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["plan"]["tp"] == 8 and out["plan"]["ep"] == 8 and out["arch"]["num_experts"] == 128


def test_pipeline_parallel_plans_the_fullest_stage():
    arch, _, _ = resolve_arch("llama-3.1-8b")
    spec = resolve_spec(None, {"target": "llama-3.1-8b", "gpu": "h100", "pp": 3})
    plan = prepare(spec, need_checkpoints=False).plan
    assert plan.layers_per_rank == math.ceil(32 / 3) == 11
    # Llama: 8 KV heads x 128 x K,V x bf16 on 11 layers, + 5 drafter layers of context K/V.
    assert plan.kv_bytes_per_token == 2 * 11 * 8 * 128 * 2 + 2 * 5 * 8 * 128 * 2
