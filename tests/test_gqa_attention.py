"""Grouped-query attention against the cache as it is (dflash_trt/runtime/targets/gqa_attention.py):
the same attention as expanding K/V per query head, in the drafter and in a transformers target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.runtime.targets.gqa_attention import ATTN_IMPLEMENTATION, grouped_attention, use_grouped_attention
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import tiny_target


def _expanded(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask, scale=scale)


@pytest.mark.parametrize("b,s,n,heads,kv", [(1, 1, 9, 4, 2), (3, 5, 12, 6, 2), (2, 4, 7, 4, 4), (4, 1, 20, 8, 1)])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "row-broadcast", "none"])
def test_grouped_attention_equals_expanded_kv(b, s, n, heads, kv, mask_kind):
    g = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, heads, s, 16, generator=g)
    k, v = torch.randn(b, kv, n, 16, generator=g), torch.randn(b, kv, n, 16, generator=g)
    # per-row, per-query visibility (what the batched runtime passes: rows at different lengths)
    visible = torch.rand(b, 1, s, n, generator=g) > 0.3
    visible[..., 0] = True
    mask = {"bool": visible, "additive": torch.zeros(b, 1, s, n).masked_fill(~visible, float("-inf")),
            "row-broadcast": visible[:, :, :1], "none": None}[mask_kind]
    out = grouped_attention(q, k, v, mask, scale=0.3)
    assert out.shape == (b, heads, s, 16)
    torch.testing.assert_close(out, _expanded(q, k, v, mask, scale=0.3), rtol=1e-5, atol=1e-6)


def test_target_adapter_switches_sdpa_models_and_logits_stay_the_same(monkeypatch):
    """A 4D-masked forward (the batched runtime's kind) runs the grouped form in every layer and
    gives the logits of transformers' SDPA."""
    import dflash_trt.runtime.targets.gqa_attention as gqa

    calls = []
    real = gqa.grouped_attention
    monkeypatch.setattr(gqa, "grouped_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_target("llama", seed=2, num_layers=2)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)[None].expand(2, -1)
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None].expand(2, 1, 6, 6).clone()
    mask[1, :, :, 0] = False  # row 1 ignores its first position (left padding)
    mask[1, :, 0, 0] = True
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=pos, attention_mask=add).logits
        TargetAdapter(model)
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        after = model(input_ids=ids, position_ids=pos, attention_mask=add).logits
        assert len(calls) == 2  # one per layer
        causal = model(input_ids=ids).logits  # no mask: transformers' own SDPA path
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal[0], before[0], rtol=1e-5, atol=1e-5)


def test_other_attention_implementations_are_left_alone():
    model = tiny_target("llama", seed=2, num_layers=2)
    model.set_attn_implementation("eager")
    assert use_grouped_attention(model) is False and model.config._attn_implementation == "eager"
