"""The lean forward (runtime/lean_forward.py) computes exactly what transformers' forward computes:
the same logits, features and KV-cache contents bit for bit, for Llama and Qwen3 targets, with and
without oneDNN-packed layers; and it declines (with the reason) where it would not."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.batched import batched_generate
from dflash_trt.runtime.batched_cache import BatchedKVCache, additive_mask
from dflash_trt.runtime.cpu_packing import pack_cpu_linears
from dflash_trt.runtime.generate import autoregressive_generate
from dflash_trt.runtime.target import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams


def _pass(adapter: TargetAdapter, lean: bool, rows: int, length: int, start: int, keep: int):
    """One masked pass over a fresh batched cache -> (logits, features, layer-0 keys)."""
    reason = adapter.lean_unsupported
    adapter.lean_unsupported = None if lean else "off for the comparison"
    try:
        cache = BatchedKVCache(adapter.num_layers, rows, 96)
        ids = torch.randint(0, adapter.vocab_size, (rows, length), generator=torch.Generator().manual_seed(rows * length))
        pos = torch.arange(length)[None].expand(rows, length) + torch.arange(rows)[:, None] + start
        width = 64
        cache.kv.prepare(slice(0, rows), pos, width)
        visible = torch.arange(width)[None, None, None, :] <= pos[:, None, :, None]
        with torch.inference_mode():
            logits, feats = adapter.forward(ids, pos, cache, (0, adapter.num_layers - 1), keep,
                                            additive_mask(visible, adapter.dtype))
        return logits, feats, cache.kv.keys[0][:rows, :, :width].clone()
    finally:
        adapter.lean_unsupported = reason


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("packed", [False, True])
def test_lean_pass_equals_transformers_bit_for_bit(arch, packed):
    model = tiny_target(arch)
    if packed:
        assert pack_cpu_linears(model) > 0
    adapter = TargetAdapter(model)
    assert adapter.lean_unsupported is None
    for rows, length, start, keep in ((1, 1, 5, 0), (1, 9, 0, 1), (3, 4, 7, 0), (2, 16, 2, 0)):
        lean = _pass(adapter, True, rows, length, start, keep)
        stock = _pass(adapter, False, rows, length, start, keep)
        for got, want in zip(lean, stock):
            assert torch.equal(got, want), (arch, packed, rows, length)
        assert lean[0].shape[1] == (keep or length)


def test_runtimes_on_the_lean_pass_keep_the_reference_tokens():
    """The batched runtime (lean pass) against plain decoding through transformers' own forward."""
    model = tiny_target("qwen3", seed=3)
    draft = random_draft(model.config, seed=3, block_size=8)
    prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8], [11, 3]]
    params = SamplingParams(max_tokens=20)
    want = [autoregressive_generate(model, p, params).output_ids for p in prompts]
    assert TargetAdapter(model).lean_unsupported is None
    assert [r.output_ids for r in batched_generate(draft, model, prompts, params)] == want
    assert [r.output_ids for r in batched_generate(None, model, prompts, params)] == want


def test_lean_pass_declines_what_it_does_not_compute():
    gpt_oss = TargetAdapter(tiny_target("gpt_oss"))
    assert "gpt_oss" in gpt_oss.lean_unsupported
    eager = tiny_target("llama")
    eager.set_attn_implementation("eager")
    assert "eager" in TargetAdapter(eager).lean_unsupported
