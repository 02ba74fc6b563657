"""The acceptance gate's sequential test: a group-sequential design with alpha spending, whose
error rates hold however many of its planned looks are taken.

The gate tests a relative tau drop theta against a limit d (gate.max_tau_drop) with two one-sided
tests, looking at the data after each planned look k = 1..L (each look decodes a wave of new
prompts; engine/gate_looks.py):

- PASS at look k when the upper end of the look's interval is <= d: rejects "theta >= d";
- FAIL at look k when its lower end is > d: rejects "theta <= d";
- otherwise go on to look k + 1; after look L (or when the time budget or the prompts run out
  first) the gate is INCONCLUSIVE and says which setting buys more evidence.

Error rates, stated: P(pass | theta >= d) <= alpha and P(fail | theta <= d) <= alpha with
alpha = 2.5% each side (a single look is the two-sided 95% interval the gate always used),
whatever the data and whenever the gate stops.

The design (Jennison & Turnbull, "Group Sequential Methods", 2000, ch. 7 and 11). Each one-sided
test spends its alpha over the looks by the Lan-DeMets Pocock-type function
f(t) = alpha ln(1 + (e - 1) t), t = the look's prompts over the planned total (known before any
look: from the wave size, the planned looks and how many prompts the source has). Look k's
boundary c_k is exact for the canonical joint law of the looks' z statistics (independent
increments: each look adds new prompts, the independent units): P(no crossing before k, crossing
at k) = f(t_k) - f(t_{k-1}) under theta = d, computed by numerical integration (`boundaries`).
The look's interval is then its estimate +- t_{1 - p_k, n_k - 1} x se with p_k = 1 - Phi(c_k), the
nominal level of the boundary (J & T 11.4's "significance level approach" for an estimated
variance). Pocock-type spending puts nearly the same boundary on every look (2.37 on each of 4
looks, against 1.96 for one look): a clear case decides at look 1, and a gate cut short by its
budget has spent most of its alpha on the looks it took. Measured by simulation at the embedded
pair's noise (look 1's 95% interval +-6 points; tests/test_gate_sequential.py): a drop AT the
limit passes 2.5% and fails 2.5% of the time with 4 looks; a drop of 2% passes 100% of the time in
1.3 looks on average, 5%: 93% within 4 looks, 6%: 79%.

Why it holds: each one-sided test ignores the other's stopping (non-binding: stopping for the
other reason can only remove crossings), looks not taken leave their alpha unspent (a decision,
the budget or the prompts ended the gate first), and the information fractions never depend on
the data. What it assumes: the look's estimate is approximately normal with its estimated
standard error (the delta method over >= ~20 prompts; on the log scale, where the ratio is nearly
symmetric) and the prompts are exchangeable units. Re-running a build that ended inconclusive
with a larger budget is a new experiment: its error rates are its own.
"""

from __future__ import annotations

import functools
import math
import statistics
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


SpendingName = Literal["pocock", "obrien-fleming"]


def spending(name: SpendingName, t: float, alpha: float) -> float:
    """Alpha spent by information fraction t in [0, 1] (Lan & DeMets 1983): "pocock"
    alpha ln(1 + (e - 1) t), the gate's; "obrien-fleming" 2 - 2 Phi(z_{1-alpha/2} / sqrt(t)), which
    spends almost nothing early (kept to check the boundaries against published tables)."""
    t = min(max(t, 0.0), 1.0)
    if t == 0.0:
        return 0.0
    if name == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    z = _N.inv_cdf(1 - alpha / 2)
    return 2 * (1 - _N.cdf(z / math.sqrt(t)))


_N = statistics.NormalDist()


@functools.lru_cache(maxsize=64)
def boundaries(fractions: tuple[float, ...], alpha: float, name: SpendingName, grid: int = 801) -> tuple[float, ...]:
    """One-sided group-sequential boundaries c_1..c_L on the z scale for looks at information
    fractions t_1 < ... < t_L (= 1 for the planned last look): under the null, with independent
    increments (each look adds new prompts), P(Z_1 < c_1, ..., Z_{k-1} < c_{k-1}, Z_k >= c_k) is
    exactly the alpha spent at look k, f(t_k) - f(t_{k-1}).

    The recursion of Armitage, McPherson & Rowe (1969) on W(t) = Z sqrt(t), Brownian motion: the
    sub-density of W at look k on the region not yet crossed, carried on a grid from 10 standard
    deviations below zero to the boundary, each c_k found by bisection on the look's crossing
    probability (Jennison & Turnbull 2000, ch. 19)."""
    import torch  # float64 on the CPU: a few hundred grid points, milliseconds

    out: list[float] = []
    prev_t, spent = 0.0, 0.0
    w = weights = None  # grid of W at the last look, and its sub-density times the grid spacing
    for t in fractions:
        target = spending(name, t, alpha) - spent
        spent += target
        if w is None:  # W(t_1) ~ N(0, t_1): the crossing probability is the normal tail
            c = _N.inv_cdf(1 - target)
        else:
            step = math.sqrt(t - prev_t)
            lo, hi = -10.0, 20.0
            for _ in range(60):  # crossing(c) = sum_w weights(w) P(W(t) >= c sqrt(t) | w) falls with c
                mid = (lo + hi) / 2
                crossing = float((weights * torch.special.ndtr((w - mid * math.sqrt(t)) / step)).sum())
                lo, hi = (mid, hi) if crossing > target else (lo, mid)
            c = (lo + hi) / 2
        new_w = torch.linspace(-10 * math.sqrt(t), c * math.sqrt(t), grid, dtype=torch.float64)
        h = float(new_w[1] - new_w[0])
        trapezoid = torch.full((grid,), h, dtype=torch.float64)
        trapezoid[0] = trapezoid[-1] = h / 2
        if w is None:
            dens = torch.exp(-new_w**2 / (2 * t)) / math.sqrt(2 * math.pi * t)
        else:  # the density of W(t) below the boundary: the last look's, convolved with N(0, t - t_prev)
            kernel = torch.exp(-((new_w[:, None] - w[None, :]) ** 2) / (2 * step**2)) / (math.sqrt(2 * math.pi) * step)
            dens = kernel @ weights
        w, weights = new_w, dens * trapezoid
        out.append(c)
        prev_t = t
    return tuple(out)


@dataclass(frozen=True)
class SequentialDesign:
    """Planned looks at information fractions `fractions` (each look's prompts over the planned
    total; the last is 1), the error rate `alpha` of each one-sided test, spent over them by the
    spending function `spending_name`."""

    fractions: tuple[float, ...]
    alpha: float = ALPHA
    spending_name: SpendingName = "pocock"

    def __post_init__(self) -> None:
        if not self.fractions or any(b <= a for a, b in zip(self.fractions, self.fractions[1:])):
            raise ValueError(f"a sequential design needs increasing information fractions, got {self.fractions}")
        if self.fractions[0] <= 0 or abs(self.fractions[-1] - 1.0) > 1e-12:
            raise ValueError(f"information fractions must lie in (0, 1] and end at 1, got {self.fractions}")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {self.alpha}")

    @classmethod
    def equal(cls, looks: int, alpha: float = ALPHA, spending_name: SpendingName = "pocock") -> SequentialDesign:
        """`looks` looks, each adding the same information."""
        if looks < 1:
            raise ValueError(f"a sequential design needs at least one look, got {looks}")
        return cls(tuple((k + 1) / looks for k in range(looks)), alpha, spending_name)

    @property
    def looks(self) -> int:
        return len(self.fractions)

    def spent(self, look: int) -> float:
        """Alpha spent by the end of look `look` (0: none)."""
        return spending(self.spending_name, self.fractions[look - 1], self.alpha) if look else 0.0

    def level(self, look: int) -> float:
        """Look `look`'s nominal one-sided level: 1 - Phi(c_k) of its exact boundary (1-based)."""
        if not 1 <= look <= self.looks:
            raise ValueError(f"look {look} is not one of the design's 1..{self.looks}")
        return 1 - _N.cdf(boundaries(self.fractions, self.alpha, self.spending_name)[look - 1])

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
