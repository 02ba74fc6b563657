"""The lean forward (runtime/targets/lean_forward.py) computes exactly what transformers' forward computes:
the same logits, features and KV-cache contents bit for bit, for Llama and Qwen3 targets, with and
without packed layers; and it declines (with the reason) where it would not.

Two references, both transformers' own modeling code and never the lean pass (each leg counts the
lean pass's calls):
- the adapted model's forward (``model(...)``: its decoder layers, its attention interface, the
  grouped SDPA the adapter installs) over the same batched cache and mask: bit for bit, at rows of
  different positions and a mask wider than the sequence, as the batched runtime passes them;
- a model no adapter touched (transformers' own SDPA attention, its DynamicCache, its causal mask),
  decoding the same tokens: bit for bit wherever the two attend alike. They do not bit for bit in
  a one-token pass: there the grouped SDPA puts a KV group's query heads into one [rep, d] query
  block where transformers' SDPA sees [1, d] per head, and PyTorch's CPU attention sums a single
  query in another order (~2e-7 relative); the drafter's last layer met the same (docs/runtime.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dflash_trt.runtime.batched.runtime import batched_generate
from dflash_trt.runtime.batched.slot_caches import BatchedKVCache, additive_mask
from dflash_trt.runtime.cpu.packing import pack_cpu_linears
from dflash_trt.runtime.reference.generate import autoregressive_generate
from dflash_trt.runtime.batched.policy import FixedPolicy
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams

from tests.test_zlab_oracle import rig


class _LeanCalls:
    """Counts the lean pass's calls (a forward hook on the model's LeanForward module)."""

    def __init__(self, adapter: TargetAdapter) -> None:
        assert adapter.lean is not None, adapter.lean_unsupported
        self.n = 0
        self.handle = adapter.lean.register_forward_hook(self._count)

    def _count(self, *_args) -> None:
        self.n += 1


def _transformers_forward(model, ids, pos, cache, capture, keep, mask):
    """transformers' forward of `model` itself (no adapter in the call) -> (logits, features)."""
    layers = model.model.layers
    captured = {}
    hooks = [layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in capture]
    try:
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                    logits_to_keep=keep)
    finally:
        for h in hooks:
            h.remove()
    return out.logits, torch.cat([captured[i] for i in capture], dim=-1)


def _masked_pass(adapter: TargetAdapter, lean: bool, rows: int, length: int, start: int, keep: int):
    """One pass over a fresh batched cache, rows at different positions, the mask 64 keys wide ->
    (logits, features, every layer's keys and values)."""
    cache = BatchedKVCache(adapter.num_layers, rows, 96)
    ids = torch.randint(0, adapter.vocab_size, (rows, length), generator=torch.Generator().manual_seed(rows * length))
    pos = torch.arange(length)[None].expand(rows, length) + torch.arange(rows)[:, None] + start
    width = 64
    cache.kv.prepare(slice(0, rows), pos, width)
    mask = additive_mask(torch.arange(width)[None, None, None, :] <= pos[:, None, :, None], adapter.dtype)
    capture = (0, adapter.num_layers - 1)
    calls = _LeanCalls(adapter)
    try:
        with torch.inference_mode():
            if lean:
                logits, feats = adapter.forward(ids, pos, cache, capture, keep, mask)
            else:
                logits, feats = _transformers_forward(adapter.model, ids, pos, cache, capture, keep, mask)
    finally:
        calls.handle.remove()
    assert calls.n == (1 if lean else 0)  # each leg is what it says
    return logits, feats, *cache.kv.keys, *cache.kv.values


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("packed", [False, True])
def test_lean_pass_equals_transformers_bit_for_bit(arch, packed):
    model = tiny_target(arch)
    if packed:
        assert pack_cpu_linears(model) > 0
    adapter = TargetAdapter(model)
    assert adapter.lean_unsupported is None
    for rows, length, start, keep in ((1, 1, 5, 0), (1, 9, 0, 1), (3, 4, 7, 0), (2, 16, 2, 0)):
        lean = _masked_pass(adapter, True, rows, length, start, keep)
        stock = _masked_pass(adapter, False, rows, length, start, keep)
        for got, want in zip(lean, stock, strict=True):
            assert torch.equal(got, want), (arch, packed, rows, length)
        assert lean[0].shape[1] == (keep or length)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lean_pass_decodes_as_the_stock_model_with_its_own_cache(arch):
    """A prefill of 7 tokens, a verify pass of 4, a one-token step: 3 rows, the lean pass over the
    batched cache at a mask as wide as the sequence, transformers' stock model over its DynamicCache."""
    stock = tiny_target(arch)
    adapter = TargetAdapter(tiny_target(arch))
    assert stock.config._attn_implementation == "sdpa" and "_dflash_lean" not in stock.__dict__
    ids = torch.randint(0, adapter.vocab_size, (3, 12), generator=torch.Generator().manual_seed(7))
    capture = (0, adapter.num_layers - 1)
    ours, theirs = BatchedKVCache(adapter.num_layers, 3, 32), DynamicCache()
    calls = _LeanCalls(adapter)
    for lo, hi in ((0, 7), (7, 11), (11, 12)):
        pos = torch.arange(lo, hi)[None].expand(3, -1)
        ours.kv.prepare(slice(0, 3), pos, hi)
        mask = additive_mask(torch.arange(hi)[None, None, None, :] <= pos[:, None, :, None], adapter.dtype)
        with torch.inference_mode():
            lean = adapter.forward(ids[:, lo:hi], pos, ours, capture, 0, mask)
            want = _transformers_forward(stock, ids[:, lo:hi], pos, theirs, capture, 0, None)
        kv = [ours.kv.keys[0][:, :, :hi], ours.kv.values[-1][:, :, :hi]]
        kv_want = [theirs.layers[0].keys, theirs.layers[-1].values]
        for got, exp in zip([*lean, *kv], [*want, *kv_want], strict=True):
            if hi - lo > 1:
                assert torch.equal(got, exp), (arch, lo, hi)
            else:  # one query: the grouped SDPA's summation order (the module docstring)
                torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    calls.handle.remove()
    assert calls.n == 3


def test_runtimes_on_the_lean_pass_keep_the_reference_tokens():
    """The batched runtime (lean pass) against plain decoding through transformers' own forward,
    with a drafter rigged to be accepted (tests/test_zlab_oracle.rig): accepted drafts' K/V, written
    by the lean pass, are what the next steps attend to."""
    model = tiny_target("qwen3", seed=3)
    draft = random_draft(model.config, seed=3, block_size=8, num_key_value_heads=4)
    rig(model, draft)
    prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8], [11, 3]]
    params = SamplingParams(max_tokens=20)
    want = [autoregressive_generate(model, p, params).output_ids for p in prompts]
    assert TargetAdapter(model).lean_unsupported is None
    drafted = batched_generate(draft, model, prompts, params, policy=FixedPolicy(7))
    assert [r.output_ids for r in drafted] == want
    assert max(a for r in drafted for a in r.stats.acceptance_lengths) > 4  # drafts were accepted
    assert [r.output_ids for r in batched_generate(None, model, prompts, params)] == want


def test_lean_pass_declines_what_it_does_not_compute():
    gpt_oss = TargetAdapter(tiny_target("gpt_oss"))
    assert "gpt_oss" in gpt_oss.lean_unsupported
    eager = tiny_target("llama")
    eager.set_attn_implementation("eager")
    assert "eager" in TargetAdapter(eager).lean_unsupported
