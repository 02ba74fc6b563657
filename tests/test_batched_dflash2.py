"""DFlash2 drafters, the newer drafter fields and every draft method on the batched runtime, step for
step against the reference loop (itself step for step z-lab 0.1.0's: tests/test_zlab_oracle.py).

Float64 tiny pairs rigged as test_zlab_oracle rigs them (the drafter copies its anchor, the target
repeats tokens often), so long accepted runs happen and a wrong draft shows in the per-step
acceptance, not only in the tokens (at temperature 0 the tokens are the target's whatever the
drafts).

1. Greedy, C = 1, 4 and 16 rows, static shapes on and off: DFlash2 (with and without the newer
   fields) and v1 with them give the reference loop's tokens AND per-step acceptance.
2. Seeded sampling, each draft method: a seeded row draws what the reference loop draws for it
   (the same calls, shapes and generator), so the same seed gives the same tokens and steps, beside
   greedy and unseeded rows in the same batch.
3. Losslessness of every method x family on the batched runtime, by chi-square against the target's
   exact distribution (test_rejection_sampling's oracle-like drafter and statistics: ALPHA = 1e-4
   per test, fixed seeds, so each verdict is deterministic), seeded rows (one generator each) and
   unseeded rows (drawn together) in the same batches.
4. The draft pass stays on the device: on `meta` under strict_devices (tests/device_harness.py) a
   step's draft and verify run whole, so no tensor left the device and no value was read on the
   host; the convolution runs over block slots only.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, SequenceRequest, batched_generate
from dflash_trt.runtime.batched.dflash2_proposer import DFlash2Proposer
from dflash_trt.runtime.batched.dflash_proposer import DFlashProposer
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DRAFT_METHODS, SpeculationSettings

from tests.device_harness import strict_devices
from tests.test_rejection_sampling import (ALPHA, PROMPT, TOP_P, VOCAB, gof_pvalue, oracle_pair,
                                           second_and_third)
from tests.test_zlab_oracle import NEWER_FIELDS, rig

# 16 prompts of 1..13 tokens and budgets of 1..30: rows join, finish and leave at different steps
PROMPTS = [[(5 * i + 3 * j) % 100 + 1 for j in range(1 + (7 * i) % 13)] for i in range(16)]
BUDGETS = [1 + (11 * i) % 30 for i in range(16)]
CASES = {"dflash2": ("dflash2", {}), "dflash2+fields": ("dflash2", NEWER_FIELDS), "v1+fields": ("dflash", NEWER_FIELDS)}


def rigged_pair(case: str, arch: str = "llama", block_size: int = 8):
    family, fields = CASES[case]
    target = tiny_target(arch, seed=1).double()
    draft = random_draft(target.config, block_size=block_size, seed=3, family=family, num_key_value_heads=4,
                         dflash_fields=fields).double()
    rig(target, draft)
    return target, draft


@pytest.fixture(scope="module", params=list(CASES))
def greedy_case(request):
    """(pair, the reference loop's results for PROMPTS) per case, computed once."""
    target, draft = rigged_pair(request.param)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)) for p, m in zip(PROMPTS, BUDGETS)]
    assert sum(sum(r.stats.acceptance_lengths) for r in ref) > 2 * sum(len(r.stats.acceptance_lengths) for r in ref)
    return target, draft, ref


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_greedy_steps_equal_the_reference_loops(greedy_case, concurrency, static):
    target, draft, ref = greedy_case
    need = max(len(p) + m for p, m in zip(PROMPTS, BUDGETS))
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=concurrency, max_seq_len=need, cuda_graphs=static)).start()
    results = batched_generate(draft, target, PROMPTS, [SamplingParams(max_tokens=m) for m in BUDGETS], runtime=rt)
    assert [r.output_ids for r in results] == [r.output_ids for r in ref]
    assert [r.stats.acceptance_lengths for r in results] == [r.stats.acceptance_lengths for r in ref]
    graphs = rt.graph_stats()  # the static leg replayed its static passes (on a CPU, eagerly), the eager one has none
    assert (graphs is not None and graphs["replays"] > 0 and graphs["misses"] == 0) if static else graphs is None


def test_the_proposer_is_the_drafter_familys():
    for case, proposer in (("dflash2", DFlash2Proposer), ("v1+fields", DFlashProposer)):
        target, draft = rigged_pair(case)
        assert type(BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64)).proposer) is proposer


@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("case", ["dflash2", "v1+fields"])
def test_seeded_rows_draw_what_the_reference_loop_draws(case, method):
    """Rows 0, 2, 3, 5 seeded (the same tokens and steps as the reference loop), row 1 greedy, row 4
    unseeded (drawn from the global generator: only its length is checked), in batches of 3."""
    target, draft = rigged_pair(case)
    spec = SpeculationSettings.for_block(draft.block_size, draft_method=method)
    prompts, budgets = PROMPTS[:6], [20, 14, 25, 9, 17, 30]
    params = [SamplingParams(max_tokens=m, temperature=0.0 if i == 1 else 0.8, top_p=0.9 if i % 2 else 1.0,
                             seed=None if i == 4 else 40 + i) for i, m in enumerate(budgets)]
    ref = [dflash_generate(draft, target, p, sp, spec) for p, sp in zip(prompts, params)]
    results = batched_generate(draft, target, prompts, params, max_batch=3, speculation=spec)
    for i, (got, want) in enumerate(zip(results, ref)):
        if i == 4:
            assert len(got.output_ids) == budgets[4]
            continue
        assert got.output_ids == want.output_ids
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
    drafted = sum(len(r.stats.acceptance_lengths) for r in ref)
    assert sum(sum(r.stats.acceptance_lengths) for r in ref) > 1.5 * drafted  # drafts were accepted


ROWS, BATCH, T = 1200, 300, 1.0


@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_every_draft_method_keeps_the_targets_distribution_batched(family, method):
    """The 2nd and 3rd tokens of ROWS sequences of PROMPT, decoded BATCH at a time, every other row
    seeded: their joint distribution must be the target's (chi-square, p > ALPHA)."""
    target, draft = oracle_pair(family)
    spec = SpeculationSettings.for_block(4, draft_method=method)
    torch.manual_seed(0)  # the unseeded rows' draws
    params = [SamplingParams(max_tokens=3, temperature=T, top_p=TOP_P, seed=i if i % 2 else None) for i in range(ROWS)]
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=BATCH, max_seq_len=16), spec).start()
    handles = [rt.add(SequenceRequest(list(PROMPT), p)) for p in params]
    rt.run()
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = 0
    for h in handles:
        counts[h.result.output_ids[1], h.result.output_ids[2]] += 1
        accepted += h.result.stats.acceptance_lengths[0] >= 2
    assert 0.05 * ROWS < accepted < 0.95 * ROWS, "both accept and reject paths must be exercised"
    assert gof_pvalue(counts, second_and_third(target)) > ALPHA


# -- on the device ------------------------------------------------------------------------------------


def _decoding_runtime(device: str, method: str, static: bool, sampled: bool):
    """A DFlash2 runtime on `device` with three rows as a prefill leaves them (prompt in the caches,
    first token pending), ready for its first decoding step."""
    target = tiny_target("llama", seed=0, num_layers=3)
    draft = random_draft(target.config, family="dflash2", num_layers=1, block_size=4, seed=0)
    target, draft = target.to(device), draft.to(device)
    spec = SpeculationSettings.for_block(draft.block_size, draft_method=method)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=static), spec).start()
    temps = [0.0, 0.8, 0.7] if sampled else [0.0] * 3
    for i, t in enumerate(temps):
        rt.add(SequenceRequest([1 + i] * (3 + i), SamplingParams(max_tokens=8, temperature=t, top_p=0.9)))
    for s in rt.scheduler.admit():
        s.start, s.out, s.draft_len = len(s.request.prompt_ids), [5], 0
    return rt


@pytest.mark.parametrize("method,static,sampled", [("match", False, False), ("match", True, False),
                                                   *[(m, False, True) for m in DRAFT_METHODS]])
def test_a_dflash2_step_runs_on_the_device_without_a_host_read(method, static, sampled):
    """Draft (the pass and the selector's walk, sampled or not) and verification of one step on
    `meta` under strict_devices: every op keeps its tensors on the model's device, and nothing is
    read on the host (a meta tensor has no value to read), so the step's one read stays its only sync."""
    rt = _decoding_runtime("meta", method, static, sampled)
    with strict_devices(), torch.inference_mode():  # as step() runs it
        decoded = rt._decode(3)  # queued on the device; the step's read comes after
    k = rt.max_draft_len
    assert decoded.out.device.type == "meta" and decoded.out.shape == (3, k + 2)
    assert (decoded.bad is not None) == sampled


def test_the_convolution_sees_block_slots_only():
    """In the batched pass a row's context and block go into the drafter side by side; the
    convolutions run over the block's B slots (the context enters through K/V), whatever the context."""
    rt = _decoding_runtime("cpu", "match", False, False)
    seen = []
    for layer in rt.draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            original = conv.prepare
            conv.prepare = lambda x, original=original: (seen.append(x.shape[1]), original(x))[1]
    with torch.inference_mode():
        rt._decode(3)
    assert seen and set(seen) == {rt.block_size}
