"""The step-cost model (dflash_trt/engine/step_cost.py), piece by piece.

No GPU runs here: these tests check the model's algebra against quantities computed another way
(the memory plan's per-GPU expert bytes, an exhaustive count of expert activations, the roofline
by hand), its two regimes (bandwidth-bound at small batches, compute-bound at large ones), the MoE
term and the TP terms. Whether its seconds match a GPU is a measurement (issue 44), made with
`predict_step_seconds` on a GPU machine.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from dflash_trt.engine.archs import resolve_arch
from dflash_trt.engine.hardware import GPUS
from dflash_trt.engine.plan import DraftShape, plan_memory
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.step_cost import (DEFAULT_ASSUMPTIONS, ModelDims, distinct_experts, draft_pass,
                                         predict_step_seconds, step_cost, target_pass)
from dflash_trt.errors import DFlashError

NO_KV = replace(DEFAULT_ASSUMPTIONS, context_tokens=0)


def _dense(**over) -> ModelDims:
    base = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
    return ModelDims(**{**base, **over})


def test_every_gpu_has_the_figures_the_model_reads():
    for name, gpu in GPUS.items():
        if gpu.emulated:
            continue
        assert gpu.bandwidth_tb_s and gpu.nvlink_gb_s and gpu.peak_tflops["bf16"] > 0, name
        assert gpu.peak_tflops["fp8"] == pytest.approx(2 * gpu.peak_tflops["bf16"], rel=0.01), name
        assert ("fp4" in gpu.peak_tflops) == gpu.fp4, name  # FP4 peak exactly where FP4 tensor cores are
    # Hopper has no FP4 tensor cores: MXFP4/NVFP4 weights multiply at the bf16 peak (dequantized)
    assert GPUS["h100"].peak_flops("mxfp4") == GPUS["h100"].peak_flops("bf16")
    assert GPUS["b300"].peak_flops("nvfp4") == GPUS["b300"].peak_flops("fp4") > GPUS["b300"].peak_flops("fp8")


@pytest.mark.parametrize("experts, top_k, tokens", [(4, 2, 2), (5, 2, 3), (6, 1, 4)])
def test_distinct_experts_is_the_exact_expectation_of_uniform_top_k_routing(experts, top_k, tokens):
    """Every way `tokens` tokens can each pick top_k of E experts, counted: the mean number of distinct
    experts equals E * (1 - (1 - k/E)^T)."""
    picks = list(itertools.combinations(range(experts), top_k))
    counts = [len(set().union(*choice)) for choice in itertools.product(picks, repeat=tokens)]
    assert distinct_experts(experts, top_k, tokens) == pytest.approx(sum(counts) / len(counts), rel=1e-12)


def test_one_token_activates_top_k_experts_and_a_wide_batch_all_of_them():
    assert distinct_experts(128, 4, 1) == pytest.approx(4)
    assert distinct_experts(128, 4, 4096) == pytest.approx(128, rel=1e-9)
    grows = [distinct_experts(128, 4, t) for t in (1, 2, 8, 64, 512)]
    assert grows == sorted(grows) and len(set(grows)) == len(grows)
    assert distinct_experts(128, 4, 0) == 0.0 and distinct_experts(0, 4, 10) == 0.0


def test_a_saturated_moe_batch_reads_every_expert_byte_the_memory_plan_holds():
    """gpt-oss-120b at tp 8 / ep 8 with its shipped MXFP4 experts: the bytes a batch adds as it
    activates every expert are the plan's per-GPU expert bytes (engine/plan.py, computed apart)."""
    arch = resolve_arch("gpt-oss-120b")[0]
    spec = resolve_spec(None, {"gpu": "b300", "tp": 8, "ep": 8})
    plan = plan_memory(arch, spec, DraftShape.estimate(arch, 5), 15, 8192)
    dims = ModelDims.from_arch(arch, "none", None, "none", expert_format=plan.expert_format)
    one = target_pass(GPUS["b300"], dims, 8, 8, 1, 1, NO_KV).bytes
    saturated = target_pass(GPUS["b300"], dims, 8, 8, 4096, 1, NO_KV).bytes
    # one token already reads top_k of the E experts: the rest is (1 - top_k/E) of all of them
    assert saturated - one == pytest.approx(plan.expert_bytes * (1 - 4 / 128), rel=0.01)


def test_a_small_batch_is_bound_by_bandwidth_and_a_wide_one_by_compute():
    gpu = GPUS["h100"]
    dims = _dense()
    small = target_pass(gpu, dims, 1, 1, 1, 1)
    wide = target_pass(gpu, dims, 1, 1, 512, 16)
    assert small.bound(gpu, DEFAULT_ASSUMPTIONS) == "memory" and wide.bound(gpu, DEFAULT_ASSUMPTIONS) == "compute"
    a = DEFAULT_ASSUMPTIONS
    # by hand: the seconds are the roofline's max plus the launch floor (tp 1: no all-reduce)
    for cost in (small, wide):
        assert cost.allreduce_s == 0.0
        assert cost.seconds(gpu, a) == pytest.approx(max(cost.memory_s(gpu, a), cost.compute_s(gpu, a))
                                                     + a.fixed_pass_s + dims.layers * a.per_layer_s)
    assert small.memory_s(gpu, a) == pytest.approx(small.bytes / (3.35e12 * a.bandwidth_efficiency))
    # bandwidth-bound: verifying 16 tokens a row instead of 1 barely costs more (weights are read once)
    sixteen = target_pass(gpu, dims, 1, 1, 1, 16)
    assert sixteen.seconds(gpu, a) < 1.02 * small.seconds(gpu, a)
    # compute-bound: the FLOPs, and the time above the fixed terms, grow with the tokens
    wider = target_pass(gpu, dims, 1, 1, 1024, 16)
    assert sum(wider.flops.values()) == pytest.approx(2 * sum(wide.flops.values()), rel=0.01)
    assert wider.compute_s(gpu, a) == pytest.approx(2 * wide.compute_s(gpu, a), rel=0.01)


def test_quantized_weights_read_fewer_bytes_and_multiply_at_their_own_peak():
    gpu = GPUS["b300"]
    bf16, nvfp4 = _dense(), _dense(mlp_format="nvfp4")
    kept = _dense(mlp_format="nvfp4", mlp_bf16_share=1 / 3)  # down_proj kept in bf16 (the nvfp4 recipe)
    bytes_ = [target_pass(gpu, d, 1, 1, 1, 1, NO_KV).bytes for d in (bf16, kept, nvfp4)]
    assert bytes_ == sorted(bytes_, reverse=True)
    mlp = 32 * 3 * 4096 * 14336
    assert bytes_[0] - bytes_[2] == pytest.approx(mlp * (2 - 0.5625), rel=1e-9)
    wide = target_pass(gpu, nvfp4, 1, 1, 512, 16)
    assert set(wide.flops) == {"bf16", "nvfp4"}  # attention and lm_head in bf16, the MLP in FP4


def test_tensor_parallel_splits_the_bytes_and_adds_an_all_reduce_per_layer_over_nvlink():
    gpu = GPUS["h100"]
    dims = _dense()
    one, eight = target_pass(gpu, dims, 1, 1, 4, 4, NO_KV), target_pass(gpu, dims, 8, 1, 4, 4, NO_KV)
    assert eight.bytes == pytest.approx(one.bytes / 8, rel=0.01)  # KV heads 8/8, everything else split
    assert sum(eight.flops.values()) == pytest.approx(sum(one.flops.values()) / 8, rel=0.01)
    tokens, a = 16, DEFAULT_ASSUMPTIONS
    per_allreduce = a.allreduce_latency_s + 2 * 7 / 8 * tokens * 4096 * 2 / (900e9 / 2)
    assert eight.allreduce_s == pytest.approx(2 * 32 * per_allreduce)
    assert one.allreduce_s == 0.0
    # the all-reduce grows with the tokens a step moves
    assert target_pass(gpu, dims, 8, 1, 64, 4, NO_KV).allreduce_s > eight.allreduce_s


def test_sliding_layers_read_at_most_their_window_of_kv():
    gpu = GPUS["h100"]
    full = _dense(layers=4)
    sliding = _dense(layers=4, sliding_window=128, sliding_layers=2)
    long_ctx = replace(DEFAULT_ASSUMPTIONS, context_tokens=8192)
    kv_full = target_pass(gpu, full, 1, 1, 1, 1, long_ctx).bytes - target_pass(gpu, full, 1, 1, 1, 1, NO_KV).bytes
    kv_sliding = (target_pass(gpu, sliding, 1, 1, 1, 1, long_ctx).bytes
                  - target_pass(gpu, sliding, 1, 1, 1, 1, NO_KV).bytes)
    per_layer = kv_full / 4
    assert kv_sliding == pytest.approx(2 * per_layer + 2 * per_layer * 128 / 8192)


def test_the_drafter_pass_reads_its_weights_and_the_targets_lm_head():
    gpu = GPUS["h100"]
    shape = DraftShape(num_layers=2, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=14336, num_context_layers=5)
    draft = ModelDims.from_draft(shape, vocab=128256, block_size=16)
    cost = draft_pass(gpu, draft, 128256, 1, 1, 7, NO_KV)
    weights = shape.num_params() - 2 * 4096 - shape.num_layers * (2 * 4096 + 2 * 128)  # no norms
    assert cost.bytes == pytest.approx((weights + 128256 * 4096) * 2, rel=1e-3)


def test_predict_step_seconds_is_verify_plus_draft_and_k0_is_plain():
    arch = resolve_arch("qwen3-8b")[0]
    target = ModelDims.from_arch(arch, "fp8", "mlp-only", "fp8")
    draft = ModelDims.from_draft(DraftShape.estimate(arch, 5), arch.vocab_size, 16)
    plain = step_cost("h100", target, 1, 1, 4, 0, draft)
    assert plain.draft is None
    assert predict_step_seconds("h100", target, 1, 1, 4, 0, draft) == plain.seconds
    step = step_cost("h100", target, 1, 1, 4, 7, draft)
    gpu, a = GPUS["h100"], DEFAULT_ASSUMPTIONS
    assert step.seconds == pytest.approx(step.verify.seconds(gpu, a) + step.draft.seconds(gpu, a))
    assert step.seconds > plain.seconds
    assert math.isclose(predict_step_seconds("h100", target, 1, 1, 4, 7, draft), step.seconds)


@pytest.mark.parametrize("gpu, batch, k, match", [("cpu", 1, 1, "no bandwidth/compute figures"),
                                                  ("h100", 0, 1, "batch >= 1"), ("h100", 1, -1, "k >= 0")])
def test_questions_the_model_cannot_answer_are_one_line_errors(gpu, batch, k, match):
    with pytest.raises(DFlashError, match=match) as e:
        step_cost(gpu, _dense(), 1, 1, batch, k)
    assert "\n" not in str(e.value)
