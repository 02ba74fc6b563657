"""The acceptance gate's statistics and decisions (dflash_trt.engine.gate), on synthetic samples.

The end-to-end refusals run in test_build_gptoss.py (a mismatched drafter) and, on the embedded
pair, in test_build_engine.py's slow tests.
"""

from __future__ import annotations

import math
import random

import pytest

from dflash_trt.engine.gate import TauSample, check_fit, decide, describe, drop_interval, t_quantile
from dflash_trt.errors import DFlashError


def _sample(committed: list[int], steps: list[int]) -> TauSample:
    s = TauSample()
    for c, n in zip(committed, steps):
        s.add(c, n, drafted=n * 7, accepted=c - n)
    return s


@pytest.mark.parametrize("df,table", [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042),
                                      (120, 1.980)])
def test_t_quantile_matches_the_printed_table(df, table):
    # two-sided 95% values of Student's t as printed in every statistics table
    assert t_quantile(0.975, df) == pytest.approx(table, abs=0.03 if df == 3 else 0.005 if df < 7 else 0.002)


def test_tau_interval_by_hand():
    s = _sample([30, 20, 40], [10, 10, 10])  # per-prompt tau 3, 2, 4
    assert s.tau == 3.0
    # z_i = (c_i - tau s_i) / mean(s) = 0, -1, 1 -> sd 1; half width t(0.975, 2) / sqrt(3)
    lo, hi = s.interval()
    half = 4.302652729911275 / math.sqrt(3)
    assert (lo, hi) == pytest.approx((3 - half, 3 + half), rel=1e-9)
    assert s.summary()["acceptance_rate"] == pytest.approx(60 / 210)


def test_paired_drop_cancels_prompt_to_prompt_variation():
    before = _sample([30, 20, 40, 25], [10, 10, 10, 10])
    same = drop_interval(before, _sample([30, 20, 40, 25], [10, 10, 10, 10]))
    assert same == (0.0, 0.0, 0.0)
    # the same 20% drop on every prompt: known exactly, however much the prompts differ
    drop, lo, hi = drop_interval(before, _sample([24, 16, 32, 20], [10, 10, 10, 10]))
    assert (drop, lo, hi) == pytest.approx((0.2, 0.2, 0.2), abs=1e-12)
    # uneven drops widen it
    drop, lo, hi = drop_interval(before, _sample([30, 12, 40, 20], [10, 10, 10, 10]))
    assert lo < drop < hi and drop == pytest.approx(1 - 102 / 115)


def test_interval_covers_the_true_tau_95_percent_of_the_time():
    """Monte Carlo: 24 prompts whose own tau is uniform on [1.5, 3.5] and whose step counts vary;
    the true tau (ratio of expectations) is 2.5. The 95% interval must cover it ~95% of runs."""
    rng = random.Random(0)
    runs, covered = 2000, 0
    for _ in range(runs):
        s = TauSample()
        for _ in range(24):
            steps = rng.randint(20, 40)
            s.add(round(steps * rng.uniform(1.5, 3.5)), steps, 0, 0)
        lo, hi = s.interval()
        covered += lo <= 2.5 <= hi
    assert 0.93 <= covered / runs <= 0.97


def test_decide_passes_fails_or_is_inconclusive_on_the_interval():
    before = _sample([30, 20, 40, 25, 35, 28], [10] * 6)
    small = _sample([29, 20, 39, 24, 34, 28], [10] * 6)  # ~2.8% drop, narrow
    rec = decide(before, small, "fp8", 0.10, False, 1.2)
    assert rec["decision"] == "pass" and rec["relative_drop_high"] <= 0.10
    line = describe(rec, "fp8")
    assert line.startswith("acceptance gate passed at look 1 of 1 (6 prompts): tau 2.967 ") and "\n" not in line
    assert "(95.0% interval, 2.5% error each side over 1 look) within the 10% limit" in line

    big = _sample([20, 13, 27, 17, 23, 19], [10] * 6)  # ~1/3 drop everywhere
    with pytest.raises(DFlashError, match=r"acceptance gate failed at look 1 of 1 \(6 prompts\): tau 2\.967 .* "
                                          r"past the 10% limit; choose a milder recipe"):
        decide(before, big, "nvfp4", 0.10, False, 1.2)
    rec = decide(before, big, "nvfp4", 0.10, True, 1.2)
    assert rec["decision"] == "fail" and rec["accepted_by_flag"]

    noisy = _sample([30, 14, 40, 25, 35, 22], [10] * 6)  # ~8% drop, uneven: interval straddles 10%
    drop, lo, hi = drop_interval(before, noisy)
    assert lo < 0.10 < hi
    with pytest.raises(DFlashError, match="inconclusive.*--gate-prompts"):
        decide(before, noisy, "fp8", 0.10, False, 1.2)
    # every prompt of the source decoded already: asking for more prompts would not help
    with pytest.raises(DFlashError, match="inconclusive.*every gate prompt was decoded: decode longer answers "
                                          "\\(--gate-tokens.*gate.prompts"):
        decide(before, noisy, "fp8", 0.10, False, 1.2, prompts_left=False)


def test_check_fit_refuses_a_drafter_whose_tau_is_surely_near_one():
    with pytest.raises(DFlashError, match=r"does not fit this target: unquantized tau 1\.000 \[1\.000, 1\.000\]"):
        check_fit(_sample([10, 12, 11], [10, 12, 11]), 1.2)
    rec = check_fit(_sample([30, 28, 32, 29], [10, 10, 10, 10]), 1.2)
    assert rec["fits"] and rec["confident"]
    # tau 1.15 on average but an interval reaching past 1.2: not refused on a point estimate
    rec = check_fit(_sample([10, 14, 10, 12], [10, 10, 10, 10]), 1.2)
    assert rec["fits"] and not rec["confident"]
