"""What limits a DFlash figure, measured: acceptance against the cost of a step, per side and C.

A DFlash step commits tau tokens per row and costs, in plain decoding steps of the same side at
the same concurrency,

    cost = 1 + drafter + verify + other
    DFlash / plain  ~=  tau / cost

- drafter: the drafter's pass and its head (draft ids), over a plain step;
- verify: what verifying k drafts adds to the target pass (the target pass of k+1 tokens per
  row minus a plain step's target pass); ``verify_per_draft`` = verify / k;
- other: what the step adds outside the passes (masks, index tensors, the sync, commits, Python).

The terms come from per-pass timings of both modes' steady steps (bench/phases.py, CPU only);
tau and the per-position acceptance from the DFlash row. For the batched runtime's adaptive
policy the table it decided from is reported beside it: for each candidate k, its calibrated or
learned step cost in plain steps at this C, and the tokens it expects from its acceptance
estimate (1 + sum of P(a >= j), j <= k), so a policy that chose plain decoding shows why. For
the peer, whose passes we cannot time, ``implied_cost`` = tau / (DFlash / plain) is what one of
its DFlash steps must have cost.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.bench.summary import PEER_SIDES, find


def _mean_over_k(timing: dict[str, Any], key: str) -> float:
    steps = sum(v["steps"] for v in timing.values())
    return sum(v["steps"] * v[key] for v in timing.values()) / steps if steps else 0.0


def _at(table: dict[str, float], rows: int) -> float | None:
    """A policy table's value at `rows` (keys are row counts as strings): the nearest measured."""
    if not table:
        return None
    keys = sorted(int(k) for k in table)
    best = min(keys, key=lambda n: (abs(n - rows), n))
    return table[str(best)]


def policy_table(stats: dict[str, Any], rows: int) -> list[dict[str, Any]] | None:
    """The adaptive policy's view at `rows`: per candidate k, cost in plain steps and expected tokens."""
    if not stats or stats.get("policy") != "adaptive":
        return None
    q = stats.get("position_acceptance") or []
    ratios = stats.get("step_cost_vs_plain") or {}
    out = []
    for k in stats.get("candidates") or []:
        ratio = 1.0 if k == 0 else _at(ratios.get(str(k), {}), rows)
        expected = 1.0 + sum(q[:k])
        out.append({"k": k, "cost_vs_plain": ratio, "expected_tokens": expected,
                    "expected_gain": expected / ratio if ratio else None})
    return out


def _decompose(d: dict[str, Any], p: dict[str, Any] | None) -> dict[str, Any] | None:
    td = (d.get("info") or {}).get("step_timing")
    tp = ((p or {}).get("info") or {}).get("step_timing")
    if not td or not tp or "0" not in tp or not tp["0"]["step_s"]:
        return None
    plain = tp["0"]
    base = plain["step_s"]
    steps = sum(v["steps"] for v in td.values())
    mean_k = sum(int(k) * v["steps"] for k, v in td.items()) / steps if steps else 0.0
    drafter = (_mean_over_k(td, "draft_s") + _mean_over_k(td, "head_s")) / base
    verify = (_mean_over_k(td, "target_s") - plain["target_s"]) / base
    other = (_mean_over_k(td, "other_s") - plain["other_s"] - plain["head_s"]) / base
    cost = _mean_over_k(td, "step_s") / base
    return {"plain_step_ms": 1e3 * base, "plain_rows": plain["rows_mean"], "dflash_step_ms": 1e3 * cost * base,
            "cost": cost, "drafter": drafter, "verify": verify, "other": other, "mean_k": mean_k,
            "verify_per_draft": verify / mean_k if mean_k else None,
            "k_steps": {k: v["steps"] for k, v in sorted(td.items(), key=lambda kv: int(kv[0]))}}


def analyse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (side, C) with a DFlash row: the measured terms and the biggest of them."""
    out = []
    for d in rows:
        if d["mode"] != "dflash":
            continue
        c, side = d["concurrency"], d["side"]
        p = find(rows, side, "plain", c)
        tau = d["tau"]
        entry: dict[str, Any] = {"side": side, "concurrency": c, "tau": tau,
                                 "per_position_acceptance": (d["per_position_acceptance"] or [])[:8],
                                 "dflash_over_plain": d["dflash_over_plain"]}
        parts = _decompose(d, p)
        if parts is not None:
            entry.update(parts)
            entry["predicted_dflash_over_plain"] = tau / parts["cost"] if tau and parts["cost"] else None
            terms = {"drafter pass": parts["drafter"], "verify of the drafts": parts["verify"],
                     "host work outside the passes": parts["other"]}
            worst = max(terms, key=lambda t: terms[t])
            entry["limit"] = (f"acceptance: tau {tau:.2f} tokens per step against a step of {parts['cost']:.2f} "
                              f"plain steps; the largest added cost is the {worst} ({terms[worst]:.2f})"
                              if tau else None)
        elif side in PEER_SIDES and d["dflash_over_plain"] and tau:
            entry["implied_cost"] = tau / d["dflash_over_plain"]
        stats = (d.get("info") or {}).get("runtime_stats")
        table = policy_table(stats, c) if stats else None
        if table is not None:
            entry["policy"] = {"candidates": table, "k_counts": stats.get("recent_k_counts"),
                               "position_acceptance": stats.get("position_acceptance")}
        out.append(entry)
    return out
