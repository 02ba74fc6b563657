"""The interactivity / throughput frontier's maths (bench/frontier.py) on hand-made points whose
answers are worked out by hand in the comments: the Pareto front, the highest throughput at >= X
tokens/s per user (measured, interpolated linearly in log2 C between the two levels that bracket
X, never beyond the measured levels), a mode that never reaches X, and the run-level object with
its per-GPU division and DFlash / plain ratio."""

from __future__ import annotations

import math

import pytest

from dflash_trt.bench.frontier import Point, at_lines, best_at, frontier, pareto_front

# a plain-decoding-like series: more users, more throughput, each user slower
SERIES = [Point(1, 50.0, 50.0), Point(2, 45.0, 90.0), Point(4, 30.0, 120.0), Point(8, 20.0, 118.0)]


def test_pareto_front_drops_what_another_point_beats_on_both_axes():
    # C=8 (20, 118) is beaten by C=4 (30, 120) on both axes; the other three each win on one axis
    assert [p.concurrency for p in pareto_front(SERIES)] == [4, 2, 1]
    # equal interactivity, less throughput: beaten; an exact duplicate beats neither copy
    tie = [Point(1, 40.0, 10.0), Point(2, 40.0, 20.0), Point(4, 40.0, 20.0)]
    assert [p.concurrency for p in pareto_front(tie)] == [2, 4]


def test_a_measured_level_that_reaches_x():
    r = best_at(SERIES, 30.0)  # C=4 reaches 30 exactly (>=); its crossing towards C=8 starts at C=4 itself
    assert (r.throughput, r.concurrency, r.how, r.below_all) == (120.0, 4.0, "measured", False)


def test_between_two_levels_linear_in_log2_c():
    # X=40 lies between C=2 (45) and C=4 (30): t = (45 - 40) / (45 - 30) = 1/3 of the way in log2 C,
    # so C = 2 ** (1 + 1/3) and throughput = 90 + (120 - 90) / 3 = 100 (> 90 measured at C=2)
    r = best_at(SERIES, 40.0)
    assert r.how == "interpolated"
    assert r.throughput == pytest.approx(100.0)
    assert r.concurrency == pytest.approx(2 ** (4 / 3))


def test_never_reaches_and_every_level_reaches():
    r = best_at(SERIES, 60.0)  # above every measured level: nothing is extrapolated
    assert (r.throughput, r.concurrency, r.how) == (None, None, "never")
    assert (r.best_interactivity, r.best_interactivity_concurrency) == (50.0, 1)
    r = best_at(SERIES, 10.0)  # below every level: the best measured throughput, flagged
    assert (r.throughput, r.concurrency, r.how, r.below_all) == (120.0, 4.0, "measured", True)


def test_a_noisy_sweep_takes_the_best_crossing():
    # interactivity dips at C=2 and recovers at C=4: three crossings of X=40 (C=1..2, 2..4, 4..8);
    # the last one is best: t = (41 - 40) / (41 - 21) = 0.05 -> 100 + 0.05 * (160 - 100) = 103
    noisy = [Point(1, 50.0, 40.0), Point(2, 38.0, 70.0), Point(4, 41.0, 100.0), Point(8, 21.0, 160.0)]
    r = best_at(noisy, 40.0)
    assert r.how == "interpolated" and r.throughput == pytest.approx(103.0)
    assert r.concurrency == pytest.approx(2 ** 2.05)
    with pytest.raises(ValueError):
        best_at([], 1.0)


def _row(side: str, mode: str, c: int, tpot_s: float, total: float) -> dict:
    return {"side": side, "label": f"{side} label", "mode": mode, "concurrency": c, "tpot_s": {"mean": tpot_s},
            "total_tokens_per_s": total}


def test_run_frontier_per_gpu_and_the_ratio():
    # DFlash: 1/TPOT = 100, 80, 50 at C = 1, 2, 4; plain: 50, 40, 25; throughputs over 2 GPUs
    rows = [_row("endpoint", "dflash", 1, 0.010, 100.0), _row("endpoint", "dflash", 2, 0.0125, 160.0),
            _row("endpoint", "dflash", 4, 0.020, 200.0), _row("endpoint", "plain", 1, 0.020, 50.0),
            _row("endpoint", "plain", 2, 0.025, 80.0), _row("endpoint", "plain", 4, 0.040, 100.0)]
    front = frontier({"rows": rows}, 2, "--gpus", [45.0, 90.0, 200.0])
    dflash = next(s for s in front["series"] if s["mode"] == "dflash")
    assert [(p["concurrency"], p["interactivity"], p["throughput"]) for p in dflash["points"]] == [
        (1, pytest.approx(100.0), 50.0), (2, pytest.approx(80.0), 80.0), (4, pytest.approx(50.0), 100.0)]
    assert all(p["pareto"] for p in dflash["points"])
    at45, at90, at200 = front["at"]
    # X=45: DFlash reaches it at every level -> 100 per GPU at C=4; plain: between C=1 (50) and C=2 (40),
    # t = 0.5 -> 25 + 0.5 * (40 - 25) = 32.5 per GPU; ratio 100 / 32.5
    assert at45["dflash"]["throughput"] == 100.0 and at45["dflash"]["below_all"]
    assert at45["plain"]["throughput"] == pytest.approx(32.5) and at45["plain"]["how"] == "interpolated"
    assert at45["dflash_over_plain"] == pytest.approx(100.0 / 32.5)
    # X=90: plain never gets there (best 50 at C=1): DFlash alone, no ratio
    assert at90["plain"]["how"] == "never" and at90["dflash_over_plain"] is None
    assert at90["dflash"]["throughput"] == pytest.approx(50.0 + 0.5 * 30.0)  # C=1 (100) .. C=2 (80), t = 0.5
    assert at200["dflash"]["how"] == at200["plain"]["how"] == "never"
    text = "\n".join(at_lines(front))
    assert "plain never reaches it (its best: 50.0 tokens/s per user at C=1)" in text
    assert "DFlash/plain 3.08x" in text and "linear in log2(C)" in text and "tok/s per GPU" in text
    # an unknown GPU count leaves the throughput per server, and says so
    assert frontier({"rows": rows}, None, "unknown")["throughput"].startswith("total tokens/s per server")
    assert math.isclose(frontier({"rows": rows}, None, "unknown")["series"][0]["points"][0]["throughput"], 100.0)
