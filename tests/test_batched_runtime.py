"""The batched runtime decodes every sequence exactly as the reference loop decodes it alone.

Float64 tiny targets: batched and single passes round differently in float32, which could flip
an argmax between near-tied logits; in float64 any difference is a real bug."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime import DFlashDraftModel, autoregressive_generate, dflash_generate
from dflash_trt.runtime.batched.runtime import (BatchedRuntime, RuntimeExtras, SequenceRequest, batched_generate,
                                        unsupported_reason)
from dflash_trt.runtime.drafters.dflash import make_draft_config
from dflash_trt.runtime.batched.policy import AdaptivePolicy, FixedPolicy
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

from tests.test_zlab_oracle import rig

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11], [3, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9]]
BUDGETS = [12, 5, 20, 1, 9, 16]


def _pair(arch: str, block: int = 4, seed: int = 1):
    target = tiny_target(arch, seed=seed).double()
    draft = random_draft(target.config, block_size=block, seed=seed).double()
    return target, draft


def _accepting_pair(arch: str, kind: str, block: int = 4):
    """A pair whose drafts are accepted, and the prompts in its vocabulary. "rigged": long accepted
    runs (tests/test_zlab_oracle.rig; its drafter reads only its anchor); "vocab16": a random pair
    over 16 tokens, whose drafts, which depend on the target's features and the drafter's context,
    are accepted now and then. (Over 128 tokens a random drafter's acceptance lengths are all 1, so
    equal per-step statistics would say nothing.)"""
    if kind == "rigged":
        target = tiny_target(arch, seed=1).double()
        draft = random_draft(target.config, block_size=block, seed=1, num_key_value_heads=4).double()
        rig(target, draft)
        return target, draft, PROMPTS
    target = tiny_target(arch, seed=9, vocab_size=16).double()
    draft = random_draft(target.config, block_size=block, seed=9, mask_token_id=15).double()
    return target, draft, [[t % 15 for t in p] for p in PROMPTS]


@pytest.mark.parametrize("kind", ["rigged", "vocab16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_greedy_equals_reference_with_joins_stops_and_queueing(arch, kind):
    target, draft, prompts = _accepting_pair(arch, kind)
    # a stop token that some sequences hit mid-way (taken from one reference output)
    plain = dflash_generate(draft, target, prompts[2], SamplingParams(max_tokens=BUDGETS[2])).output_ids
    stop = [plain[6]]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m, stop_token_ids=stop)) for p, m in zip(prompts, BUDGETS)]
    assert any(r.stats.finish_reason == "stop" for r in ref) and any(r.stats.finish_reason == "length" for r in ref)
    assert sum(a > 1 for r in ref for a in r.stats.acceptance_lengths) >= 3  # drafts were accepted
    # max_batch 3 < 6 sequences: later ones wait for a slot; arrivals spread joins over steps
    results = batched_generate(draft, target, prompts, [SamplingParams(max_tokens=m, stop_token_ids=stop) for m in BUDGETS],
                               policy=FixedPolicy(draft.block_size - 1), max_batch=3, arrivals=[0, 2, 1, 5, 0, 3])
    for got, want in zip(results, ref):
        assert got.output_ids == want.output_ids
        assert got.stats.finish_reason == want.stats.finish_reason
        # same drafts, same verification: the per-step statistics match too
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
        assert got.stats.total_draft_tokens == want.stats.total_draft_tokens


@pytest.mark.parametrize("policy", [FixedPolicy(0), FixedPolicy(1), "adaptive"], ids=["k0", "k1", "adaptive"])
def test_any_draft_length_is_lossless(policy):
    target, draft = _pair("llama", block=6, seed=3)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    kw = ({"speculation": SpeculationSettings.for_block(draft.block_size, policy="adaptive")} if policy == "adaptive"
          else {"policy": policy})
    results = batched_generate(draft, target, PROMPTS, [SamplingParams(max_tokens=m) for m in BUDGETS], **kw)
    assert [r.output_ids for r in results] == ref


def test_plain_batched_decoding_equals_autoregressive():
    target, _ = _pair("qwen3", seed=2)
    ref = [autoregressive_generate(target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    results = batched_generate(None, target, PROMPTS, [SamplingParams(max_tokens=m) for m in BUDGETS])
    assert [r.output_ids for r in results] == ref
    assert all(r.stats.total_draft_tokens == 0 for r in results)


def test_seeded_sampling_matches_the_reference_loop():
    """Each row samples with its own generator, consuming it as the reference loop does."""
    target, draft = _pair("llama", seed=4)
    seeds = [11, 12, 13, 14, 15, 16]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=s)).output_ids
           for p, m, s in zip(PROMPTS, BUDGETS, seeds)]
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=s) for m, s in zip(BUDGETS, seeds)]
    results = batched_generate(draft, target, PROMPTS, params, policy=FixedPolicy(draft.block_size - 1))
    assert [r.output_ids for r in results] == ref


def test_unseeded_sampled_rows_share_one_draw_and_land_on_their_own_rows():
    """Unseeded sampled rows are drawn together (one call per temperature/top_p group), next to
    greedy and seeded rows in the same batch. At a temperature of 1e-6 a draw is the argmax, so
    every unseeded row must equal its greedy decoding: a draw written to the wrong row, or a row
    left out of its group, shows as a different output."""
    target, draft = _pair("llama", seed=9)
    greedy = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    seeded = dflash_generate(draft, target, PROMPTS[1], SamplingParams(max_tokens=BUDGETS[1], temperature=0.9, seed=5)).output_ids
    temps = [1e-6, 0.9, 0.0, 1e-6, 1e-6, 0.0]  # rows 0, 3, 4 unseeded; row 1 seeded; rows 2, 5 greedy
    top_ps = [1.0, 1.0, 1.0, 0.5, 1.0, 1.0]  # two unseeded groups: (1e-6, 1.0) and (1e-6, 0.5)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=6, max_seq_len=64),
                        None, RuntimeExtras(policy=FixedPolicy(draft.block_size - 1))).start()
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=m, temperature=t, top_p=tp, seed=5 if i == 1 else None)))
               for i, (p, m, t, tp) in enumerate(zip(PROMPTS, BUDGETS, temps, top_ps))]
    rt.run()
    got = [h.result.output_ids for h in handles]
    assert got[1] == seeded
    assert [got[i] for i in (0, 2, 3, 4, 5)] == [greedy[i] for i in (0, 2, 3, 4, 5)]

    def hot(global_seed: int) -> list[list[int]]:  # at temperature 1.5 the group really samples
        torch.manual_seed(global_seed)
        return [r.output_ids for r in batched_generate(
            draft, target, PROMPTS, [SamplingParams(max_tokens=m, temperature=1.5) for m in BUDGETS])]

    first = hot(0)
    assert hot(0) == first  # the global seed fixes the draws
    assert hot(1) != first and first != greedy


class BatchedOracle(DFlashDraftModel):
    """Proposes row_sequences[i][p] at block position p of row i (hidden = pinv(W_lm) @ big onehot).
    The test sets row_sequences to the running rows' true continuations before each step."""

    def __init__(self, config, lm_head_weight: torch.Tensor):
        super().__init__(config)
        self.pinv = torch.linalg.pinv(lm_head_weight.double())  # [H, V]
        self.row_sequences: list[list[int]] = []

    def forward(self, target_hidden, noise_embedding, position_ids, cache=None, attn_mask=None, outputs=None):
        n, s = noise_embedding.shape[:2]
        onehot = torch.zeros(n, s, self.pinv.shape[1], dtype=torch.float64)
        for i in range(n):
            seq = self.row_sequences[i]
            for j, p in enumerate(position_ids[i, -s:].tolist()):
                onehot[i, j, seq[p] if p < len(seq) else 0] = 100.0
        hidden = (onehot @ self.pinv.T).to(noise_embedding.dtype)  # [n, S, H]
        return hidden if outputs is None else hidden[:, outputs]


def _assert_perfect_drafter_reaches_tau_b(B: int, steps: int, prompts: list[list[int]], **option_kw) -> None:
    """An oracle drafter (always the target's own next tokens) in a batch: every step commits B tokens."""
    target = tiny_target("qwen3", seed=5, vocab_size=32, hidden_size=64).double()
    n_new = 1 + B * steps
    truth = [p + autoregressive_generate(target, p, SamplingParams(max_tokens=n_new + B)).output_ids for p in prompts]
    draft = BatchedOracle(make_draft_config(target.config, num_layers=1, block_size=B),
                          target.get_output_embeddings().weight.detach())
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=len(prompts), max_seq_len=64, **option_kw), None,
                        RuntimeExtras(policy=FixedPolicy(B - 1))).start()
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=n_new))) for p in prompts]
    by_handle = {id(h): t for h, t in zip(handles, truth)}
    while rt.has_work():
        draft.row_sequences = [by_handle[id(s)] for s in rt.rows]
        rt.step()
    for h, t, p in zip(handles, truth, prompts):
        assert h.result.output_ids == t[len(p): len(p) + n_new]
        assert h.result.stats.acceptance_lengths == [B] * steps
        assert h.result.stats.per_position_acceptance == [1.0] * (B - 1)


def test_perfect_drafter_reaches_tau_equal_block_size_in_a_batch():
    _assert_perfect_drafter_reaches_tau_b(4, 5, [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 8]])


def test_cancel_frees_the_slot_and_others_are_unaffected():
    target, draft = _pair("llama", seed=6)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=15)).output_ids for p in PROMPTS[:3]]
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64),
                        None, RuntimeExtras(policy=FixedPolicy(3))).start()
    a, b, c = (rt.add(SequenceRequest(p, SamplingParams(max_tokens=15))) for p in PROMPTS[:3])
    rt.step()
    rt.step()
    assert c.slot == -1 and not c.done  # waiting: the batch is full
    rt.cancel(a)  # a leaves mid-flight; b moves to slot 0 (cache rows copied), c gets admitted
    assert a.done and 0 < len(a.result.output_ids) < 15
    rt.run()
    assert b.result.output_ids == ref[1] and c.result.output_ids == ref[2]


def test_step_callback_stops_one_sequence():
    target, draft = _pair("llama", seed=7)
    seen: list[int] = []

    def on_step(tokens: list[int]) -> bool:
        seen.extend(tokens)
        return len(seen) >= 4

    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64)).start()
    h1 = rt.add(SequenceRequest([1, 2, 3], SamplingParams(max_tokens=30), on_step=on_step))
    h2 = rt.add(SequenceRequest([4, 5], SamplingParams(max_tokens=10)))
    rt.run()
    assert h1.result.output_ids == seen and 4 <= len(seen) < 30
    assert h2.result.output_ids == dflash_generate(draft, target, [4, 5], SamplingParams(max_tokens=10)).output_ids


def test_bad_requests_and_unsupported_pairs_get_one_line_errors():
    target, draft = _pair("llama")
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=16)).start()
    with pytest.raises(DFlashError, match="exceeds max_seq_len=16"):
        rt.add(SequenceRequest([1] * 10, SamplingParams(max_tokens=10)))
    with pytest.raises(DFlashError, match="empty"):
        rt.add(SequenceRequest([], SamplingParams(max_tokens=4)))
    with pytest.raises(DFlashError, match="0..127"):
        rt.add(SequenceRequest([1, 500], SamplingParams(max_tokens=4)))
    gpt_oss = tiny_target("gpt_oss", seed=0)
    assert "gpt_oss" in unsupported_reason(gpt_oss)
    with pytest.raises(DFlashError, match="reference loop"):
        BatchedRuntime(gpt_oss, random_draft(gpt_oss.config, block_size=4), RuntimeOptions()).start()
    assert unsupported_reason(target, draft) is None


def test_caches_are_allocated_once():
    """No per-step reallocation: the K/V tensors of every layer are the same objects after a run."""
    target, draft = _pair("llama", seed=8)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=3, max_seq_len=64),
                        None, RuntimeExtras(policy=AdaptivePolicy(draft.block_size))).start()
    rt.add(SequenceRequest([1, 2, 3], SamplingParams(max_tokens=4)))
    rt.run()
    ptrs = [t.data_ptr() for t in (*rt.cache.kv.keys, *rt.draft_cache.kv.keys, rt.features)]
    for p in PROMPTS:
        rt.add(SequenceRequest(p, SamplingParams(max_tokens=8)))
    rt.run()
    assert [t.data_ptr() for t in (*rt.cache.kv.keys, *rt.draft_cache.kv.keys, rt.features)] == ptrs


def test_a_row_without_a_distribution_fails_alone_and_its_batch_goes_on():
    """temperature=1e-300 passes SamplingParams' validation (finite, >= 0) yet logits / T overflow
    to inf and the softmax gives NaN: torch.multinomial would fail the whole call. That row must
    end alone with an error naming the value; greedy and sampled neighbours in the same steps
    decode exactly as they would alone."""
    target, draft = _pair("llama", seed=4)
    alone = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    seeded = dflash_generate(draft, target, PROMPTS[2], SamplingParams(max_tokens=BUDGETS[2], temperature=0.8,
                                                                       seed=3)).output_ids
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=6, max_seq_len=64),
                        None, RuntimeExtras(policy=FixedPolicy(draft.block_size - 1))).start()
    params = [SamplingParams(max_tokens=m) for m in BUDGETS]
    params[1] = SamplingParams(max_tokens=BUDGETS[1], temperature=1e-300)  # joins with the others: prefill
    params[2] = SamplingParams(max_tokens=BUDGETS[2], temperature=0.8, seed=3)
    handles = [rt.add(SequenceRequest(p, sp)) for p, sp in zip(PROMPTS, params)]
    rt.run()
    assert handles[1].error is not None and "temperature=1e-300" in handles[1].error
    assert handles[2].result.output_ids == seeded
    assert [handles[i].result.output_ids for i in (0, 3, 4, 5)] == [alone[i] for i in (0, 3, 4, 5)]
    assert all(handles[i].error is None for i in (0, 2, 3, 4, 5))


def test_prefill_runs_bound_the_padding_of_each_pass():
    from dflash_trt.runtime.batched.scheduling import prefill_runs

    lengths = sorted([39, 46, 64, 39, 46, 64, 5, 200])
    runs = prefill_runs(lengths, 0.15)
    assert sum(runs) == len(lengths) and len(runs) > 1
    i = 0
    for n in runs:
        run = lengths[i : i + n]
        assert n * max(run) - sum(run) <= 0.15 * n * max(run)  # padding within the limit
        i += n
    assert prefill_runs(lengths, float("inf")) == [len(lengths)]  # a GPU: one pass
    assert prefill_runs([7] * 5, 0.0) == [5]  # equal lengths never split
    assert prefill_runs([], 0.15) == []


def test_newcomers_of_mixed_lengths_prefill_in_runs_and_decode_as_alone():
    """Six prompts of 1-13 tokens join at once on a CPU: they prefill in several passes, sorted
    by length into slots, and each decodes exactly as the reference loop decodes it alone."""
    from dflash_trt.runtime.batched.scheduling import prefill_runs

    target, draft = _pair("qwen3", seed=4)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=len(PROMPTS)),
                        None, RuntimeExtras(policy=FixedPolicy(draft.block_size - 1))).start()
    passes: list[int] = []
    forward = rt.target.forward

    def counting_forward(ids, *args, **kwargs):
        passes.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    rt.target.forward = counting_forward
    seqs = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, BUDGETS)]
    rt.step()  # admits and prefills all six (no row was running: no decode pass)
    assert len(passes) > 1
    assert passes == prefill_runs(sorted(len(p) for p in PROMPTS), rt.prefill_pad_limit)
    rt.target.forward = forward
    rt.run()
    assert [s.result.output_ids for s in seqs] == ref


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_verification_in_chunks_commits_what_one_pass_commits(chunk):
    """verify_chunk: a row verifies its drafts a chunk at a time and stops at its first rejection.
    Outputs and every per-step count (drafted, accepted) equal the reference loop's, for chunks
    smaller than, dividing, and larger than K + 1; rows join, stop and queue meanwhile. The pair is
    rigged to be accepted (tests/test_zlab_oracle.rig), so rows pass their first chunk and meet a
    rejection in a later one (a random drafter's rows all stop in their first)."""
    target = tiny_target("qwen3", seed=5).double()
    draft = random_draft(target.config, block_size=6, seed=5, num_key_value_heads=4).double()
    rig(target, draft)
    plain = dflash_generate(draft, target, PROMPTS[2], SamplingParams(max_tokens=BUDGETS[2])).output_ids
    stop = [plain[4]]
    params = [SamplingParams(max_tokens=m, stop_token_ids=stop) for m in BUDGETS]
    ref = [dflash_generate(draft, target, p, sp) for p, sp in zip(PROMPTS, params)]
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=64, verify_chunk=chunk),
                        None, RuntimeExtras(policy=FixedPolicy(draft.block_size - 1))).start()
    results = batched_generate(draft, target, PROMPTS, params, arrivals=[0, 2, 1, 5, 0, 3], runtime=rt)
    for got, want in zip(results, ref):
        assert got.output_ids == want.output_ids
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
        assert got.stats.total_draft_tokens == want.stats.total_draft_tokens
    K = draft.block_size - 1
    accepted = [a - 1 for r in ref for a in r.stats.acceptance_lengths]  # drafts accepted per step
    if chunk <= K:  # a row passed its first chunk and its next slot, then a draft was rejected
        assert any(chunk <= a < K for a in accepted), (chunk, accepted)
    assert K in accepted and min(accepted) < K  # whole blocks accepted, and rejections


def test_perfect_drafter_verified_in_chunks_goes_through_every_chunk():
    """A drafter that is always right: every row passes every chunk (tau = B), so chunk boundaries,
    the next slot's check and the last partial chunk all run."""
    _assert_perfect_drafter_reaches_tau_b(6, 4, [[3, 1, 4, 1, 5], [2, 7, 1, 8]], verify_chunk=4)
