"""Shadow drafts (runtime/batched/shadow_drafts.py): a plain step's one-row drafts, graded by the tokens plain
decoding commits next, give the policy exactly the acceptance a drafting step would have verified,
and a re-exploration that can use them verifies nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.cpu import panel_gemm
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest, batched_generate
from dflash_trt.runtime.batched.policy import AdaptivePolicy, CostTable, Decision
from dflash_trt.runtime.batched.scheduling import BatchedSequence
from dflash_trt.runtime.batched.shadow_drafts import ShadowDraft, ShadowDrafts, accepted_prefix
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams


def _seq(out: list[int], budget: int = 50, done: bool = False) -> BatchedSequence:
    seq = BatchedSequence(SequenceRequest([1], SamplingParams(max_tokens=budget)), budget=budget)
    seq.out = list(out)
    if done:
        seq.result = object()  # type: ignore[assignment]  # finished: only .done is read
    return seq


def test_a_draft_is_graded_as_verification_would_once_its_verdict_is_known():
    seq = _seq([9, 9])
    shadow = ShadowDraft(seq, base=2, drafts=[4, 5, 6])
    assert shadow.grade() is None  # nothing committed since it drafted
    seq.out += [4]
    assert shadow.grade() is None  # slot 1 accepted, slot 2 not known yet
    seq.out += [5, 7]
    assert shadow.grade() == (3, 2)  # slot 3 disagreed: 2 of 3 accepted, as a k = 3 step would count
    seq.out[3] = 8
    assert shadow.grade() == (3, 1)
    assert ShadowDraft(_seq([1, 2, 3]), base=0, drafts=[1, 2, 3]).grade() == (3, 3)
    assert accepted_prefix([1, 2], [2, 2]) == 0


def test_a_row_that_finished_grades_only_the_drafts_it_reached():
    assert ShadowDraft(_seq([4, 5], done=True), base=0, drafts=[4, 5, 6, 7]).grade() == (2, 2)
    assert ShadowDraft(_seq([], done=True), base=0, drafts=[4]).grade() == (0, 0)
    drafts = ShadowDrafts()
    seen: list[tuple[int, int]] = []
    drafts.add(_seq([], done=True), [4])
    drafts.grade(lambda d, a: seen.append((d, a)))
    assert not seen and not drafts.pending  # nothing graded: nothing reported, nothing left pending


def test_the_shadow_row_is_a_greedy_one_with_the_most_tokens_left():
    greedy_short, greedy_long = _seq([], budget=5), _seq([], budget=30)
    sampled = BatchedSequence(SequenceRequest([1], SamplingParams(max_tokens=90, temperature=0.8)), budget=90)
    drafts = ShadowDrafts()
    assert drafts.row([greedy_short, sampled, greedy_long]) is greedy_long
    assert drafts.row([sampled]) is None  # a sampled row's next token does not grade a draft exactly
    drafts.add(greedy_long, [1])
    assert drafts.row([greedy_short]) is None  # one at a time


def _plain_costs() -> CostTable:
    table = CostTable()
    for n in (1, 2, 4):
        for k in (0, 1, 3, 7):
            table.set(n, k, 1.0 if k == 0 else 10.0)  # drafting never pays
    return table


def test_reexploration_with_a_greedy_row_drafts_unverified_and_keeps_its_wait():
    policy = AdaptivePolicy(8, costs=_plain_costs(), candidates=[0, 1, 3, 7], reexplore_every=5)
    ks, shadows = [], []
    for _ in range(30):
        d = policy.choose(4, 7, can_shadow=True)
        ks.append(d.k)
        shadows.append(d.shadow)
    assert set(ks) == {0}
    assert [i for i, s in enumerate(shadows) if s] == [5, 11, 17, 23, 29]  # every 6th step: the wait never doubles
    assert set(shadows) == {0, 7}  # the whole block, graded slot by slot
    assert "graded by plain decoding" in policy.decisions[5].reason
    sampled_only = AdaptivePolicy(8, costs=_plain_costs(), candidates=[0, 1, 3, 7], reexplore_every=5)
    ks = [sampled_only.choose(4, 7).k for _ in range(8)]
    assert ks[5] > 0 and ks[6] > 0  # no row to shadow: the probe drafts for real, two steps


def test_a_plain_batch_reexplores_without_verifying_a_draft():
    """Drafting never pays here: the policy decodes plainly, re-explores every 4 plain steps with a
    shadow draft, and learns acceptance from them: not one draft is verified, and the output is
    the reference loop's."""
    target = tiny_target("llama", seed=3).double()
    draft = random_draft(target.config, block_size=8, seed=3).double()
    prompts = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11]]
    policy = AdaptivePolicy(8, costs=_plain_costs(), candidates=[0, 1, 3, 7], reexplore_every=4)
    params = SamplingParams(max_tokens=24)
    results = batched_generate(draft, target, prompts, params, policy=policy)
    assert all(r.stats.total_draft_tokens == 0 for r in results)
    shadows = [d for d in policy.decisions if d.shadow]
    assert len(shadows) >= 3 and all(d.k == 0 for d in policy.decisions)
    assert policy._drafted[0] > 0  # graded drafts reached the estimate
    assert [r.output_ids for r in results] == [dflash_generate(draft, target, p, params).output_ids for p in prompts]


# -- exactness on the embedded pair -------------------------------------------------------------------

@dataclass
class _Scripted:
    """Plain decoding, except on the listed choose() calls: a shadow draft (`shadow_at`) or a real
    K-draft step (`draft_at`). Records every acceptance the runtime reports, with its call index."""

    K: int
    shadow_at: frozenset[int] = frozenset()
    draft_at: int = -1
    calls: int = 0
    seen: list[tuple[int, int, int]] = field(default_factory=list)  # (call index, drafted, accepted)

    def choose(self, batch, k_max, can_shadow=False):
        i, self.calls = self.calls, self.calls + 1
        if i == self.draft_at:
            return Decision(batch, self.K, reason="test: draft")
        return Decision(batch, 0, reason="test", shadow=self.K if i in self.shadow_at and can_shadow else 0)

    def draft_lengths(self, k_max):
        return {0, self.K}

    def observe_step(self, batch, k, seconds):
        pass

    def observe_acceptance(self, drafted, accepted):
        self.seen.append((self.calls - 1, drafted, accepted))


@pytest.fixture(scope="module")
def embedded():
    if panel_gemm.unavailable() is not None:
        pytest.skip(f"panel kernel: {panel_gemm.unavailable()} (a one-row pass equals a batch's row bit for bit on it)")
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.prompts import interleave, load_prompts

    pair = load_pair(PairSource(*default_pair_dirs()))  # float32, linear layers on the panel kernel
    prompts = sorted((pair.codec.encode(p.prompt) for p in interleave(load_prompts("eval"))[:3]), key=len)
    return pair, prompts


def _runtime(pair, policy) -> BatchedRuntime:
    return BatchedRuntime(pair.target, pair.draft, RuntimeOptions(max_batch=4, max_seq_len=512), None,
                          RuntimeExtras(policy=policy)).start()


def _run(pair, prompts, policy, calls: int, before_step=None) -> BatchedRuntime:
    """Admit the prompts (one prefill step), then decode until the policy was asked `calls` times."""
    rt = _runtime(pair, policy)
    for ids, budget in zip(prompts, (16, 20, 48)):  # the longest prompt (last slot) has the most left
        rt.add(SequenceRequest(ids, SamplingParams(max_tokens=budget)))
    while rt.has_work() and policy.calls < calls:
        if before_step is not None:
            before_step(rt)
        rt.step()
    return rt


def test_shadow_drafts_are_graded_exactly_as_a_drafting_step_verifies_them(embedded):
    """At each of several plain steps one row drafts K unverified; its grade must equal what a real
    K-draft step at the same point reports for that row (a separate run, identical up to that step).
    The shadow row sits in the batch's last slot, so a pass that read slot 0's context would differ."""
    pair, prompts = embedded
    K = pair.speculation.max_draft_len
    shadow_at = frozenset({2, 7, 12, 17})
    rows: dict[int, int] = {}  # call index -> the shadow row's slot

    def where(rt):  # the row the coming step's shadow draft runs on, if it runs one
        row = rt.shadows.row(rt.rows)
        if rt.rows and rt.policy.calls in shadow_at and row is not None:
            rows[rt.policy.calls] = row.slot

    shadowed = _Scripted(K, shadow_at=shadow_at)
    _run(pair, prompts, shadowed, 30, where)
    graded = {}
    for i in sorted(rows):  # each shadow's grade comes after its call, before the next shadow's
        graded[i] = next((d, a) for c, d, a in shadowed.seen if c >= i)
    assert len(graded) >= 3 and set(rows.values()) - {0}, rows
    assert any(a > 0 for _, a in graded.values()), graded  # a test where a draft is accepted somewhere
    for i, (drafted, accepted) in graded.items():
        real = _Scripted(K, draft_at=i)
        _run(pair, prompts, real, i + 1)  # identical to the shadowed run up to call i
        per_row = [(d, a) for c, d, a in real.seen if c == i]
        assert drafted == K and per_row[rows[i]] == (K, accepted), (i, rows[i], per_row, graded[i])
