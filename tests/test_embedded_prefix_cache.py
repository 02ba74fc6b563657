"""Prefix caching on the embedded pair (SmolLM2-135M and its trained drafter, float32, panel kernel):
requests that hit what earlier ones cached decode exactly as the reference loop decodes each alone.

Greedy, K = 15 every step (the batched runtime's fixed policy is the reference loop's schedule), so
the per-step acceptance must match too, and with a trained drafter it shows whether the drafter kept
its context (tau ~2-3 here; a drafter blind to the cached prefix accepts differently). The prompts
are real chat-templated text: a conversation's first turn, a prompt that shares it up to a block
boundary, one that shares it to mid-block, and the conversation's second turn (the first answer
resent, cached too). With the panel kernel the cached path is bit for bit the uncached one
(tests/test_prefix_cache.py), so nothing here should ever flip."""

from __future__ import annotations

import pytest

from dflash_trt.runtime.cpu import panel_gemm

MAX_TOKENS = 24

pytestmark = [
    pytest.mark.skipif(panel_gemm.unavailable() is not None, reason=f"panel kernel: {panel_gemm.unavailable()}"),
    pytest.mark.timeout(900),
]


def test_hits_decode_as_the_reference_loop_with_the_same_acceptance():
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.runtime.batched.policy import FixedPolicy
    from dflash_trt.runtime.batched.prefix_cache import BLOCK_TOKENS as BT
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    pair = load_pair(PairSource(*default_pair_dirs()))
    codec = pair.codec
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=codec.stop_token_ids)
    system = {"role": "system", "content": "You are a careful assistant. " + " ".join(
        p.prompt for p in interleave(load_prompts("train"))[:6])}
    questions = [p.prompt for p in interleave(load_prompts("eval"))[:3]]
    first = codec.encode_messages([system, {"role": "user", "content": questions[0]}])
    other = codec.encode_messages([system, {"role": "user", "content": questions[1]}])
    shared = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)  # the system prompt's ids and more
    assert shared > 3 * BT and shared % BT, "the test wants a shared prefix ending mid-block"
    boundary = shared // BT * BT
    aside = codec.encode("Now for something else entirely: list three rivers of Europe.", raw=True)
    assert aside[0] != first[boundary]
    prompts = [first,
               first[:boundary] + aside,  # shares exactly `boundary` tokens with the first: ends on a block edge
               other]  # shares `shared` tokens with the first: ends mid-block, its last partial block recomputed
    ref = [dflash_generate(pair.draft, pair.target, p, params, pair.speculation) for p in prompts]
    second = first + ref[0].output_ids[:-1] + codec.encode_messages(
        [system, {"role": "user", "content": questions[2]}])[shared:]  # the next turn resends the answer
    prompts.append(second)
    ref.append(dflash_generate(pair.draft, pair.target, second, params, pair.speculation))

    rt = BatchedRuntime(pair.target, pair.draft, RuntimeOptions(max_batch=2, max_seq_len=1024), pair.speculation,
                        RuntimeExtras(policy=FixedPolicy(pair.speculation.max_draft_len))).start()
    got = []
    for p in prompts:
        h = rt.add(SequenceRequest(p, params))
        rt.run()
        got.append(h.result)
    for i, (g, want) in enumerate(zip(got, ref)):
        assert g.output_ids == want.output_ids, f"prompt {i}"
        assert g.stats.acceptance_lengths == want.stats.acceptance_lengths, f"prompt {i}"
    assert [g.stats.num_cached_tokens for g in got[:3]] == [0, boundary, boundary]
    assert got[3].stats.num_cached_tokens == (len(first) + len(ref[0].output_ids) - 1) // BT * BT
    assert max(r.stats.tau for r in ref) > 1.5  # the drafter's tokens were accepted: its context mattered
