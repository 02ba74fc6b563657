"""Sampling is lossless: every token DFlash emits is distributed as the target's own sample.

On a tiny vocabulary (8 tokens) the exact distribution of the 2nd and 3rd generated tokens is
computed by enumerating every prefix through the target; DFlash's empirical distribution over
1000 fixed-seed runs is compared with it by a chi-square goodness-of-fit test at significance
level 0.001 (fixed seeds: the verdict is deterministic, never flaky). The drafter proposes the
target's greedy tokens, so both acceptance (3rd token accepted from the draft) and rejection
paths are exercised, which the test also asserts.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.decoding.sampling import sampling_probs
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.sampling_params import SamplingParams
from tests.test_runtime_acceptance import make_oracle

V, T, TOP_P, N, ALPHA = 8, 1.0, 0.95, 1000, 1e-3


def next_probs(target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = target(torch.tensor([ids])).logits[0, -1]
    return sampling_probs(logits, T, TOP_P).double()


def exact_marginals(target, prompt):
    """P(token 2) and P(token 3) by enumeration over the first two tokens."""
    p1 = next_probs(target, prompt)
    p2 = torch.zeros(V, dtype=torch.float64)
    p3 = torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        if p1[a] == 0:
            continue
        q = next_probs(target, prompt + [a])
        p2 += p1[a] * q
        for b in range(V):
            if q[b] > 0:
                p3 += p1[a] * q[b] * next_probs(target, prompt + [a, b])
    return p2, p3


def gof_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token outside the nucleus"
    expected = probs[keep] * len(samples)
    # merge cells with expected < 5 into one, as the test's validity requires
    small = expected < 5
    obs = torch.cat([counts[keep][~small], counts[keep][small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # remove float rounding of the total
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_dflash_sampling_matches_target_distribution():
    target = tiny_target("llama", seed=11, vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1)
    with torch.no_grad():  # soften the tiny model's logits so several tokens are likely
        target.get_output_embeddings().weight.mul_(0.1)
    prompt = [1, 2, 3]
    p2, p3 = exact_marginals(target, prompt)
    draft = make_oracle(target, prompt, 3, block_size=4)
    second, third, accepted_third = [], [], 0
    for i in range(N):
        r = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=3, temperature=T, top_p=TOP_P, seed=i))
        second.append(r.output_ids[1])
        third.append(r.output_ids[2])
        accepted_third += r.stats.acceptance_lengths[0] >= 2
    assert 0.05 * N < accepted_third < 0.95 * N, "both accept and reject paths must be exercised"
    assert gof_pvalue(second, p2) > ALPHA
    assert gof_pvalue(third, p3) > ALPHA


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = sampling_probs(logits, 1.0, top_p=0.8)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(sampling_probs(logits, 1.0, top_p=0.4), torch.tensor([1.0, 0, 0, 0]))


def test_draw_is_torch_multinomials_own_draw_without_its_host_checks():
    """sampling.draw takes torch.multinomial(p, 1)'s exponential race: from the same generator state
    the same tokens (so seeds keep their meaning and z-lab 0.1.0's draws stay ours: test_zlab_oracle)
    and the same state after, over shapes, dtypes and zero-probability cells."""
    from dflash_trt.runtime.decoding.sampling import draw

    for seed, (dtype, shape) in enumerate([(torch.float32, (7, 50)), (torch.float64, (3, 5, 11)), (torch.float32, (1, 3))]):
        probs = torch.softmax(3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype), -1)
        probs[..., 1] = 0  # a cell the draw must never take
        ours, theirs = torch.Generator().manual_seed(100 + seed), torch.Generator().manual_seed(100 + seed)
        for _ in range(20):
            want = torch.multinomial(probs.reshape(-1, shape[-1]), 1, generator=theirs).view(shape[:-1])
            assert torch.equal(draw(probs, ours), want) and not (want == 1).any()
        assert torch.equal(ours.get_state(), theirs.get_state())
