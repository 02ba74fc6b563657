"""The memory plan's named pieces (engine/plan.py: rank_layout, target_weights, kv_cache, reserve,
verdict), each on a toy architecture whose bytes are worked out by hand in the comments.

The toy target: 4 layers, hidden 64, 8 query heads and 2 KV heads of 8, MLP 128, vocabulary 1000;
built for 2 H100s in tensor parallel x 2 pipeline stages. tests/test_build_plan.py checks the
assembled plan on the real architectures."""

from __future__ import annotations

import pytest

from dflash_trt.engine.archs import ArchSpec
from dflash_trt.engine.hardware import GB, GIB
from dflash_trt.engine.plan import (
    DraftShape,
    KvCache,
    kv_cache,
    plan_memory,
    rank_layout,
    reserve,
    target_weights,
    verdict,
)
from dflash_trt.engine.recipes import resolve_recipe
from dflash_trt.engine.spec import BuildSpec

TOY = ArchSpec(name="toy", architecture="LlamaForCausalLM", model_type="llama", num_layers=4, hidden_size=64,
               num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=128, vocab_size=1000,
               max_position_embeddings=512)
DRAFT = DraftShape(num_layers=1, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=128,
                   num_context_layers=1)


def _spec(**kw) -> BuildSpec:
    return BuildSpec(**{"gpu": "h100", "tp": 2, "pp": 2, "quant": "fp8", "max_seq_len": 100, "max_batch_size": 2,
                        **kw})


def _recipe(spec: BuildSpec, keep_layers=None):
    return resolve_recipe(spec.quant, spec.recipe, keep_layers, is_moe=False, native_experts=None,
                          num_layers=TOY.num_layers, keep_modules=spec.keep_modules)


def test_rank_layout_is_the_fullest_stage_of_one_tp_rank():
    spec = _spec()
    rank = rank_layout(TOY, spec, _recipe(spec, keep_layers=[1, 2]))
    assert rank.stages == ((0, 1), (2, 3))  # ceil(4 / 2) layers a stage
    assert rank.layers == 2 and rank.kept_layers == 1 and rank.quantized_layers == 1  # layer 1 of stage (0, 1)
    assert rank.kv_heads == 1 and rank.q_width == 32  # 2 KV heads / tp 2; 8 heads / 2 * 8
    assert rank_layout(TOY, _spec(tp=4)).kv_heads == 1  # 2 KV heads over 4 ranks: replicated, one each
    assert rank_layout(TOY, _spec(pp=3)).stages == ((0, 1), (2, 3), ())


def test_target_weights_follow_the_recipe_formats():
    spec = _spec()
    rank = rank_layout(TOY, spec)
    w = target_weights(TOY, spec, rank, "mlp-only")
    # attention stays bf16: q,o 64 x 32 and k,v 64 x 8 -> 5120 params x 2 B = 10240 B a layer;
    # the MLP in FP8: 3 x 64 x 128 / tp 2 = 12288 params x 1 B + 3 x 8 B of scales = 12312 B a layer
    assert w.quantized == 2 * 10240 + 2 * 12312
    # norms 2 layers x 2 x 64 x 2 B = 512; the first stage holds the embedding (1000 x 64 x 2 B),
    # larger than the last stage's lm_head (500 x 64 x 2 B) + final norm (128 B)
    assert w.unquantized == 512 + 128000
    assert w.experts == 0 and w.notes == ()
    full = target_weights(TOY, spec, rank, "full")  # attention in FP8 too: 5120 x 1 B + 4 x 8 B
    assert full.quantized == 2 * (5120 + 32) + 2 * 12312
    one_stage = target_weights(TOY, _spec(pp=1), rank_layout(TOY, _spec(pp=1)), "mlp-only")
    assert one_stage.unquantized == 4 * 256 + 128000 + 64000 + 128  # embedding + lm_head + norm together


def test_kept_layers_are_counted_whole_in_bf16():
    spec = _spec()
    rank = rank_layout(TOY, spec, _recipe(spec, keep_layers=[0]))
    w = target_weights(TOY, spec, rank, "mlp-only")
    assert w.quantized == (10240 + 12312) + (10240 + 12288 * 2)  # layer 0 exported in 16 bits


def test_kv_cache_counts_target_and_drafter_context():
    spec = _spec(kv_cache_quant="none")
    kv = kv_cache(TOY, spec, rank_layout(TOY, spec), DRAFT)
    assert kv.target_per_token == 2 * 2 * 1 * 8 * 2  # K and V x 2 layers x 1 head x 8 x 2 B = 64
    assert kv.draft_per_token == 2 * 1 * 2 * 8 * 2  # the drafter's context K/V, bf16: 64
    assert kv.per_token == 128 and kv.per_sequence == 64 * 100 + 64 * 100
    assert kv_cache(TOY, _spec(kv_cache_quant="fp8"), rank_layout(TOY, spec), DRAFT).target_per_token == 32


def test_sliding_window_layers_hold_at_most_their_window():
    arch = ArchSpec(**{**TOY.to_dict(), "sliding_window": 10,
                       "layer_types": ("sliding_attention", "full_attention") * 2})
    spec = _spec(kv_cache_quant="none", pp=1)
    kv = kv_cache(arch, spec, rank_layout(arch, spec), DRAFT)
    per_layer = 2 * 1 * 8 * 2  # one layer's K and V, per token
    assert kv.target_per_token == 4 * per_layer
    assert kv.target_per_sequence == 2 * per_layer * 100 + 2 * per_layer * 10


def test_reserve_is_runtime_activations_and_logits():
    spec = _spec()
    held = reserve(TOY, spec, rank_layout(TOY, spec), max_draft_len=3, max_num_tokens=10)
    assert held.runtime == 4 * GIB
    # the widest per-rank projection: gate+up 2 x 128 / 2 = 128 > q,k,v 32 + 2 x 8 = 48
    assert held.activations == 10 * (64 + 128) * 2 * 2
    assert held.logits == 2 * (3 + 1) * 500 * 4  # batch x (K + 1) x vocab / tp, FP32
    assert held.total == held.runtime + held.activations + held.logits


def test_verdict_reads_the_kv_budget():
    kv = KvCache(target_per_token=1e6, target_per_sequence=1e8, draft_per_token=0.0, max_seq_len=100)
    ok = verdict(_spec(), weights=10 * GB, reserve_bytes=4 * GIB, kv=kv)
    free = 80 * GB - 10 * GB - 4 * GIB
    assert ok.fits and ok.text.startswith("fits:")
    assert ok.budget == pytest.approx(free * 0.9) and ok.sequences == int(ok.budget // 1e8)
    assert ok.tokens == int(ok.budget // 1e6)
    exactly = verdict(_spec(max_batch_size=ok.sequences), 10 * GB, 4 * GIB, kv)  # as many as fit: still fits
    assert exactly.text.startswith("fits:")
    tight = verdict(_spec(max_batch_size=ok.sequences + 1), 10 * GB, 4 * GIB, kv)
    assert tight.fits and tight.text.startswith("TIGHT") and "--max-batch-size" in tight.text
    over = verdict(_spec(), 79 * GB, 4 * GIB, kv)
    assert not over.fits and over.text.startswith("DOES NOT FIT") and over.budget == 0
    host = verdict(_spec(gpu="cpu"), 79 * GB, 0.0, kv)
    assert host.fits and host.budget is None and host.text.startswith("n/a")


def test_plan_memory_is_the_pieces_put_together():
    spec = _spec()
    recipe = _recipe(spec)
    plan = plan_memory(TOY, spec, DRAFT, 3, 10, recipe)
    rank = rank_layout(TOY, spec, recipe)
    w = target_weights(TOY, spec, rank, recipe.name)
    kv = kv_cache(TOY, spec, rank, DRAFT)
    held = reserve(TOY, spec, rank, 3, 10)
    decided = verdict(spec, w.quantized + w.unquantized + plan.draft_bytes, held.total, kv)
    assert (plan.target_quantized_bytes, plan.target_unquantized_bytes) == (w.quantized, w.unquantized)
    assert (plan.kv_bytes_per_token, plan.kv_bytes_per_sequence) == (kv.per_token, kv.per_sequence)
    assert plan.reserve_bytes == held.total and plan.layers_per_rank == 2 and plan.kv_heads_per_rank == 1
    assert (plan.verdict, plan.fits, plan.sequences_fit) == (decided.text, decided.fits, decided.sequences)
    assert plan.draft_bytes == DRAFT.num_params() * 2
