"""The acceptance gate's sequential test: a group-sequential design whose error rates hold however
many of its planned looks are taken.

The gate tests a relative tau drop theta against a limit d (gate.max_tau_drop) with two one-sided
tests, looking at the data after each planned look k = 1..L (each look decodes more: new prompts
or longer answers):

- PASS at look k when the upper end of the look's interval is <= d: rejects "theta >= d";
- FAIL at look k when its lower end is > d: rejects "theta <= d";
- otherwise go on to look k + 1; after look L (or when the time budget runs out first) the gate
  is INCONCLUSIVE and says which setting buys more evidence.

Error rates, stated: P(pass | theta >= d) <= alpha and P(fail | theta <= d) <= alpha, alpha = 2.5%
each side (a single look is the two-sided 95% interval the gate always used), whatever the data
and whenever the gate stops.

How. Alpha spending (Lan & DeMets 1983): a spending function f with f(0) = 0, f(1) = alpha gives
look k the nominal one-sided level alpha_k = f(k/L) - f((k-1)/L), and look k's interval is the
two-sided (1 - 2 alpha_k) interval of its own estimate (Student t with the look's n - 1 degrees
of freedom). f is the Pocock-type function alpha * ln(1 + (e - 1) t): it spends early, so a clear
case (a drop far from the limit) decides at the first look at nearly the single-look width.
Each look's levels add up by the union bound (Bonferroni): a false pass needs some look k to pass
falsely, which has probability <= alpha_k, so P(false pass) <= sum alpha_k = f(1) = alpha. The
bound needs nothing about how the looks' estimates depend on each other, which is why it is used
here rather than boundaries from the joint normal law of group-sequential theory (Jennison &
Turnbull 2000): that law assumes each look adds independent units (new prompts), and a look that
extends the same prompts' answers does not. What the union bound gives away is small with few
looks (the exact boundaries would be a few percent narrower: 2.5% spent over 4 looks; with
estimates correlated as a look's tokens nest in the next one's, the realized error is ~1.5%,
tests/test_gate_sequential.py). Looks not taken (the budget ran out, a decision came
first) leave their alpha unspent: stopping early never inflates the error.

What the error rates assume: each look's interval is valid for the drop over that look's sample
(prompts as the independent units, as in dflash_trt.engine.gate); a look that extends the
answers measures the drop over longer answers, and the pass guarantee is for "the drop exceeds
d at every look's length". Re-running a build that ended inconclusive with a larger budget is a
new experiment: its error rates are its own, not shared with the one before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

ALPHA = 0.025  # each side: a single look is the two-sided 95% interval

Decision = Literal["pass", "fail", "continue"]


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom, exact: the finite series of
    Abramowitz & Stegun 26.7.3-4 in theta = arctan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd
        total, term = 0.0, 1.0
        for j in range(1, (df - 1) // 2 + 1):  # 1 + (2/3) c2 + (2*4)/(3*5) c2^2 + ...
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        a = 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    else:
        total, term = 0.0, 1.0
        for j in range(1, df // 2 + 1):  # 1 + (1/2) c2 + (1*3)/(2*4) c2^2 + ...
            total += term
            term *= c2 * (2 * j - 1) / (2 * j)
        a = s * total
    return 0.5 + a / 2


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p in (0, 1)), the exact t_cdf inverted by bisection to 1e-12."""
    if df <= 0:
        return math.inf
    if not 0 < p < 1:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def pocock_spending(t: float, alpha: float) -> float:
    """Lan-DeMets Pocock-type spending: the alpha spent by information fraction t in [0, 1]."""
    t = min(max(t, 0.0), 1.0)
    return alpha * math.log(1 + (math.e - 1) * t)


@dataclass(frozen=True)
class SequentialDesign:
    """`looks` planned looks, equally spaced in information (each adds the same decoding), and the
    error rate `alpha` of each one-sided test, spent over them."""

    looks: int
    alpha: float = ALPHA

    def __post_init__(self) -> None:
        if self.looks < 1:
            raise ValueError(f"a sequential design needs at least one look, got {self.looks}")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {self.alpha}")

    def spent(self, look: int) -> float:
        """Alpha spent by the end of look `look` (0: none)."""
        return pocock_spending(look / self.looks, self.alpha)

    def level(self, look: int) -> float:
        """Look `look`'s nominal one-sided level alpha_k (1-based)."""
        if not 1 <= look <= self.looks:
            raise ValueError(f"look {look} is not one of the design's 1..{self.looks}")
        return self.spent(look) - self.spent(look - 1)

    def confidence(self, look: int) -> float:
        """The two-sided confidence of look `look`'s interval."""
        return 1 - 2 * self.level(look)

    def describe(self) -> str:
        return (f"group-sequential, {self.looks} planned look{'s' if self.looks > 1 else ''}, "
                f"{self.alpha:.1%} error each side")


@dataclass(frozen=True)
class Look:
    """One look's estimate of the drop, its interval at the look's level, and what it decides."""

    look: int
    looks: int
    estimate: float
    low: float
    high: float
    confidence: float
    decision: Decision


def decide_look(design: SequentialDesign, look: int, estimate: float, se: float, df: int, limit: float) -> Look:
    """The decision at look `look` on an estimate with standard error `se` (df degrees of freedom)
    against `limit`: pass when the interval lies at or below it, fail when above, else continue."""
    half = t_quantile(1 - design.level(look), df) * se if se > 0 else 0.0
    low, high = estimate - half, estimate + half
    decision: Decision = "pass" if high <= limit else "fail" if low > limit else "continue"
    return Look(look, design.looks, estimate, low, high, design.confidence(look), decision)
