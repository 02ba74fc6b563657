"""Summaries of RequestRecords per (side, mode, concurrency) in the dflash_trt.metrics vocabulary,
the ratios between them, and the identity check.

- A row's figures pool its requests: tau and acceptance over all steps (not a mean of request
  means), latencies as distributions, total_tokens_per_s over the run's wall time.
- ``dflash_over_plain``: a side's DFlash total tokens/s over its own plain decoding's, same C (a
  side without a plain mode -- one of several policies side by side -- over its ``baseline``'s);
  ``speedup``: plain mean TPOT over DFlash mean TPOT (the per-user pace);
  ``steady_dflash_over_plain``: the same over ``steady_tokens_per_s``, the total tokens/s while all
  C requests decoded (bench/steady.py: what a server with steady traffic sees, without the drain
  at the end of a one-request-per-user run).
- ``vs_peer``: a side's total tokens/s over the peer's (vLLM in its default, compiled mode when it
  ran, else eager), same mode, same C; ``vs_fastest_plain``: a DFlash row over the fastest plain
  decoder of all sides at that C (what speculation must beat to be worth it).
- ``identical``: at temperature 0 every output must equal the oracle's for the same prompt: the
  reference loop's plain greedy decoding (measured, or computed beforehand with --check); an
  endpoint without ids compares its DFlash text with its plain server's. Beside the count, each
  output that departs: where, and the target's logit margin there (bench/divergence.py: rounding
  flips near-ties in bfloat16; a large margin is a real loss).
"""

from __future__ import annotations

from typing import Any

from dflash_trt.bench.divergence import departures
from dflash_trt.bench.runners import RequestRecord, RunResult
from dflash_trt.bench.steady import steady_tokens_per_s
from dflash_trt.metrics import GenerationStats, merge_stats, summarize, tokens_per_second

PEER_SIDES = ("vllm", "vllm-eager")  # in order of preference for vs_peer


def _stats_of(r: RequestRecord) -> GenerationStats:
    """A record as GenerationStats (counts only) so tau/acceptance pool through merge_stats."""
    if r.acceptance_lengths is not None:
        lengths = r.acceptance_lengths
    else:  # an endpoint reports totals: steps * tau tokens spread over steps with the same sum
        lengths = [1] * r.num_steps
        for i in range(r.total_accepted_draft_tokens if r.num_steps else 0):
            lengths[i % r.num_steps] += 1
    return GenerationStats(
        num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens, acceptance_lengths=list(lengths),
        total_draft_tokens=r.total_draft_tokens, total_accepted_draft_tokens=r.total_accepted_draft_tokens,
        position_drafted=list(r.position_drafted or []), position_accepted=list(r.position_accepted or []),
    )


def summarize_records(records: list[RequestRecord], counters: dict[str, Any] | None = None) -> dict[str, Any]:
    """One side, one mode, one level: pooled acceptance, latency distributions, throughput.

    `counters`: pooled counts from a server's metrics (bench/server_metrics.py), used where the
    records carry no per-request acceptance."""
    ok = [r for r in records if r.error is None]
    pooled = merge_stats([_stats_of(r) for r in ok])
    per_position = bool(ok) and all(r.position_drafted is not None for r in ok)  # an endpoint may send them
    wall = max(r.t_end for r in ok) - min(r.t_submit for r in ok) if ok else 0.0
    out = {
        "num_requests": len(ok),
        "errors": len(records) - len(ok),
        "num_output_tokens": pooled.num_output_tokens,
        "num_steps": pooled.num_steps,
        "total_draft_tokens": pooled.total_draft_tokens,
        "total_accepted_draft_tokens": pooled.total_accepted_draft_tokens,
        "tau": pooled.tau,
        "acceptance_rate": pooled.acceptance_rate,
        "per_position_acceptance": pooled.per_position_acceptance if per_position else None,
        "acceptance_source": "per request" if pooled.num_steps else None,
        "ttft_s": summarize([r.ttft_s for r in ok]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.num_output_tokens > 1]),
        "tokens_per_s": summarize([r.tokens_per_s for r in ok]),
        "queue_s": summarize([r.queue_s for r in ok]),
        "total_tokens_per_s": tokens_per_second(pooled.num_output_tokens, wall),
        "wall_s": wall,
    }
    decode = [r for r in ok if r.server_decode_s is not None]
    if decode:  # an endpoint's latency = waiting for its runtime + decoding + the rest (server overhead)
        out["server_decode_s"] = summarize([r.server_decode_s for r in decode])
        out["server_overhead_s"] = summarize([r.latency_s - r.queue_s - r.server_decode_s for r in decode])
    if counters is not None and not pooled.num_steps:
        drafted, accepted = counters["total_draft_tokens"], counters["total_accepted_draft_tokens"]
        steps = counters.get("num_drafts")
        out.update(total_draft_tokens=drafted, total_accepted_draft_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   num_steps=steps or 0, tau=1 + accepted / steps if steps else None,
                   acceptance_source="server metrics (pooled over the run)")
        if counters.get("position_accepted") and counters.get("position_drafted"):
            out["per_position_acceptance"] = [a / d if d else 0.0 for a, d in zip(counters["position_accepted"],
                                                                                  counters["position_drafted"])]
    return out


def _key(r: RequestRecord) -> Any:
    return r.output_ids if r.output_ids is not None else r.text


def build_rows(results: dict[tuple[str, str, int], RunResult], sides: list[Any], levels: list[int],
               per_category: bool = False, oracle: dict[str, list[int]] | None = None,
               margins: Any = None) -> list[dict[str, Any]]:
    """Every (side, mode, C) that ran, in table order (C, then side, DFlash before plain).
    `margins(prompt_id, reference_ids)`: the target's logit margins along a reference output
    (bench/divergence.py), for the departures of outputs that differ from it."""
    rows: list[dict[str, Any]] = []
    for c in levels:
        for side in sides:
            for mode in ("dflash", "plain"):
                run = results.get((side.name, mode, c))
                if run is None:
                    continue
                row: dict[str, Any] = {"side": side.name, "label": side.label, "mode": mode, "concurrency": c,
                                       "baseline": getattr(side, "baseline", None) or side.name,
                                       **summarize_records(run.records, run.counters)}
                row["steady_tokens_per_s"] = steady_tokens_per_s([r for r in run.records if r.error is None], c)
                if per_category:
                    cats = sorted({r.category for r in run.records})
                    row["per_category"] = {cat: summarize_records([r for r in run.records if r.category == cat])
                                           for cat in cats}
                row["info"] = run.info
                rows.append(row)
    _ratios(rows)
    _identity(rows, results, oracle, margins)
    return rows


def find(rows: list[dict[str, Any]], side: str, mode: str, c: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["side"] == side and r["mode"] == mode and r["concurrency"] == c), None)


def baseline_of(row: dict[str, Any]) -> str:
    """The side whose plain decoding a row's DFlash is measured against (its own, unless it runs none)."""
    return row.get("baseline") or row["side"]


def _ratios(rows: list[dict[str, Any]]) -> None:
    peers = [s for s in PEER_SIDES if any(r["side"] == s for r in rows)]
    for r in rows:
        c, mode = r["concurrency"], r["mode"]
        plain = find(rows, baseline_of(r), "plain", c)
        r["dflash_over_plain"] = r["speedup"] = r["steady_dflash_over_plain"] = None
        if mode == "dflash" and plain and plain["total_tokens_per_s"]:
            r["dflash_over_plain"] = r["total_tokens_per_s"] / plain["total_tokens_per_s"]
            if r["tpot_s"]["mean"]:
                r["speedup"] = plain["tpot_s"]["mean"] / r["tpot_s"]["mean"]
            if r.get("steady_tokens_per_s") and plain.get("steady_tokens_per_s"):
                r["steady_dflash_over_plain"] = r["steady_tokens_per_s"] / plain["steady_tokens_per_s"]
        peer = next((p for s in peers if (p := find(rows, s, mode, c)) is not None), None)
        r["vs_peer"] = (r["total_tokens_per_s"] / peer["total_tokens_per_s"]
                        if peer and r["side"] not in PEER_SIDES and peer["total_tokens_per_s"] else None)
        r["peer"] = peer["side"] if peer and r["vs_peer"] is not None else None
        fastest = max((p["total_tokens_per_s"] for p in rows if p["mode"] == "plain" and p["concurrency"] == c),
                      default=0.0)
        r["vs_fastest_plain"] = r["total_tokens_per_s"] / fastest if mode == "dflash" and fastest else None


def _identity(rows: list[dict[str, Any]], results: dict[tuple[str, str, int], RunResult],
              oracle: dict[str, list[int]] | None, margins: Any = None) -> None:
    if oracle is None:  # the reference loop's plain greedy decoding, when it ran
        ref = [(c, run) for (side, mode, c), run in results.items() if side == "reference" and mode == "plain"]
        if ref:
            oracle = {r.prompt_id: r.output_ids for r in min(ref, key=lambda x: x[0])[1].records if r.error is None}
    for row in rows:
        recs = [r for r in results[(row["side"], row["mode"], row["concurrency"])].records if r.error is None]
        if oracle is not None and all(r.output_ids is not None for r in recs):
            want = {pid: ids for pid, ids in oracle.items()}
            against = "reference loop, plain greedy"
            ids_want: dict[str, Any] | None = want
        else:  # an endpoint: its DFlash outputs against its plain server's, per prompt
            plain = results.get((baseline_of(row), "plain", row["concurrency"]))
            if plain is None:
                row["identical"] = None
                continue
            want = {r.prompt_id: _key(r) for r in plain.records if r.error is None}
            against = "the same side's plain decoding"
            ids_want = want if all(r.output_ids is not None for r in plain.records) else None
        checked = [r for r in recs if r.prompt_id in want]
        if not checked:
            row["identical"] = None
            continue
        row["identical"] = {"checked": len(checked), "identical": sum(_key(r) == want[r.prompt_id] for r in checked),
                            "against": against}
        if ids_want is not None and all(r.output_ids is not None for r in checked):
            of = (lambda pid: margins(pid, ids_want[pid])) if margins is not None and oracle is not None else None
            row["identical"]["departures"] = departures([(r.prompt_id, r.output_ids) for r in checked], ids_want, of)
