"""The adaptive speculation policy: plain decoding when verification is expensive, long drafts when
it is cheap, and the choice follows the batch size and the measured acceptance."""

from __future__ import annotations

import pytest

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest, batched_generate
from dflash_trt.runtime.batched.policy import (AdaptivePolicy, CostTable, Decision, FixedPolicy, default_candidates,
                                       make_policy)
from dflash_trt.runtime.batched.policy_calibration import calibrate
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11], [3, 3]]


def _costs(fn, batches=(1, 2, 4, 8, 16), ks=(0, 1, 3, 7)) -> CostTable:
    table = CostTable()
    for n in batches:
        for k in ks:
            table.set(n, k, fn(n, k))
    return table


def test_candidates_cover_plain_decoding_and_the_full_block():
    assert default_candidates(15) == [0, 1, 3, 7, 15]
    assert default_candidates(3) == [0, 1, 3]
    with pytest.raises(ValueError):
        AdaptivePolicy(4, candidates=[0, 4])


def test_adaptive_candidates_respect_the_engines_max_draft_len():
    """An engine built with K = 3 from a block-8 drafter: the adaptive policy never chooses more
    than 3 drafts (it used to pick from [0, 1, 3, 7]), the fixed policy always 3."""
    adaptive = make_policy(SpeculationSettings.for_block(8, 3, "adaptive"))
    assert isinstance(adaptive, AdaptivePolicy) and adaptive.candidates == [0, 1, 3]
    assert default_candidates(5) == [0, 1, 3, 5]
    assert make_policy(SpeculationSettings.for_block(8, 3)).choose(4, 3).k == 3
    assert make_policy(SpeculationSettings.for_block(8)).choose(4, 7).k == 7  # the library default: K = B-1, fixed


def test_falls_back_to_plain_decoding_when_verification_is_expensive():
    """Told that verifying drafts costs 10x a plain step, the runtime never drafts, and the output
    is still the reference's."""
    target = tiny_target("llama", seed=1).double()
    draft = random_draft(target.config, block_size=8, seed=1).double()
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 if k == 0 else 10.0), candidates=[0, 1, 3, 7])
    results = batched_generate(draft, target, PROMPTS, SamplingParams(max_tokens=10), policy=policy)
    assert all(r.stats.total_draft_tokens == 0 for r in results)
    assert all(d.k == 0 for d in policy.decisions) and policy.decisions
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=10)).output_ids for p in PROMPTS]
    assert [r.output_ids for r in results] == ref


def test_memory_bound_speculates_compute_bound_does_not():
    """Same acceptance; the cost shape decides. Memory-bound (step cost flat in tokens) at batch 1,
    compute-bound (cost ~ rows x tokens) at batch 16, as verification turns on real hardware."""
    def cost(n, k):
        return 1.0 + 0.01 * n * (k + 1) if n == 1 else 0.1 + 0.2 * n * (k + 1)

    policy = AdaptivePolicy(8, costs=_costs(cost), candidates=[0, 1, 3, 7])
    for _ in range(50):  # a drafter that gets ~2 of 7 tokens accepted
        policy.observe_acceptance(7, 2)
    assert policy.choose(1, 7).k > 0
    assert policy.choose(16, 7).k == 0
    d = policy.choose(16, 7)
    assert d.batch == 16 and d.est_tokens_per_s > 0 and d.reason


def test_learned_acceptance_drives_the_draft_length():
    flat = _costs(lambda n, k: 1.0 + 0.1 * k)  # cheap drafting
    policy = AdaptivePolicy(8, costs=flat, candidates=[0, 1, 3, 7])
    for _ in range(200):
        policy.observe_acceptance(7, 0)  # nothing is ever accepted
    assert policy.choose(4, 7).k == 0
    q = policy.position_acceptance()
    assert all(a >= b for a, b in zip(q, q[1:])) and q[0] < 0.1
    for _ in range(400):
        policy.observe_acceptance(7, 7)  # then everything is: the decay lets it recover
    assert policy.choose(4, 7).k == 7
    assert policy.choose(4, 2).k <= 2  # never above what the rows may still emit
    summary = policy.summary()
    assert summary["last_decision"]["k"] <= 2 and "position_acceptance" in summary and summary["step_cost_s"]


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable()
    t.set(2, 0, 1.0)
    t.set(4, 0, 3.0)
    assert t.estimate(3, 0) == pytest.approx(2.0)
    assert t.estimate(8, 0) == pytest.approx(6.0)  # proportional above the largest measurement
    assert t.estimate(1, 0) == pytest.approx(1.0)
    assert t.estimate(2, 1) is None
    t.observe(2, 0, 2.0)
    assert 1.0 < t.estimate(2, 0) < 2.0  # EMA, not a replacement


def test_calibration_measures_every_candidate_and_leaves_the_runtime_idle():
    target = tiny_target("qwen3", seed=2)
    draft = random_draft(target.config, block_size=4, seed=2)
    policy = AdaptivePolicy(4)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=128),
                        None, RuntimeExtras(policy=policy)).start()
    calibrate(rt, [1, 4], reps=1)
    assert not rt.has_work() and rt.policy is policy
    for k in policy.candidates:
        assert set(policy.costs.table[k]) == {1, 4} and all(s > 0 for s in policy.costs.table[k].values())
    # after calibration the runtime decodes normally and records its decisions
    h = rt.add(SequenceRequest([1, 2, 3], SamplingParams(max_tokens=12)))
    rt.run()
    ref = dflash_generate(draft, target, [1, 2, 3], SamplingParams(max_tokens=12))
    assert h.result.output_ids == ref.output_ids
    assert rt.stats()["last_decision"]["batch"] == 1


def test_online_costs_follow_measurements():
    target = tiny_target("llama", seed=3)
    draft = random_draft(target.config, block_size=4, seed=3)
    policy = AdaptivePolicy(4, costs=_costs(lambda n, k: 1e-9, ks=(0, 1, 3)))  # absurdly cheap prior
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64),
                        None, RuntimeExtras(policy=policy)).start()
    for p in PROMPTS[:2]:
        rt.add(SequenceRequest(p, SamplingParams(max_tokens=20)))
    rt.run()
    measured = [policy.costs.table[k][2] for k in policy.candidates if 2 in policy.costs.table[k]]
    assert any(s > 1e-6 for s in measured)  # real step times were blended in
    # the decision log carries each timed step's seconds; the first decode step (it drafts over
    # the prompts: a catch-up) is not timed
    timed = [d.measured_s for d in policy.decisions if d.measured_s is not None]
    assert timed and all(t > 0 for t in timed) and policy.decisions[0].measured_s is None


def test_uncalibrated_policy_explores_each_candidate_then_exploits():
    policy = AdaptivePolicy(8, candidates=[0, 1, 3, 7])
    tried = []
    for _ in range(4):
        d = policy.choose(2, 7)
        assert d.reason.startswith("explore")
        tried.append(d.k)
        policy.observe_step(2, d.k, 1.0 + 0.05 * d.k)  # memory-bound: a longer draft costs little more
    assert tried == [0, 1, 3, 7]  # shortest first
    # prior acceptance 0.5 ** j: k = 3 expects 1.875 tokens for 1.15 plain steps, the best
    assert policy.choose(2, 7).k == 3 and policy.decisions[-1].reason == "max est_tokens_per_s"


def test_exploration_skips_longer_drafts_a_shorter_one_rules_out():
    """Where one draft slot already costs more than it brings, longer drafts are not tried: their
    optimistic bound (each extra slot accepted as often as the last measured one, the extra cost
    at least linear in k) misses plain decoding. Issue 44: at 16 rows on the 2-core CPU, trying
    k = 3, 7 and 15 there cost ~12 plain steps per request."""
    def explore(ratio_1: float, accept_1: float) -> list[int]:
        policy = AdaptivePolicy(16, candidates=[0, 1, 3, 7, 15], prior_weight=1e-9)
        for i in range(100):
            policy.observe_acceptance(1, int(i < 100 * accept_1))
        tried = []
        while (d := policy.choose(16, 15)).reason.startswith("explore"):
            tried.append(d.k)
            policy.observe_step(16, d.k, 1.0 if d.k == 0 else ratio_1 + (ratio_1 - 1.0) * (d.k - 1))
        return tried

    # one row: k = 1 and 3 cost 1.64 and 2.92 plain steps; along their secant k = 7 costs >= 5.5 for
    # at most ~2.5 tokens, k = 15 more still: neither is tried
    assert explore(1.64, 0.6) == [0, 1, 3]
    # memory-bound: a longer draft costs little more (1.2, 1.6, 2.4 ...), every candidate is measured
    assert explore(1.2, 0.9) == [0, 1, 3, 7, 15]


def test_a_batch_grown_past_the_measured_ones_is_priced_by_its_shortest_draft():
    """Measured at 1 row, where drafting is cheap, then grown to 16 rows: k = 1 is measured anew and
    loses there, so k = 3 and 7 are neither measured nor chosen on their 1-row ratios."""
    policy = AdaptivePolicy(8, candidates=[0, 1, 3, 7], prior_weight=1e-9, reexplore_every=0)
    for i in range(100):
        policy.observe_acceptance(7, 3 if i % 2 else 1)  # P(a >= 1) = 1, P(a >= 2..3) = 0.5
    for k, ratio in {0: 1.0, 1: 1.05, 3: 1.1, 7: 1.3}.items():
        policy.costs.set(1, k, ratio)
    tried = []
    while (d := policy.choose(16, 7)).reason.startswith("explore"):
        tried.append(d.k)
        policy.observe_step(16, d.k, {0: 10.0, 1: 30.0}[d.k])  # k = 1: 2 tokens for 3 plain steps
    assert tried == [0, 1]
    assert d.k == 0  # k = 3 (1.1x plain at 1 row) costs >= 3 plain steps at 16 rows for 3 tokens


def test_expensive_drafting_is_explored_once_then_plain_decoding_wins():
    policy = AdaptivePolicy(8, candidates=[0, 1, 3, 7])
    tried = []
    while (d := policy.choose(2, 7)).reason.startswith("explore"):
        tried.append(d.k)
        policy.observe_step(2, d.k, 1.0 if d.k == 0 else 5.0)  # drafting is very expensive here
    assert tried == [0, 1]  # k = 1 at 5 plain steps rules out 3 and 7
    assert d.k == 0 and d.reason == "max est_tokens_per_s"


def test_exploration_is_spent_only_where_the_cost_table_cannot_vouch():
    """Calibrated at 8 rows, a batch that shrinks as sequences finish is not re-explored (exploring
    k=15 there cost ~6 plain steps in the concurrency sweep); a batch grown past 1.5x the largest
    measurement is, except for drafts that already failed to pay at fewer rows."""
    costs = CostTable()
    for k, s in {0: 1.0, 1: 1.2, 3: 2.5, 7: 3.0}.items():
        costs.set(8, k, s)
    policy = AdaptivePolicy(8, costs=costs, candidates=[0, 1, 3, 7], prior_weight=1e-9)
    for _ in range(100):
        policy.observe_acceptance(7, 1)  # P(a >= 1) = 1, nothing beyond: k=1 gains 2x, k=3 and 7 too little
    for batch in (7, 5, 2, 12):  # below, and within 1.5x of, the measured batch
        assert not policy.choose(batch, 7).reason.startswith("explore"), batch
    tried = set()
    for _ in range(4):
        d = policy.choose(16, 7)
        if not d.reason.startswith("explore"):
            break
        tried.add(d.k)
        policy.observe_step(16, d.k, {0: 1.5, 1: 1.9}[d.k])
    # k=3 and k=7 cost 2.5x and 3x plain at 8 rows for an expected 2 tokens: they cannot pay at 16
    assert tried == {0, 1}


def test_a_marginal_estimated_gain_keeps_plain_decoding():
    """k=1 estimated 5% faster than plain is within noise: the policy stays at k=0 (margin 10%)."""
    policy = AdaptivePolicy(4, costs=_costs(lambda n, k: 1.0 if k == 0 else 1.25, ks=(0, 1, 3)), candidates=[0, 1, 3],
                            prior_weight=1e-9)
    for _ in range(100):
        policy.observe_acceptance(3, 1 if _ % 10 < 3 else 0)  # P(a >= 1) ~ 0.3: 1.3 / 1.25 = 1.04x
    assert policy.choose(4, 3).k == 0


def test_reexploration_backs_off_while_plain_decoding_stays_best():
    """A drafter that never pays is probed after 8, then 16, then 32 plain steps, not every 8. A
    probe is two drafting steps: the runtime does not time the first (it catches the drafter up)."""
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 + 0.5 * k), candidates=[0, 1, 3, 7], reexplore_every=8)
    probes = []
    for step in range(8 + 16 + 32 + 6):
        d = policy.choose(1, 7)
        if d.k:
            probes.append(step)
            policy.observe_acceptance(d.k, 0)
    assert probes == [8, 9, 8 + 16 + 2, 8 + 16 + 3, 8 + 16 + 32 + 4, 8 + 16 + 32 + 5]


def test_drafting_at_a_shrunken_batch_does_not_reset_the_probe_wait():
    """Drafting that pays only because the batch shrank (a burst's last rows) says nothing new about
    the full batch: the next probe there waits out the backed-off interval, not the base one
    (resetting on it re-probed every burst at 16 rows, ~1.4% of a run). Drafting that pays at as
    many rows as the last probe does reset it: the traffic changed."""
    # k > 0 costs 1.02x plain at 1-2 rows, 1.5x at 4 and more; slot 1 accepted one time in five
    # (1.2 tokens): drafting pays at 2 rows and not at 16
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 if k == 0 else (1.02 if n <= 2 else 1.5)),
                            candidates=[0, 1, 3, 7], reexplore_every=8, prior_weight=1e-9)
    seen = [0]

    def one_in_five(k: int) -> int:
        seen[0] += 1
        return int(seen[0] % 5 == 0)

    def run(batch: int, steps: int, accepted=one_in_five, times: int = 1) -> list[int]:
        drafted = []
        for step in range(steps):
            d = policy.choose(batch, 7)
            if d.k:
                drafted.append(step)
                for _ in range(times):
                    policy.observe_acceptance(d.k, accepted(d.k))
        return drafted

    for _ in range(50):  # what the drafter delivered so far
        policy.observe_acceptance(7, one_in_five(7))
    assert run(16, 12) == [8, 9]  # the first probe at the base wait; the wait doubles to 16
    assert len(run(2, 5)) == 5  # the burst's last rows: drafting pays at 2 rows
    assert run(16, 17) == [16]  # back at 16 rows: the doubled wait, not 8
    # the probe's second step finds every draft accepted: drafting pays at 16 rows, the traffic changed
    assert run(16, 2, accepted=lambda k: k, times=50) == [0, 1]
    run(16, 1, accepted=lambda k: 0, times=300)  # and then it turns unpredictable again
    assert run(16, 12)[:1] == [8]  # the wait is back at its base


def test_a_probes_second_step_is_dropped_when_the_batch_grew():
    """A probe drafts two steps with the draft length best at its batch. When its first step was a
    burst's last (2 rows, k = 7) and the next step is a new burst's first (16 rows), drafting 7 there
    costs several plain steps: the second step is dropped and the choice made afresh."""
    # any draft costs 3 plain steps at 2 rows (so the longest is the probe's), 10 at 16
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 if k == 0 else (3.0 if n <= 2 else 10.0)),
                            candidates=[0, 1, 3, 7], reexplore_every=4)
    for i in range(40):
        policy.observe_acceptance(7, 7 if i % 5 == 0 else 0)  # 2.4 tokens for 3 steps: plain, then probes
    ks = [policy.choose(2, 7).k for _ in range(5)]
    assert ks[:4] == [0, 0, 0, 0] and ks[4] > 0  # the probe's first step, at 2 rows
    d = policy.choose(16, 7)
    assert not d.reason.startswith("re-explore") and d.k == 0
    first = next(d for d in (policy.choose(2, 7) for _ in range(20)) if d.k)
    assert first.reason.startswith("re-explore after")  # the next probe, its rows unchanged ...
    second = policy.choose(2, 7)
    assert second.reason.startswith("re-explore, second step") and second.k == first.k  # ... takes both steps


def test_plain_decoding_reexplores_and_recovers_when_acceptance_returns():
    """Acceptance is only learned from drafting steps. A policy that settled on plain decoding
    (poor drafter) still drafts once every `reexplore_every` steps, so when the traffic turns
    predictable the new acceptance is seen and it goes back to speculating."""
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 + 0.05 * k), candidates=[0, 1, 3, 7], reexplore_every=10)
    for _ in range(200):
        policy.observe_acceptance(7, 0)  # nothing accepted: plain decoding wins
    ks = []
    for _ in range(40):
        d = policy.choose(1, 7)
        ks.append(d.k)
        if d.k:  # the drafting step now meets a drafter that gets everything right
            for _ in range(30):
                policy.observe_acceptance(d.k, d.k)
    first = next(i for i, k in enumerate(ks) if k)
    assert set(ks[:first]) == {0} and first == 10  # 10 plain steps, then one re-exploration
    assert "re-explore" in policy.decisions[first].reason
    assert all(k > 0 for k in ks[first + 1 :])  # the refreshed estimate keeps it speculating


def test_drafting_costs_follow_the_plain_cost_when_the_machine_slows_down():
    """Calibrated on a fast minute (plain 1.0, k=1 1.3), then the shared machine slows to plain
    2.0. k=1 is still estimated at 1.3x plain (2.6), not at its stale 1.3 s, so an expected
    1.25 tokens per row does not make it look 1.9x faster than plain decoding."""
    costs = CostTable()
    for k, s in {0: 1.0, 1: 1.3}.items():
        costs.set(4, k, s)
    policy = AdaptivePolicy(4, costs=costs, candidates=[0, 1], prior_weight=1e-9, reexplore_every=0)
    for i in range(100):
        policy.observe_acceptance(1, int(i % 4 == 0))  # P(a >= 1) = 0.25
    assert policy.choose(4, 3).k == 0
    for _ in range(30):
        policy.observe_step(4, 0, 2.0)
    assert costs.estimate(4, 1) == pytest.approx(1.3 * costs.estimate(4, 0))
    assert costs.estimate(4, 0) == pytest.approx(2.0, rel=0.01)
    assert policy.choose(4, 3).k == 0
    # an online drafting step updates the ratio against the plain cost of its own moment
    policy.observe_step(4, 1, 2.0)
    assert costs.ratio(4, 1) == pytest.approx(0.8 * 1.3 + 0.2 * 1.0, rel=0.01)
    assert policy.summary()["step_cost_vs_plain"]["1"]["4"] == pytest.approx(costs.ratio(4, 1), abs=1e-3)


class _Recorder(FixedPolicy):
    """Alternates `run` plain and `run` 1-draft steps and records which steps the runtime times."""

    def __init__(self, run: int = 3) -> None:
        super().__init__(1)
        self.run = run
        self.chosen: list[int] = []
        self.timed: list[int] = []

    def choose(self, batch, k_max, can_shadow=False):
        k = min(len(self.chosen) // self.run % 2, k_max)  # run = 3: 0 0 0 1 1 1 0 0 0 ...
        self.chosen.append(k)
        return Decision(batch, k, reason="test")

    def observe_step(self, batch, k, seconds):
        self.timed.append(len(self.chosen) - 1)


def test_drafting_steps_that_catch_the_drafter_up_are_not_timed():
    """The first drafting step after plain steps also drafts over their commits (the first one
    after the prompt: over the prompt). Its cost is not a steady drafting step's, and feeding it to
    the cost table would price drafting out after every re-exploration probe."""
    target = tiny_target("llama", seed=4)
    draft = random_draft(target.config, block_size=4, seed=4)
    policy = _Recorder()
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=1, max_seq_len=64),
                        None, RuntimeExtras(policy=policy)).start()
    rt.add(SequenceRequest([1, 2, 3, 4, 5], SamplingParams(max_tokens=14)))
    rt.run()
    ks = policy.chosen
    catch_up = {i for i, k in enumerate(ks) if k > 0 and (i == 0 or ks[i - 1] == 0)}
    assert catch_up and any(k > 0 and i not in catch_up for i, k in enumerate(ks))
    # every decode step is timed (the prompt's prefill had a step of its own) except the drafting
    # steps that catch up
    assert set(policy.timed) == {i for i in range(len(ks)) if i not in catch_up}


def test_a_drafting_step_after_one_plain_step_is_timed():
    """One plain step adds one column to the drafter's context (backlog <= k + 2), not a catch-up:
    a policy alternating plain and drafting steps near its margin must still time its drafting
    steps, or a drafting cost calibration priced wrong is never corrected online (C = 4, stop 54:
    37 drafting steps among 68 plain ones). Only the first, over the prompt, is a catch-up."""
    target = tiny_target("llama", seed=4)
    draft = random_draft(target.config, block_size=4, seed=4)
    policy = _Recorder(run=1)  # 0 1 0 1 ...: each drafting step follows one plain step
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=1, max_seq_len=64),
                        None, RuntimeExtras(policy=policy)).start()
    rt.add(SequenceRequest([1, 2, 3, 4, 5], SamplingParams(max_tokens=14)))
    rt.run()
    assert policy.chosen[:2] == [0, 1] and len(policy.chosen) >= 6
    assert set(policy.timed) == set(range(len(policy.chosen))) - {1}


def test_stale_low_acceptance_fades_during_plain_decoding():
    """One unpredictable stretch drove the estimate to ~0 and the policy to plain decoding. Plain
    steps age that evidence, so the policy drafts again on its own (well before the re-exploration
    interval) and lets fresh acceptance decide."""
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: 1.0 + 0.05 * k), candidates=[0, 1, 3, 7],
                            reexplore_every=10_000)
    for _ in range(200):
        policy.observe_acceptance(7, 0)
    ks = [policy.choose(1, 7).k for _ in range(2000)]
    first = next((i for i, k in enumerate(ks) if k), None)
    assert ks[0] == 0 and first is not None and first < 2000
    assert policy.decisions[-1].reason == "max est_tokens_per_s"


def test_a_plain_streak_returns_the_estimate_to_what_the_drafter_delivers():
    """Plain steps age the acceptance evidence towards the drafter's delivered slot-1 acceptance (here
    0.8), not towards the 0.5 prior: k = 3 at 1.8 plain steps pays with 0.8 (2.95 tokens expected,
    1.6x) and does not with 0.5 (1.875, 1.04x), which kept a policy on plain decoding at 4 rows on
    AVX2 while drafting read 1.04x (stop 51)."""
    policy = AdaptivePolicy(8, costs=_costs(lambda n, k: {0: 1.0, 1: 1.5, 3: 1.8, 7: 3.0}[k]),
                            candidates=[0, 1, 3, 7], reexplore_every=0)
    for i in range(400):
        policy.observe_acceptance(3, 3 if i % 5 else 0)  # slot 1 accepted 4 times in 5, then all three
    for _ in range(300):
        policy._forget(8)  # what 300 plain steps at 8 rows do (choose() calls it on each)
    assert sum(policy._drafted) < 1e-3  # the evidence itself has faded
    q = policy.position_acceptance()
    # slot 2 and 3: what the drafter delivered there too (accepted whenever slot 1 was), not 0.8 ** j
    assert q[0] == pytest.approx(0.8, abs=0.01) and q[1] == pytest.approx(0.8, abs=0.02)
    assert policy.choose(8, 7).k > 0


def test_a_lucky_slot_1_probe_does_not_make_long_drafts_look_good():
    """After a long plain streak the evidence has faded; a probe drafts k = 1 and finds slot 1
    accepted on 28 of 32 rows. Later slots used to extend at slot 1's conditional (0.84 each), so
    k = 7 read 4.7 tokens and was drafted at 16 rows, a step of 4 plain steps for ~1.9 tokens
    (emulated AVX2, C = 16, stop 53). Each later slot now takes the conditional acceptance this
    drafter delivered there (0.45 at slot 2 here), and the policy stays with k = 1 or plain."""
    costs = CostTable()
    for k, r in {0: 1.0, 1: 1.67, 3: 2.49, 7: 4.24}.items():
        costs.set(16, k, r)
    policy = AdaptivePolicy(16, costs=costs, candidates=[0, 1, 3, 7], reexplore_every=0)
    for i in range(600):  # k = 3 drafting, P(a >= j) ~ 0.58, 0.26, 0.15
        policy.observe_acceptance(3, 3 if i % 100 < 15 else 2 if i % 100 < 26 else 1 if i % 100 < 58 else 0)
    for _ in range(64):
        policy._forget(16)  # a long plain streak at 16 rows: the evidence has faded
    for i in range(32):  # the probe: two k = 1 steps at 16 rows, slot 1 accepted on 28 rows
        policy.observe_acceptance(1, int(i % 8 != 0))
    assert policy.expected_tokens(7) < 3.0
    assert policy.choose(16, 7).k in (0, 1)


def test_one_slow_drafting_step_moves_the_cost_ratio_a_little():
    costs = CostTable()
    costs.set(1, 0, 1.0)
    costs.set(1, 3, 1.3)
    costs.observe(1, 3, 10.0)  # the shared machine stalled during this step
    assert costs.ratio(1, 3) == pytest.approx(0.8 * 1.3 + 0.2 * 1.3 * 1.25)
    costs.observe(1, 0, 3.0)  # plain costs follow the machine unclipped
    assert costs.estimate(1, 0) == pytest.approx(0.8 + 0.2 * 3.0)


def test_a_stale_plain_cost_does_not_rescale_drafting_costs():
    """While the policy drafts on every step the plain cost is not re-measured; ratio samples taken
    against it stop after `fresh_within` steps, and resume after the next plain step."""
    costs = CostTable(fresh_within=4)
    costs.set(8, 0, 1.0)
    costs.set(8, 1, 1.4)
    for _ in range(4):
        costs.observe(8, 1, 1.0)  # looks cheaper than calibrated: the plain cost may be stale
    frozen = costs.ratio(8, 1)
    assert frozen < 1.4
    for _ in range(10):
        costs.observe(8, 1, 1.0)
    assert costs.ratio(8, 1) == frozen and costs.table[1][8] < 1.4  # the absolute entry still follows
    costs.observe(8, 0, 0.8)
    costs.observe(8, 1, 1.0)
    assert costs.ratio(8, 1) != frozen


def _dear_calibration() -> CostTable:
    """k = 3 at 4 rows calibrated in a loaded minute at 1.93 plain steps; then a stretch at one row,
    so the plain cost at 4 rows goes stale, and 20 drafting steps at 4 rows measuring 1.57."""
    costs = CostTable()
    costs.set(4, 0, 0.075)
    costs.set(4, 3, 0.145)
    costs.set(1, 0, 0.06)
    costs.set(1, 3, 0.07)
    for _ in range(40):
        costs.observe(1, 0, 0.06)
    for _ in range(20):
        costs.observe(4, 3, 0.117)
    return costs


def test_a_drafting_cost_mispriced_dear_is_corrected_by_the_next_plain_step_there():
    """Drafting steps timed while the plain cost at their batch was stale give no ratio sample; the
    plain step that next measures that batch pairs with the recent ones (their mean over it), so a
    ratio a loaded calibration priced too high moves towards what drafting costs now."""
    costs = _dear_calibration()
    assert costs.ratio(4, 3) == pytest.approx(0.145 / 0.075)  # nothing sampled against a stale plain cost
    costs.observe(4, 0, 0.0746)
    weight = 1 - 0.8 ** 4  # the last 4 drafting steps, as 4 EMA samples
    assert costs.ratio(4, 3) == pytest.approx((1 - weight) * 0.145 / 0.075 + weight * 0.117 / 0.0746)
    costs.observe(4, 0, 0.0746)
    assert costs.ratio(4, 3) == pytest.approx((1 - weight) * 0.145 / 0.075 + weight * 0.117 / 0.0746)  # paired once


def test_drafting_steps_long_past_are_not_paired_with_a_plain_step():
    costs = _dear_calibration()
    for _ in range(costs.fresh_within):
        costs.observe(1, 0, 0.06)  # the drafting steps at 4 rows are now fresh_within steps old
    costs.observe(4, 0, 0.0746)
    assert costs.ratio(4, 3) == pytest.approx(0.145 / 0.075)


def test_the_policy_drafts_again_once_a_dear_ratio_is_corrected():
    """C = 4 in the issue's bench (stop 54): k = 3 brings ~2.02 tokens per step; at the calibrated 1.93
    plain steps that misses the 10% margin and the policy decoded plainly for the rest of the run,
    though k = 3 had measured 1.57 there. After the refreshing plain step it drafts k = 3 again."""
    policy = AdaptivePolicy(8, costs=_dear_calibration(), candidates=[0, 3])
    for _ in range(20):  # P(a >= 1, 2, 3) = 0.6, 0.2, 0.2, spread evenly
        for a in (0, 0, 1, 1, 3):
            policy.observe_acceptance(3, a)
    # between 1.1 x 1.72 (the corrected ratio) and 1.1 x 1.93 (the calibrated one)
    assert 1.1 * 1.72 < policy.expected_tokens(3) < 1.1 * 0.145 / 0.075
    assert policy.choose(4, 3).k == 0
    policy.observe_step(4, 0, 0.0746)
    assert policy.choose(4, 3).k == 3


def _drive(policy: AdaptivePolicy, batch: int, cost: dict[int, float], steps: int) -> list[Decision]:
    """`steps` choices at `batch` rows, each timed at `cost[k]` and accepting slot 1 three times in five."""
    out = []
    for i in range(steps):
        d = policy.choose(batch, 1)
        policy.observe_step(batch, d.k, cost[d.k])
        if d.k:
            policy.observe_acceptance(d.k, int(i % 5 < 3))
        out.append(d)
    return out


def test_a_drafting_cost_mispriced_cheap_is_corrected_while_drafting_on_every_step():
    """Calibrated in a loaded minute, plain decoding at 8 rows read 1.25 s and k = 1 1.8 s, 1.44
    plain steps; now plain costs 1.0 and k = 1 still 1.8. For 1.6 tokens the policy drafts on every
    step, its samples divided by the stale plain cost agree with the misprice, and after
    `fresh_within` steps none is taken at all (AVX2, C = 16, stop 52: 0.90x plain over a whole run).
    A narrow gain re-measures the plain cost once in `refresh_plain_every` steps, the ratio follows
    the real cost, and the policy stops drafting at a loss."""
    costs = CostTable()
    costs.set(8, 0, 1.25)
    costs.set(8, 1, 1.8)
    policy = AdaptivePolicy(8, costs=costs, candidates=[0, 1], reexplore_every=0)
    for i in range(100):  # what the drafter delivered so far: slot 1 three times in five
        policy.observe_acceptance(1, int(i % 5 < 3))
    ds = _drive(policy, 8, {0: 1.0, 1: 1.8}, 300)
    assert ds[0].k == 1  # the mispriced estimate: 1.6 / 1.4 clears the margin
    assert any(d.reason.startswith("refresh the plain cost") for d in ds)
    assert costs.ratio(8, 1) > 1.6 / 1.1  # past where k = 1 clears the margin
    assert all(d.k == 0 for d in ds[-100:])


def test_a_wide_gain_drafts_on_every_step_without_refreshing_the_plain_cost():
    """Where drafting wins by far more than a loaded minute can misprice, no step is spent on it."""
    costs = CostTable()
    costs.set(1, 0, 1.0)
    costs.set(1, 1, 1.05)
    policy = AdaptivePolicy(8, costs=costs, candidates=[0, 1], reexplore_every=0)
    for i in range(100):
        policy.observe_acceptance(1, int(i % 5 < 3))
    assert all(d.k == 1 for d in _drive(policy, 1, {0: 1.0, 1: 1.05}, 300))


def test_slots_rarely_drafted_extend_the_measured_acceptance():
    """A policy that drafted k = 1 for a long while has evidence for slot 1 only; slots 2 and 3 take
    slot 1's conditional acceptance (0.6 -> 0.36 -> 0.22), not a fixed 0.5 ** j (0.25, 0.125), so k = 3
    (2.18 tokens for 1.47 plain steps) beats k = 1 (1.6 for 1.12). Issue 44: on AVX2 at C = 1 the
    policy settled on k = 1 and read 1.29x plain where k = 3 read 1.43x."""
    costs = CostTable()
    for k, s in {0: 1.0, 1: 1.12, 3: 1.47}.items():
        costs.set(1, k, s)
    policy = AdaptivePolicy(8, costs=costs, candidates=[0, 1, 3], reexplore_every=0)
    for i in range(200):
        policy.observe_acceptance(1, int(i % 5 < 3))
    q = policy.position_acceptance()
    assert q[0] == pytest.approx(0.6, abs=0.01)
    assert q[1] == pytest.approx(q[0] ** 2, abs=0.01) and q[2] == pytest.approx(q[0] ** 3, abs=0.01)
    assert policy.choose(1, 7).k == 3


def test_one_lucky_first_step_does_not_make_a_perfect_drafter():
    """The delivered acceptance is blended with the prior like every slot's evidence. Taken raw, one
    first step that accepted all its drafts made slot 1's prior 1.0, so every slot read 1.0 and the
    next step drafted 15 (a 2-plain-step pass; seen on the embedded pair at C = 1, stop 52)."""
    policy = AdaptivePolicy(16, reexplore_every=0)
    policy.observe_acceptance(3, 3)
    q = policy.position_acceptance()
    assert q[0] == pytest.approx((1 + 4 * 0.6) / 5)  # the delivered 1-of-1 blended to 0.6, then the slot's own
