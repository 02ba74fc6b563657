"""DFlash greedy output == the target's own greedy output, token for token, for ANY drafter.

Acceptance only changes speed; correctness may not waver. Models run in float64 so that the
block verification pass and HF's one-token-at-a-time decoding cannot disagree on an argmax
through rounding (the claim is exact up to exact logit ties).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding, the most obviously correct way: a full forward over the
    whole sequence for every token (no KV cache, no hooks, nothing shared with the runtime)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@st.composite
def pair_configs(draw):
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(2, 6))
    n_ctx = draw(st.integers(1, min(3, layers)))
    return dict(
        arch=draw(st.sampled_from(["llama", "qwen3"])),
        vocab_size=draw(st.sampled_from([64, 97, 256])),
        hidden_size=heads * head_dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=draw(st.sampled_from([32, 96])),
        block_size=draw(st.integers(2, 16)),
        draft_layers=draw(st.integers(1, 2)),
        target_layer_ids=sorted(draw(st.sets(st.integers(0, layers - 1), min_size=n_ctx, max_size=n_ctx))),
        prompt_len=draw(st.integers(1, 24)),
        max_new_tokens=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 10_000)),
    )


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=pair_configs())
def test_greedy_dflash_equals_target_greedy_random_drafter(cfg):
    torch.manual_seed(cfg["seed"])
    target = tiny_target(
        cfg["arch"], seed=cfg["seed"], vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_layers"], num_heads=cfg["num_heads"], num_kv_heads=cfg["num_kv_heads"],
        intermediate_size=cfg["intermediate_size"], head_dim=cfg["head_dim"],
    ).double()
    draft = random_draft(
        target.config, seed=cfg["seed"], num_layers=cfg["draft_layers"], block_size=cfg["block_size"],
        target_layer_ids=cfg["target_layer_ids"],
    ).double()
    prompt = torch.randint(0, cfg["vocab_size"], (cfg["prompt_len"],)).tolist()
    result = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=cfg["max_new_tokens"]))
    assert result.output_ids == hf_greedy(target, prompt, cfg["max_new_tokens"])
    s = result.stats
    assert s.num_output_tokens == cfg["max_new_tokens"]
    assert sum(s.acceptance_lengths) == s.num_output_tokens - 1  # the first token comes from prefill
    assert all(1 <= t <= cfg["block_size"] for t in s.acceptance_lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_lossless_gpt_oss_moe_sliding_window_sinks(seed):
    """GptOss: MoE (4 experts, top-2), attention sinks, sliding window 8 on alternating layers.
    Prompt + output (~50 positions) far exceed the window, so rollback must respect it.
    float32: the MoE grouped matmul has no float64 kernel (logits are spread, ties are rare)."""
    target = tiny_target("gpt_oss", seed=seed, num_layers=4)
    draft = random_draft(target.config, seed=seed, num_layers=2, block_size=6)
    prompt = torch.randint(0, 128, (17,), generator=torch.Generator().manual_seed(seed)).tolist()
    result = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=35))
    assert result.output_ids == hf_greedy(target, prompt, 35)


def test_stop_token_truncates_after_first_occurrence():
    target = tiny_target("llama", seed=3).double()
    draft = random_draft(target.config, seed=3, block_size=5).double()
    prompt = list(range(5, 20))
    reference = hf_greedy(target, prompt, 30)
    stop = reference[7]  # a token the target does emit
    first = reference.index(stop)
    result = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop]))
    assert result.output_ids == reference[: first + 1]
    assert result.stats.finish_reason == "stop"
