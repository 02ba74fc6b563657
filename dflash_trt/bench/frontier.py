"""The interactivity / throughput frontier of a bench run: NVIDIA's way of quoting speculation.

NVIDIA's headline for DFlash is a throughput at a fixed interactivity ("more than 15x the
throughput of autoregressive decoding at 500-600 tokens/s per user"). Each (side, mode, C) row of
a sweep is one point of that chart:

- x, ``interactivity``: 1 / mean TPOT (dflash_trt.metrics.interactivity), the per-user output speed
  of NVIDIA's charts. TTFT and queueing stay out: a closed loop of C users inflates both with C
  whatever the decoding does.
- y, throughput: total tokens/s of all users, per GPU where the GPU count is known (in process:
  one device, a CPU's "per device"; a server: ``--gpus`` or the engine manifest's tp x pp), else
  per server.

Raising C trades interactivity for throughput; the **Pareto front** is the set of points no
other point of the same series beats on both axes. ``best_at(points, X)`` answers "the highest
throughput at >= X tokens/s per user": every measured level that reaches X, and between two
consecutive measured levels C_a < C_b that bracket X (one reaches it, the other does not) the
point where interactivity crosses X, with interactivity and throughput both linear in log2 C
between them (:data:`INTERPOLATION`). Nothing is extrapolated past the measured levels: a mode
none of whose levels reaches X never reaches it, and where every level reaches X the answer is
the best measured one, flagged (a higher C, not measured, may do better).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dflash_trt.metrics import interactivity

INTERPOLATION = ("linear in log2(C) between the two measured concurrency levels that bracket X (interactivity "
                 "and throughput both), never beyond the measured levels")
INTERACTIVITY = "1 / mean TPOT (tokens/s per user as the answer flows; TTFT and queueing left out)"


@dataclass(frozen=True)
class Point:
    concurrency: int
    interactivity: float  # tokens/s per user: 1 / mean TPOT
    throughput: float  # total tokens/s per GPU (per server where the GPU count is unknown)


@dataclass(frozen=True)
class Reach:
    """The highest throughput of one series at interactivity >= `target`."""

    target: float
    throughput: float | None  # None: no measured level reaches the target
    concurrency: float | None  # where (fractional when interpolated)
    how: str  # "measured" | "interpolated" | "never"
    best_interactivity: float  # the series' highest interactivity (what "never" fell short with)
    best_interactivity_concurrency: int
    below_all: bool  # every measured level reaches the target: the sweep may stop short of the best


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both axes (>= on both, > on one), by interactivity."""
    def beaten(p: Point) -> bool:
        return any(q.interactivity >= p.interactivity and q.throughput >= p.throughput
                   and (q.interactivity > p.interactivity or q.throughput > p.throughput) for q in points)

    return sorted((p for p in points if not beaten(p)), key=lambda p: (p.interactivity, -p.throughput))


def best_at(points: Sequence[Point], target: float) -> Reach:
    """The highest throughput at interactivity >= `target` (see the module doc for the interpolation)."""
    if not points:
        raise ValueError("no measured points")
    by_c = sorted(points, key=lambda p: p.concurrency)
    fastest = max(by_c, key=lambda p: p.interactivity)
    candidates: list[tuple[float, float, str]] = [(p.throughput, float(p.concurrency), "measured")
                                                  for p in by_c if p.interactivity >= target]
    for a, b in zip(by_c, by_c[1:]):
        if (a.interactivity >= target) != (b.interactivity >= target):
            t = (a.interactivity - target) / (a.interactivity - b.interactivity)  # 0 at a, 1 at b
            log_c = math.log2(a.concurrency) + t * (math.log2(b.concurrency) - math.log2(a.concurrency))
            candidates.append((a.throughput + t * (b.throughput - a.throughput), 2.0 ** log_c, "interpolated"))
    below_all = all(p.interactivity >= target for p in by_c)
    if not candidates:
        return Reach(target, None, None, "never", fastest.interactivity, fastest.concurrency, False)
    # the highest throughput; a measured point before an interpolated one of the same value
    throughput, c, how = max(candidates, key=lambda x: (x[0], x[2] == "measured"))
    return Reach(target, throughput, c, how, fastest.interactivity, fastest.concurrency, below_all)


# ------------------------------------------------------------------------------------------------
# a run's frontier (bench.json)
# ------------------------------------------------------------------------------------------------
def unit_of(gpus: int | None, gpus_source: str) -> str:
    """What the throughput is divided by, in words: per GPU, per device (one CPU), or per server."""
    if not gpus:
        return "per server"
    return "per device" if gpus_source.endswith("(cpu)") else "per GPU"


def gpu_basis(result: dict[str, Any]) -> tuple[int | None, str]:
    """(GPUs the throughput is divided by, where that number came from) of a finished run; runs
    written before the frontier existed: one device in process, unknown at an endpoint."""
    frontier = result.get("frontier")
    if frontier:
        return frontier.get("gpus"), frontier.get("gpus_source") or ""
    if result["source"].get("kind") == "in_process":
        device = (result.get("environment") or {}).get("device") or "cpu"
        return 1, f"in process: one device ({'cpu' if device == 'cpu' else 'gpu'})"
    return None, "unknown: pass --gpus N or --engine ENGINE"


def series_of(result: dict[str, Any], gpus: int | None) -> dict[tuple[str, str], list[Point]]:
    """(side, mode) -> its points in C order, from the run's rows (rows without a timed TPOT left out)."""
    out: dict[tuple[str, str], list[Point]] = {}
    for r in result["rows"]:
        x = interactivity(r["tpot_s"]["mean"])
        if x <= 0:
            continue
        y = r["total_tokens_per_s"] / (gpus or 1)
        out.setdefault((r["side"], r["mode"]), []).append(Point(r["concurrency"], x, y))
    return {k: sorted(v, key=lambda p: p.concurrency) for k, v in out.items()}


def frontier(result: dict[str, Any], gpus: int | None, gpus_source: str,
             targets: Sequence[float] = ()) -> dict[str, Any]:
    """The bench.json ``frontier`` object: every series with its Pareto flags, and for each target
    X and side, each mode's highest throughput at >= X and DFlash / plain."""
    series = series_of(result, gpus)
    labels = {r["side"]: r["label"] for r in result["rows"]}
    per = unit_of(gpus, gpus_source)
    out: dict[str, Any] = {
        "interactivity": INTERACTIVITY, "per": per,
        "throughput": f"total tokens/s {per}" + ("" if gpus else " (GPU count unknown: --gpus N)"),
        "gpus": gpus, "gpus_source": gpus_source, "interpolation": INTERPOLATION, "series": [], "at": []}
    for (side, mode), points in series.items():
        front = set(pareto_front(points))
        out["series"].append({"side": side, "label": labels[side], "mode": mode, "points": [
            {**asdict(p), "pareto": p in front} for p in points]})
    from dflash_trt.bench.summary import baseline_of

    baselines = {r["side"]: baseline_of(r) for r in result["rows"]}
    # a side that decodes plainly only (the baseline of several policies side by side) is read in theirs
    sides = [s for s in dict.fromkeys(s for s, _ in series)
             if (s, "dflash") in series or not any(b == s != o for o, b in baselines.items())]
    for target in targets:
        for side in sides:
            entry: dict[str, Any] = {"interactivity": target, "side": side, "label": labels[side]}
            for mode in ("dflash", "plain"):
                points = series.get((side if mode == "dflash" else baselines[side], mode))
                entry[mode] = asdict(best_at(points, target)) if points else None
            d, p = entry["dflash"], entry["plain"]
            entry["dflash_over_plain"] = (d["throughput"] / p["throughput"] if d and p and d["throughput"] is not None
                                          and p["throughput"] else None)
            out["at"].append(entry)
    return out


def _reach_text(mode: str, r: dict[str, Any] | None, unit: str) -> str:
    name = "DFlash" if mode == "dflash" else "plain"
    if r is None:
        return f"{name} not measured"
    if r["throughput"] is None:
        return (f"{name} never reaches it (its best: {r['best_interactivity']:.1f} tokens/s per user at "
                f"C={r['best_interactivity_concurrency']})")
    c = f"C={r['concurrency']:.0f}" if r["how"] == "measured" else f"C~{r['concurrency']:.1f}, interpolated"
    flag = ", every measured C reaches it: a higher C may do better" if r["below_all"] else ""
    return f"{name} {r['throughput']:.1f} {unit} ({c}{flag})"


def at_lines(front: dict[str, Any]) -> list[str]:
    """One line per target and side: each mode's highest throughput at >= X and the ratio."""
    unit = f"tok/s {front['per']}"
    lines = []
    for e in front["at"]:
        ratio = (f" -> DFlash/plain {e['dflash_over_plain']:.2f}x" if e["dflash_over_plain"] is not None
                 else " -> no ratio")
        lines.append(f"at >= {e['interactivity']:g} tokens/s per user, {e['label']}: "
                     f"{_reach_text('dflash', e['dflash'], unit)}; {_reach_text('plain', e['plain'], unit)}{ratio}")
    if front["at"]:
        lines.append(f"interactivity = {front['interactivity']}; between measured levels: {front['interpolation']}")
    return lines
