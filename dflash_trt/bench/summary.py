"""Summaries of RequestRecords per (concurrency, mode) in the dflash_trt.metrics vocabulary."""

from __future__ import annotations

from typing import Any

from dflash_trt.bench.runners import RequestRecord
from dflash_trt.metrics import GenerationStats, merge_stats, summarize


def _stats_of(r: RequestRecord) -> GenerationStats:
    """A record as GenerationStats (counts only) so tau/acceptance pool through merge_stats."""
    if r.acceptance_lengths is not None:
        lengths = r.acceptance_lengths
    else:  # an endpoint reports totals: steps * tau tokens spread over steps with the same sum
        lengths = [1] * r.num_steps
        for i in range(r.total_accepted_draft_tokens):
            lengths[i % max(1, r.num_steps)] += 1
    return GenerationStats(
        num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens, acceptance_lengths=list(lengths),
        total_draft_tokens=r.total_draft_tokens, total_accepted_draft_tokens=r.total_accepted_draft_tokens,
        position_drafted=list(r.position_drafted or []), position_accepted=list(r.position_accepted or []),
    )


def summarize_records(records: list[RequestRecord]) -> dict[str, Any]:
    """One mode at one concurrency level: pooled acceptance, latency distributions, throughput."""
    pooled = merge_stats([_stats_of(r) for r in records])
    per_step = all(r.acceptance_lengths is not None for r in records)
    wall = max(r.t_end for r in records) - min(r.t_submit for r in records) if records else 0.0
    return {
        "num_requests": len(records),
        "num_output_tokens": pooled.num_output_tokens,
        "num_steps": pooled.num_steps,
        "total_draft_tokens": pooled.total_draft_tokens,
        "total_accepted_draft_tokens": pooled.total_accepted_draft_tokens,
        "tau": pooled.tau,
        "acceptance_rate": pooled.acceptance_rate,
        "per_position_acceptance": pooled.per_position_acceptance if per_step else None,
        "ttft_s": summarize([r.ttft_s for r in records]),
        "tpot_s": summarize([r.tpot_s for r in records if r.num_output_tokens > 1]),
        "tokens_per_s": summarize([r.tokens_per_s for r in records]),
        "queue_s": summarize([r.queue_s for r in records]),
        "total_tokens_per_s": pooled.num_output_tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }


def speedup(plain: dict[str, Any] | None, dflash: dict[str, Any] | None) -> float | None:
    """plain mean tpot_s / DFlash mean tpot_s (None when either side is missing)."""
    if not plain or not dflash or not dflash["tpot_s"]["mean"]:
        return None
    return plain["tpot_s"]["mean"] / dflash["tpot_s"]["mean"]


def build_sweep(records: list[RequestRecord], levels: list[int], modes: tuple[str, ...]) -> list[dict[str, Any]]:
    sweep = []
    for c in levels:
        row: dict[str, Any] = {"concurrency": c}
        for m in ("dflash", "plain"):
            rs = [r for r in records if r.concurrency == c and r.mode == m]
            row[m] = summarize_records(rs) if m in modes and rs else None
        row["speedup"] = speedup(row["plain"], row["dflash"])
        sweep.append(row)
    return sweep


def identical_outputs(records: list[RequestRecord]) -> dict[str, int] | None:
    """At temperature 0 DFlash must reproduce plain greedy decoding: count prompts where it did."""
    d = {(r.concurrency, r.prompt_id): r.output_ids for r in records if r.mode == "dflash" and r.output_ids is not None}
    p = {(r.concurrency, r.prompt_id): r.output_ids for r in records if r.mode == "plain" and r.output_ids is not None}
    keys = sorted(set(d) & set(p))
    if not keys:
        return None
    return {"checked": len(keys), "identical": sum(d[k] == p[k] for k in keys)}
