"""How many draft tokens to verify per step: chosen from the batch size and measured costs.

Speculation pays when verification is memory-bound: verifying k+1 tokens per row costs about the
same as 1. At high concurrency verification turns compute-bound (cost grows with rows x tokens),
and a fixed long draft makes DFlash SLOWER than plain decoding (reported on vLLM and SGLang). The
adaptive policy picks, every step, the k in a small candidate set (0 = plain decoding) that
maximises expected output tokens per second for the whole batch:

    E[tokens per row](k) = 1 + sum_{j=1..k} P(a >= j)          (the bonus token always comes)
    throughput(n, k)      = n * E[tokens per row](k) / cost(n, k)

``P(a >= j)`` is the running per-position acceptance (``per_position_acceptance`` in
dflash_trt.metrics: a step accepts slot j only if it accepted every slot before it), decayed so
it follows the current traffic. ``cost(n, k)`` is the measured wall time of one decoding step
(draft pass + verification pass) with n rows and k draft tokens each: from a short calibration
at start-up and refined online (EMA of every step); for k > 0 it is kept as a ratio to the plain
step measured at the same time (see CostTable), so the comparison survives machine-speed drift.
k = 0 costs exactly a plain decoding step, so when the cost model is right the policy is never
slower than plain decoding.

Not charged separately: the drafter's catch-up after plain steps (its pass first consumes the
context those steps committed). The drafter consumes every committed token once, whichever kind
of step produced it, so switching does not add to that work; it only moves it to the step that
drafts next. A per-step charge for it would make the policy refuse to draft after any long
streak, a long prompt included, until the next re-exploration.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dflash_trt.draft_len_schedule import DraftLenSchedule
    from dflash_trt.speculation import SpeculationSettings

log = logging.getLogger("dflash_trt.policy")


@dataclass
class Decision:
    """One step's choice and the inputs it was made from (logged, and kept in the runtime's log)."""

    batch: int
    k: int
    expected_tokens_per_row: float = 1.0
    est_step_s: float = 0.0
    est_tokens_per_s: float = 0.0
    reason: str = ""
    # the step's measured wall time, filled in by the runtime when the step was timed (None: a
    # step with a prefill, a drafter catch-up or a CUDA-graph capture, which the cost table skips)
    measured_s: float | None = None
    # with k = 0: drafts one greedy row draws in this plain step without verifying them, graded by
    # the tokens plain decoding commits next (runtime/batched/shadow_drafts.py); 0: none
    shadow: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class SpeculationPolicy(Protocol):
    """Chooses k (drafts verified this step) for a batch; k_max = K (SpeculationSettings).
    `can_shadow`: a row of the batch can draft without verifying (Decision.shadow) this step."""

    def choose(self, batch: int, k_max: int, can_shadow: bool = False) -> Decision: ...

    def observe_step(self, batch: int, k: int, seconds: float) -> None: ...

    def observe_acceptance(self, drafted: int, accepted: int) -> None: ...

    def draft_lengths(self, k_max: int) -> set[int]:
        """Every k choose() may return (what the runtime captures CUDA graphs for)."""
        ...


@dataclass
class FixedPolicy:
    """Always k = min(k, k_max): k = K is the reference loop's schedule, k = 0 plain decoding."""

    k: int

    def choose(self, batch: int, k_max: int, can_shadow: bool = False) -> Decision:
        return Decision(batch, min(self.k, k_max), reason="fixed")

    def draft_lengths(self, k_max: int) -> set[int]:
        return {min(self.k, k_max)}

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        pass

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class SchedulePolicy:
    """k = the draft-length schedule's value at the batch size (dflash_trt.draft_len_schedule):
    what TensorRT-LLM does with the engine's ``draft_len_schedule``, so ``serve`` behaves as the node."""

    schedule: "DraftLenSchedule"

    def choose(self, batch: int, k_max: int, can_shadow: bool = False) -> Decision:
        return Decision(batch, min(self.schedule.draft_len(batch), k_max), reason="schedule")

    def draft_lengths(self, k_max: int) -> set[int]:
        return {min(k, k_max) for _, k in self.schedule.steps} | {0}

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        pass

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        pass


def _interpolate(row: dict[int, float], batch: int, proportional_above: bool) -> float:
    """Value at `batch` from measurements at some row counts: linear between them, the smallest's
    below them (a step has a fixed overhead: fewer rows are no cheaper), and above the largest
    either proportional to rows (absolute step costs) or held (ratios between step costs)."""
    if batch in row:
        return row[batch]
    ns = sorted(row)
    i = bisect.bisect_left(ns, batch)
    if i == 0:
        return row[ns[0]]
    if i == len(ns):
        return row[ns[-1]] * batch / ns[-1] if proportional_above else row[ns[-1]]
    lo, hi = ns[i - 1], ns[i]
    w = (batch - lo) / (hi - lo)
    return (1 - w) * row[lo] + w * row[hi]


@dataclass
class CostTable:
    """Measured seconds per decoding step, keyed by (rows, k).

    A drafting step (k > 0) is estimated as plain step x ratio, not from its own absolute seconds:
    the plain cost is re-measured online on every plain step, while a k > 0 entry is refreshed
    only when the policy drafts. On a shared machine whose speed drifts (here +-10% within
    minutes), absolute entries measured at different times compare two different machines, and a
    stale k > 0 entry from a fast minute looks cheap next to a plain cost from a slow one. Ratios
    are taken within one moment: calibration measures all k in the same round, and an online
    k > 0 step is divided by the plain cost at the same row count, if that was measured recently
    (otherwise the step refreshes only its absolute entry, and the plain step that next measures
    that batch pairs with those recent drafting steps: see :meth:`_pair_recent`)."""

    ema: float = 0.2  # weight of a new online measurement
    clip: float = 1.25  # an online ratio sample counts as at most this factor off the estimate
    fresh_within: int = 32  # a plain cost measured this many observed steps ago still counts as current
    pair_at_most: int = 4  # recent drafting steps a plain step pairs with weigh as this many ratio samples at most
    _observed: int = field(default=0, init=False)
    # (k, rows) -> [(observed index, seconds)] of drafting steps timed while the plain cost there was stale
    _unpaired: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict, init=False)
    _plain_seen: dict[int, int] = field(default_factory=dict, init=False)  # rows -> _observed at the last plain step
    table: dict[int, dict[int, float]] = field(default_factory=dict)  # k -> {rows: seconds}
    ratios: dict[int, dict[int, float]] = field(default_factory=dict)  # k > 0 -> {rows: cost / plain cost}

    def set(self, batch: int, k: int, seconds: float) -> None:
        self.table.setdefault(k, {})[batch] = seconds
        if k == 0:
            self._plain_seen[batch] = self._observed
        plain = self.table.get(0, {}).get(batch)
        if plain:  # whichever of a round's entries comes last completes the ratios at this batch
            for kk, row in self.table.items():
                if kk > 0 and batch in row:
                    self.ratios.setdefault(kk, {})[batch] = row[batch] / plain

    def observe(self, batch: int, k: int, seconds: float) -> None:
        self._observed += 1
        if k == 0:
            self._plain_seen[batch] = self._observed
            self._pair_recent(batch, seconds)
        elif self._observed - self._plain_seen.get(batch, -self.fresh_within - 1) <= self.fresh_within:
            # a ratio sample needs a plain cost of this moment: while the policy drafts on every
            # step the plain entry goes stale, and dividing by a plain cost from a slow minute
            # would make drafting look cheap (seen: k=1 "0.9x plain" at 4-6 rows)
            self._blend(self.ratios.setdefault(k, {}), batch, seconds / self.table[0][batch], self.clip)
        else:
            recent = self._unpaired.setdefault((k, batch), [])
            recent.append((self._observed, seconds))
            del recent[: -self.pair_at_most]
        self._blend(self.table.setdefault(k, {}), batch, seconds)

    def _pair_recent(self, batch: int, plain_s: float) -> None:
        """A plain step at `batch` rows pairs with the drafting steps timed there while the plain
        cost was stale, if they are recent: their mean over this plain step is one ratio sample,
        weighing as many EMA samples as the steps it averages (at most `pair_at_most`). Without it a
        ratio a loaded calibration priced too HIGH stood after the narrow-gain refresh: k = 3 at 4
        rows kept its calibrated 1.93 plain steps while 21 drafting steps there measured 1.57, and
        the policy decoded plainly from the refresh on (C = 4, 1.02x against 1.07-1.14x; stop 54)."""
        for k in [k for (k, n) in self._unpaired if n == batch]:
            recent = [s for i, s in self._unpaired.pop((k, batch)) if self._observed - i <= self.fresh_within]
            if recent:
                weight = 1 - (1 - self.ema) ** len(recent)
                self._blend(self.ratios.setdefault(k, {}), batch, sum(recent) / len(recent) / plain_s, self.clip,
                            weight)

    def _blend(self, row: dict[int, float], batch: int, sample: float, clip: float | None = None,
               weight: float | None = None) -> None:
        """EMA (a new sample weighs `weight`, default `ema`); with `clip`, each sample counts as at
        most clip x off the estimate, so one step slowed by the shared machine moves a ratio by a few
        percent only. (Ratios are clipped: a drafting cost is refreshed only while the policy drafts,
        so one unclipped hiccup could stop it for good. Plain costs are refreshed on every plain step
        and follow the machine freely.)"""
        old = row.get(batch)
        if old is None:
            row[batch] = sample
            return
        if clip:
            sample = min(max(sample, old / clip), old * clip)
        w = self.ema if weight is None else weight
        row[batch] = (1 - w) * old + w * sample

    def plain_age(self, batch: int) -> int | None:
        """Observed steps since the plain cost at `batch` rows was last measured (None: never)."""
        seen = self._plain_seen.get(batch)
        return None if seen is None else self._observed - seen

    def known(self, k: int) -> bool:
        return bool(self.table.get(k))

    def ratio(self, batch: int, k: int) -> float | None:
        """Estimated cost(batch, k) / cost(batch, 0), or None when never measured side by side."""
        row = self.ratios.get(k)
        return _interpolate(row, batch, proportional_above=False) if row else None

    def estimate(self, batch: int, k: int) -> float | None:
        ratio = self.ratio(batch, k) if k > 0 else None
        if ratio is not None:
            return ratio * _interpolate(self.table[0], batch, proportional_above=True)
        row = self.table.get(k)
        return _interpolate(row, batch, proportional_above=True) if row else None

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {str(k): {str(n): round(s, 6) for n, s in sorted(v.items())} for k, v in sorted(self.table.items())}

    def ratios_dict(self) -> dict[str, dict[str, float]]:
        return {str(k): {str(n): round(r, 4) for n, r in sorted(v.items())} for k, v in sorted(self.ratios.items())}


def default_candidates(max_draft_len: int) -> list[int]:
    """0 (plain), 1, 3, 7, ... and K = max_draft_len: few shapes (CUDA-graph friendly), wide range,
    never above K (the engine's memory plan holds K drafts per step)."""
    ks = {0, max_draft_len}
    k = 1
    while k < max_draft_len:
        ks.add(k)
        k = 2 * k + 1
    return sorted(ks)


@dataclass
class AdaptivePolicy:
    """Maximise expected tokens/s per step over candidate draft lengths (see the module doc).

    Acceptance starts from a pessimistic-but-not-zero prior (P(a >= j) = prior ** j, worth
    `prior_weight` steps) so the first steps speculate a little and learn. Costs come from
    BatchedRuntime.calibrate, :meth:`CostTable.set`, or online exploration: with `explore`, a
    candidate is tried once when nothing measured covers the current batch size (see
    :meth:`_needs_measurement`; steps that also prefill a newcomer are not timed, so a candidate
    may be tried again)."""

    block_size: int
    costs: CostTable = field(default_factory=CostTable)
    candidates: list[int] | None = None
    prior: float = 0.5
    prior_weight: float = 4.0
    decay: float = 0.995  # per observed row-step: forget old traffic slowly
    forget: float = 0.99  # per plain row-step: unobserved time ages the evidence faster (see _forget)
    log_size: int = 256
    # speculate only when its estimate beats plain decoding by this fraction: estimates are noisy,
    # and a marginal "win" that is really a loss would break the never-slower-than-plain promise
    margin: float = 0.1
    explore: bool = True  # measure each candidate online where the cost table cannot vouch for it
    explore_growth: float = 1.5  # a batch this much larger than any measured one is measured anew
    # After this many plain steps in a row, re-explore: acceptance is only learned from graded drafts,
    # so without this a policy that settled on plain decoding would never notice that traffic became
    # predictable again. Where a greedy row can, it drafts K in a plain step without verifying them
    # (a shadow draft, graded by plain decoding's next commits: runtime/batched/shadow_drafts.py), which
    # costs one row's drafter pass. Otherwise (every row samples) the probe drafts for real, two steps
    # with the best positive k, and the wait doubles after each that changes nothing (64, 128, ...
    # 1024 steps), so a useless drafter costs almost nothing; it returns to 64 when drafting pays
    # again at as many rows as the last probe's.
    reexplore_every: int = 64
    # While drafting pays only narrowly (est. gain under (1 + margin) x refresh_band), one step in
    # `refresh_plain_every` decodes plainly when the plain cost at this batch is that old: drafting's
    # cost is kept as a ratio to a plain cost of the same moment, so a ratio that a loaded minute
    # mispriced at calibration (k = 1 at 16 rows read 1.44 plain steps under load, 1.73-1.81 quiet)
    # would otherwise never be corrected while the policy drafts on every step. At most one step in
    # 64 at a gain under ~1.4x: under 0.6% of the run, against a ~20% misprice left standing.
    refresh_plain_every: int = 64
    refresh_band: float = 1.25  # CostTable.clip: how far one loaded moment has been seen to misprice
    _plain_streak: int = field(default=0, init=False)
    _probed_at: int = field(default=0, init=False)  # rows at the last probe (0: none since drafting paid there)
    _probe_again: int = field(default=0, init=False)  # k of a probe's second step (0: none due)
    _reexplore_interval: int = field(default=0, init=False)
    _drafted: list[float] = field(init=False)
    _accepted: list[float] = field(init=False)
    # each slot's conditional evidence as observed (decayed per observation only, never by _forget):
    # [times slot j was verified with every slot before it accepted, times it was accepted too]. What
    # this drafter has delivered on this traffic: the shape plain streaks age the estimate towards
    _delivered: list[list[float]] = field(init=False)
    decisions: deque = field(init=False)

    def __post_init__(self) -> None:
        if self.candidates is None:
            self.candidates = default_candidates(self.block_size - 1)
        if any(not 0 <= k < self.block_size for k in self.candidates):
            raise ValueError(f"candidates {self.candidates} must lie in 0..{self.block_size - 1}")
        self.reset_acceptance()
        self.decisions = deque(maxlen=self.log_size)
        self._reexplore_interval = self.reexplore_every

    # -- acceptance -----------------------------------------------------------------------------
    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        for j in range(drafted):
            self._drafted[j] = self._drafted[j] * self.decay + 1.0
            self._accepted[j] = self._accepted[j] * self.decay + float(j < accepted)
            if accepted >= j:  # slot j + 1 was reached: every slot before it accepted
                reached, passed = self._delivered[j]
                self._delivered[j] = [reached * self.decay + 1.0, passed * self.decay + float(accepted > j)]

    def reset_acceptance(self) -> None:
        """Forget every acceptance observation: the prior alone again (costs are kept). At start-up,
        and after a warm-up, whose few steps on a greeting are not the traffic that follows."""
        self._drafted = [0.0] * (self.block_size - 1)
        self._accepted = [0.0] * (self.block_size - 1)
        self._delivered = [[0.0, 0.0] for _ in range(self.block_size - 1)]

    def _forget(self, rows: int) -> None:
        """Age the acceptance evidence by a plain step's row-steps, as if they had been observed.
        Acceptance is only learned from drafting steps; without this, one stretch of unpredictable
        text (a chat answer) would pin the estimate low for every later request, and a
        re-exploration probe adds too little evidence to move it. As old evidence fades the estimate
        returns towards its prior -- slot 1's acceptance as this drafter has delivered it, or `prior`
        if that is lower (see :meth:`position_acceptance`) -- the policy drafts again if that pays,
        and fresh observations decide."""
        f = self.forget ** rows
        self._drafted = [d * f for d in self._drafted]
        self._accepted = [a * f for a in self._accepted]

    def position_acceptance(self) -> list[float]:
        """Estimated P(a >= j) for j = 1..block_size-1, non-increasing.

        Each position's evidence is blended with a prior worth `prior_weight` steps. For slot 1 that
        prior is the acceptance this drafter has delivered (every observation, decayed as observed but
        never aged by plain streaks), or `prior` where that is lower or unknown; for each later slot,
        the slot before it times a conditional acceptance: the one this drafter delivered at that slot
        (as slot 1's, never aged by plain streaks), blended towards the one seen at the slot before
        (P(a >= j-1) / P(a >= j-2)), which alone stands where the slot was never reached. So after a
        plain streak a lucky k = 1 probe does not price slot 7 at slot 1's rate (k = 7 was drafted at 16
        rows for 4 plain steps, stop 53). A slot never reached extends the measured slots geometrically, rather
        than falling to prior ** j: with a fixed 0.5 ** j, a policy that settled on k = 1 priced k = 3
        at 1.86 tokens where it brings 2.16, and never drafted it again (AVX2, C = 1, issue 44). And a
        plain streak returns the estimate to what the drafter delivers, not to 0.5: with 0.5, after a
        streak k = 3 read 1.77 tokens where the drafter brings ~2.07 (AVX2, C = 4, stop 51)."""
        delivered_drafts, delivered_accepts = self._delivered[0]
        # blended with `prior` like every slot's evidence: one lucky first step is not a 100% drafter
        delivered = (delivered_accepts + self.prior_weight * self.prior) / (delivered_drafts + self.prior_weight)
        # never below `prior`: one unpredictable stretch must not keep the policy from drafting again
        first = max(self.prior, delivered)
        out, prev, conditional = [], 1.0, first
        for j, (d, a) in enumerate(zip(self._drafted, self._accepted)):
            if j:  # the conditional this drafter delivered at this slot, blended towards the running one
                reached, passed = self._delivered[j]
                conditional = (passed + self.prior_weight * conditional) / (reached + self.prior_weight)
            p = min(prev, (a + self.prior_weight * prev * conditional) / (d + self.prior_weight))
            conditional = p / prev if prev > 0 else 0.0
            out.append(p)
            prev = p
        return out

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.position_acceptance()[:k])

    def draft_lengths(self, k_max: int) -> set[int]:
        return {min(k, k_max) for k in self.candidates or (0,)}

    # -- costs ----------------------------------------------------------------------------------
    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        if batch > 0 and k in (self.candidates or ()):
            self.costs.observe(batch, k, seconds)

    def _needs_measurement(self, batch: int, k: int, q: list[float]) -> bool:
        """Whether to spend a step measuring cost(batch, k) before trusting the table.

        Below or between measured batch sizes the table's estimate is trusted: at fewer rows a
        step is relatively cheaper for speculation, so carrying over the larger batch's cost ratio
        errs towards plain decoding. Only growth past `explore_growth` x the largest measured batch
        needs a new measurement, and not even then for a k that already failed to pay at a smaller
        batch: speculation's relative cost only rises with rows (verification turns compute-bound).
        Exploring k = 15 at a new batch size costs several plain steps, so this matters."""
        row = self.costs.table.get(k, {})
        if not row:
            return not self._cannot_pay(batch, k, q)
        if batch <= max(row) * self.explore_growth:
            return False
        if k == 0:  # the baseline every draft length is compared with
            return True
        gain = 1.0 + sum(q[:k])
        if any(r >= gain for r in self.costs.ratios.get(k, {}).values()):
            return False
        return not self._cannot_pay(batch, k, q)

    def _ratio_floor(self, batch: int, k: int) -> float | None:
        """The least cost(batch, k) / plain a draft length k can have, given the shorter positive ones
        measured (ratios at this batch; carried over from fewer rows they are lower still, so the floor
        stays a floor). A longer draft costs at least what a shorter one does, and past the first draft
        token the step cost is convex in k -- flat while memory-bound, linear once compute-bound --
        so it grows at least along the secant of the two longest shorter drafts k1 < k2:
        cost(k) >= r2 + (k - k2) (r2 - r1) / (k2 - k1). (Not from k = 0: drafting at all has a fixed
        cost, the drafter's pass; on one CPU core at one row k = 1, 3 and 7 cost 1.22, 1.25 and 1.33
        plain steps.) None when no shorter draft was measured."""
        shorter = sorted(kk for kk in self.costs.ratios if 0 < kk < k)
        ratios = [(kk, r) for kk in shorter if (r := self.costs.ratio(batch, kk)) is not None]
        if not ratios:
            return None
        floor = max(r for _, r in ratios)  # a shorter draft measured at more rows may read higher
        if len(ratios) >= 2:
            (k1, r1), (k2, r2) = ratios[-2:]
            floor = max(floor, r2 + (k - k2) * (r2 - r1) / (k2 - k1))
        return floor

    def _cannot_pay(self, batch: int, k: int, q: list[float]) -> bool:
        """Whether draft length k is ruled out here without spending a step on it: even at its cost
        floor (:meth:`_ratio_floor`) its expected tokens miss the margin over plain decoding. At 16
        rows on the 2-core CPU k = 1 and 3 cost 1.64 and 2.5 plain steps; exploring 7 and 15 there
        too spent ~11 more plain steps per request (bench, issue 44)."""
        floor = self._ratio_floor(batch, k)
        return floor is not None and (1.0 + sum(q[:k])) / floor < 1.0 + self.margin

    def _plain_cost_stale(self, batch: int, best: Decision, plain: float) -> bool:
        """Whether this drafting step should decode plainly instead, to re-measure the plain cost
        that drafting's cost ratio is sampled against (see `refresh_plain_every`)."""
        if not self.refresh_plain_every:
            return False
        age = self.costs.plain_age(batch)
        if age is not None and age < self.refresh_plain_every:
            return False
        gain = best.est_tokens_per_s / (batch / plain)
        return gain < (1 + self.margin) * self.refresh_band

    # -- the choice -----------------------------------------------------------------------------
    def choose(self, batch: int, k_max: int, can_shadow: bool = False) -> Decision:
        q = self.position_acceptance()
        probe, self._probe_again = min(self._probe_again, k_max), 0
        # a probe's second step at the rows it was chosen for, or fewer; not after the batch grew (a
        # burst's last rows probed k = 7 and the next burst's first step drafted 7 at 16 rows, stop 53)
        if probe > 0 and batch <= self._probed_at:
            # A probe's first step drafts over the plain streak's commits too, so the runtime does
            # not time it (BatchedRuntime.step); the second step gives a clean cost measurement.
            d = Decision(batch, probe, 1.0 + sum(q[:probe]), reason="re-explore, second step: measure the cost")
            self.decisions.append(d)
            return d
        ks = sorted({min(k, k_max) for k in self.candidates or ()})
        if self.explore:  # measure a candidate online when the table cannot vouch for its cost here
            unmeasured = [k for k in ks if k in (self.candidates or ()) and self._needs_measurement(batch, k, q)]
            if unmeasured:
                d = Decision(batch, unmeasured[0], 1.0 + sum(q[: unmeasured[0]]), reason="explore: measuring cost")
                self.decisions.append(d)
                return d
        best: Decision | None = None
        best_drafting: Decision | None = None
        plain = self.costs.estimate(batch, 0)
        for k in ks:
            cost = self.costs.estimate(batch, k)
            if cost is None or cost <= 0:
                continue
            floor = self._ratio_floor(batch, k) if k > 0 and plain else None
            if floor is not None:  # a ratio carried over from fewer rows may be below what k costs here
                cost = max(cost, floor * plain)
            e = 1.0 + sum(q[:k])
            d = Decision(batch, k, e, cost, batch * e / cost)
            bar = 1 + (self.margin if best is not None and best.k == 0 else 1e-9)
            if best is None or d.est_tokens_per_s > best.est_tokens_per_s * bar:
                best = d
            if k > 0 and (best_drafting is None or d.est_tokens_per_s > best_drafting.est_tokens_per_s):
                best_drafting = d
        if best is not None and best.k == 0:
            self._plain_streak += 1
            self._forget(batch)
        else:
            self._plain_streak = 0  # this step's acceptance is fresh evidence: the streak starts again
            # The probe wait returns to its base only when drafting pays at as many rows as the last
            # probe found it did not: the traffic changed. Drafting that pays because the batch shrank
            # (a burst's last rows) says nothing new there; resetting on it re-probed a 16-row batch at
            # every burst's 64th step, ~1.4% of a 127-step run (bench, C = 16, stop 53).
            if batch >= self._probed_at:
                self._reexplore_interval, self._probed_at = self.reexplore_every, 0
        if best_drafting is not None and self.reexplore_every and self._plain_streak > self._reexplore_interval:
            if can_shadow and best is not None:  # best.k == 0 here: decode plainly, one row drafts unverified
                self._plain_streak = 0
                best.shadow = max(ks)  # one pass drafts the whole block: grade every slot
                best.reason = (f"re-explore after {self._reexplore_interval} plain steps: {best.shadow} drafts on "
                               "one row, graded by plain decoding")
                self.decisions.append(best)
                return best
            best_drafting.reason = f"re-explore after {self._reexplore_interval} plain steps: refresh acceptance"
            self._plain_streak = 0
            # each probe that finds plain decoding still best doubles the wait (up to 16x), so a
            # drafter that never pays costs a vanishing fraction of steps
            self._reexplore_interval = min(2 * self._reexplore_interval, 16 * self.reexplore_every)
            self._probe_again = best_drafting.k
            self._probed_at = batch
            self.decisions.append(best_drafting)
            return best_drafting
        if best is not None and best.k > 0 and plain and self._plain_cost_stale(batch, best, plain):
            best = Decision(batch, 0, 1.0, plain, batch / plain,
                            reason=f"refresh the plain cost: {self.refresh_plain_every}+ steps old at a narrow gain")
            self.decisions.append(best)
            return best
        if best is None:  # nothing measured yet: speculate fully (the reference loop's choice)
            best = Decision(batch, min(max(self.candidates or [0]), k_max), 1.0 + sum(q[:k_max]), math.nan, math.nan,
                            reason="no cost estimate")
        else:
            best.reason = "max est_tokens_per_s"
        self.decisions.append(best)
        log.debug("policy: %s", best)
        return best

    def summary(self) -> dict:
        """The policy's state: what `dflash-trt`'s stats and the benchmark print."""
        counts: dict[int, int] = {}
        for d in self.decisions:
            counts[d.k] = counts.get(d.k, 0) + 1
        return {
            "policy": "adaptive",
            "candidates": list(self.candidates or ()),
            "position_acceptance": [round(p, 4) for p in self.position_acceptance()],
            "step_cost_s": self.costs.to_dict(),
            "step_cost_vs_plain": self.costs.ratios_dict(),
            "recent_k_counts": {str(k): v for k, v in sorted(counts.items())},
            "last_decision": self.decisions[-1].to_dict() if self.decisions else None,
        }


def make_policy(settings: "SpeculationSettings") -> SpeculationPolicy:
    """The policy `settings` names: fixed (k = K every step), adaptive (candidates up to K) or
    schedule (k from the draft-length schedule at the step's batch size)."""
    if settings.policy == "schedule":
        assert settings.schedule is not None  # SpeculationSettings refuses a schedule policy without one
        return SchedulePolicy(settings.schedule)
    if settings.policy == "adaptive":
        return AdaptivePolicy(settings.block_size, candidates=default_candidates(settings.max_draft_len))
    return FixedPolicy(settings.max_draft_len)
