"""Layer indexing: the feature of target layer l is the OUTPUT of decoder layer l, i.e. HF
output_hidden_states[l + 1] (z-lab and TensorRT-LLM convention). vLLM/SGLang-style capture of the
state ENTERING layer l would be hidden_states[l]: the test would catch that off-by-one."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import tiny_target


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_captured_features_are_decoder_layer_outputs(arch):
    target = tiny_target(arch, num_layers=4)
    adapter = TargetAdapter(target)
    ids = torch.arange(3, 14)[None]
    with torch.no_grad():
        ref = target(ids, output_hidden_states=True).hidden_states  # [emb, layer0, ..., (normed) last]
        _, feats = adapter.forward(ids, torch.arange(11)[None], adapter.new_cache(), [0, 2])
    h = target.config.hidden_size
    assert torch.allclose(feats[..., :h], ref[1], atol=1e-5)
    assert torch.allclose(feats[..., h:], ref[3], atol=1e-5)
    assert not torch.allclose(feats[..., :h], ref[0], atol=1e-3)


def test_adapters_share_one_set_of_hooks():
    target = tiny_target("llama")
    for _ in range(5):
        TargetAdapter(target)
    assert all(len(layer._forward_hooks) == 1 for layer in target.model.layers)


def test_lm_head_sees_standard_strides_with_the_same_values():
    """Slices like hidden[:, 1:K+1] reach the lm_head re-strided (on a CPU in bfloat16 the sliced
    form takes a bmm path that copies the whole head per call), and the logits keep their bits."""
    target = tiny_target("llama").to(torch.bfloat16)
    adapter = TargetAdapter(target)
    seen = []
    target.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].stride()))
    hidden = torch.randn(2, 9, target.config.hidden_size, dtype=torch.bfloat16)
    weight = target.get_output_embeddings().weight
    for rows in (hidden[:1, 1:5], hidden[:, 1:5], hidden[:, -1:], hidden[:1, -1:]):
        with torch.no_grad():
            logits = adapter.lm_head(rows)
            expected = torch.nn.functional.linear(rows.reshape(-1, rows.shape[-1]), weight).view(*rows.shape[:2], -1)
        assert torch.equal(logits, expected)
        n, s, h = rows.shape
        assert seen[-1] == (s * h, h, 1)
