"""The batched runtime decodes the held-out prompts exactly as the reference loop decodes each alone,
at C = 1, 4 and 16, with the embedded pair's linear layers on the panel kernel's AVX2 build
(x86-64-v3: what an AVX2 machine serves with; an AVX-512 machine runs it too, issue 35).

Greedy, float32, K = 15 every step (the batched runtime's fixed policy is the reference loop's
schedule), so the per-step acceptance must match too. The panel kernel makes every linear layer's
row independent of its batch, bit for bit; attention still rounds with the query count and the
mask width, which has not flipped a greedy token here (a flip would fail this test)."""

from __future__ import annotations

import pytest

from dflash_trt.runtime.cpu import panel_gemm

VARIANT = "x86_64_v3"
NUM_PROMPTS = 16  # the C = 16 batch is the whole set
MAX_TOKENS = 24  # ~8 steps a prompt at tau ~3: the three runs and the reference take ~1-2 minutes on 2 cores

pytestmark = [
    pytest.mark.skipif(panel_gemm.unavailable(VARIANT) is not None,
                       reason=f"panel kernel {VARIANT}: {panel_gemm.unavailable(VARIANT)}"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def setup():
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.cpu.packing import PackedCPULinear, repack
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.sampling_params import SamplingParams

    pair = load_pair(PairSource(*default_pair_dirs()))  # float32, packed
    for model in (pair.target, pair.draft):
        repack(model, "panels", VARIANT)
        layers = [m for m in model.modules() if isinstance(m, PackedCPULinear)]
        assert layers and {m.variant for m in layers} == {VARIANT}
    codec = TextCodec.of_pair(pair)
    prompts = [codec.encode(p.prompt) for p in interleave(load_prompts("eval"))[:NUM_PROMPTS]]
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=codec.stop_token_ids)
    reference = [dflash_generate(pair.draft, pair.target, ids, params) for ids in prompts]
    return pair, prompts, params, reference


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_batched_greedy_equals_the_reference_loop_on_the_avx2_kernel(setup, concurrency):
    from dflash_trt.runtime.batched.runtime import batched_generate

    pair, prompts, params, reference = setup
    got = batched_generate(pair.draft, pair.target, prompts, params, max_batch=concurrency)
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g.output_ids == want.output_ids, f"prompt {i} at C={concurrency}"
        assert g.stats.acceptance_lengths == want.stats.acceptance_lengths, f"prompt {i} at C={concurrency}"
    assert sum(r.stats.num_output_tokens for r in reference) > NUM_PROMPTS  # they decoded, not stopped at once
    assert max(r.stats.tau for r in reference) > 1.5  # the drafter's tokens were accepted: the rows differ per step
