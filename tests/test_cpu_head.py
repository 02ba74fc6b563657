"""The oneDNN-packed lm_head (runtime/cpu_head.py): same logits, same greedy text, tied weights
kept, gradients still flow for training, and it declines where it does not apply."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime import autoregressive_generate, dflash_generate
from dflash_trt.runtime.cpu_head import PackedCPULinear, head_can_be_packed, pack_cpu_lm_head
from dflash_trt.runtime.loading import load_pair, load_target

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def test_packed_head_gives_the_same_logits_and_keeps_the_weight_shared(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0])
    dense = model.get_output_embeddings()
    keys = set(model.state_dict())
    x = torch.randn(3, 5, dense.in_features)  # [B, S, H]
    with torch.inference_mode():
        want = dense(x)
    assert pack_cpu_lm_head(model) and pack_cpu_lm_head(model)  # idempotent
    head = model.get_output_embeddings()
    assert isinstance(head, PackedCPULinear) and head.weight is dense.weight
    assert set(model.state_dict()) == keys  # nothing extra saved
    with torch.inference_mode():
        got = head(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_through_a_packed_head_still_gets_gradients(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0])
    pack_cpu_lm_head(model)
    x = torch.randn(2, 4, model.config.hidden_size, requires_grad=True)
    model.get_output_embeddings()(x).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_greedy_text_is_unchanged_by_packing(tiny_pair_dirs):
    """Plain decoding with the stock head, plain and DFlash with the packed one: one token stream."""
    tdir, ddir = tiny_pair_dirs
    prompt = [1, 5, 9, 2, 7, 3]
    stock = autoregressive_generate(load_target(tdir), prompt, max_new_tokens=24).output_ids
    pair = load_pair(tdir, ddir)  # packs by default
    assert isinstance(pair.target.get_output_embeddings(), PackedCPULinear)
    assert autoregressive_generate(pair.target, prompt, max_new_tokens=24).output_ids == stock
    assert dflash_generate(pair.draft, pair.target, prompt, max_new_tokens=24).output_ids == stock


def test_packing_declines_where_it_does_not_apply(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0], dtype=torch.bfloat16)
    assert "bfloat16" in head_can_be_packed(model)
    assert not pack_cpu_lm_head(model)
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    pair = load_pair(*tiny_pair_dirs, pack_head=False)
    assert type(pair.target.get_output_embeddings()) is torch.nn.Linear
