"""DFlash statistics from a server's Prometheus metrics, for servers whose responses carry none.

An OpenAI-compatible response of vLLM or trtllm-serve says nothing about speculation by default,
but the server's metrics do. Three families of counters are understood, each with its names and
labels as recorded in tests/upstream/spec_decode_metrics.json: ours (dflash_trt/serving/metrics.py:
``dflash_drafts``, ``dflash_draft_tokens``, ``dflash_accepted_draft_tokens``,
``dflash_position_drafted`` / ``dflash_position_accepted``, label ``position``), vLLM 0.32's
``vllm:spec_decode_*`` (drafts, draft tokens, accepted tokens, accepted per ``position``) and
TensorRT-LLM's ``trtllm_spec_decode_*`` (draft and accepted tokens, drafted and accepted per
``token_position``; no drafts counter). Our server exports all three for the same counts, so the
first family present in that order is read, never a sum of them. The bench reads them before and
after a run and pools the difference: with concurrent requests the counters cannot be attributed
to one request, so tau and per-position acceptance are figures of the whole run (what a server's
dashboard shows too). Parsed with prometheus-client's own text parser.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.serving.metrics import OUR_COUNTERS, UPSTREAM_COUNTERS

QUANTITIES = ("drafts", "draft_tokens", "accepted_tokens", "drafted_per_position", "accepted_per_position")


def _families() -> list[dict[str, tuple[str, str | None]]]:
    """[{quantity: (counter name, its position label or None)}] in the order they are preferred."""
    out: dict[str, dict[str, tuple[str, str | None]]] = {}
    for quantity, name, labels in (*OUR_COUNTERS, *UPSTREAM_COUNTERS):
        family = name.split(":")[0].split("_")[0]  # dflash | vllm | trtllm
        out.setdefault(family, {})[quantity] = (name, labels[-1] if quantity.endswith("per_position") else None)
    return list(out.values())


FAMILIES = _families()


def parse_counters(text: str) -> dict[str, Any]:
    """{"drafts", "draft_tokens", "accepted_tokens": summed over label sets; "drafted_per_position",
    "accepted_per_position": [per 0-based position]; "found": whether any family was present}, of
    the first family the text has."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples
                   if not s.name.endswith("_created")]
    except ValueError as e:
        raise DFlashError(f"the metrics endpoint did not answer Prometheus text ({e}); check --metrics-url") from None
    for family in FAMILIES:
        names = {name: (quantity, pos_label) for quantity, (name, pos_label) in family.items()}
        mine = [s for s in samples if s.name.removesuffix("_total") in names]
        if not mine:
            continue
        out: dict[str, Any] = {q: 0.0 for q in QUANTITIES[:3]}
        per_pos: dict[str, dict[int, float]] = {"drafted_per_position": {}, "accepted_per_position": {}}
        for s in mine:
            quantity, pos_label = names[s.name.removesuffix("_total")]
            if pos_label is None:
                out[quantity] += float(s.value)
            elif pos_label in s.labels:
                j = int(s.labels[pos_label])
                per_pos[quantity][j] = per_pos[quantity].get(j, 0.0) + float(s.value)
        for quantity, values in per_pos.items():
            out[quantity] = [values.get(j, 0.0) for j in range(max(values) + 1)] if values else []
        return {**out, "found": True, "has_drafts": "drafts" in family}
    return {**{q: 0.0 for q in QUANTITIES[:3]}, "drafted_per_position": [], "accepted_per_position": [],
            "found": False, "has_drafts": False}


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise DFlashError(f"cannot read the server's metrics at {url} ({type(e).__name__}: {e}); pass --metrics-url "
                          f"URL of its Prometheus endpoint (vLLM: the API port's /metrics; trtllm-serve: the API "
                          f"port's /prometheus/metrics; dflash-trt serve: :8002/metrics)") from None
    return parse_counters(r.text)


def _minus(after: list[float], before: list[float]) -> list[int]:
    before = before + [0.0] * (len(after) - len(before))
    return [int(round(a - b)) for a, b in zip(after, before)]


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counts of one run: `after` - `before`, as the pooled figures the summaries use."""
    drafts = int(round(after["drafts"] - before["drafts"]))
    accepted = _minus(after["accepted_per_position"], before["accepted_per_position"])
    drafted = _minus(after["drafted_per_position"], before["drafted_per_position"])
    if not drafted and drafts:  # vLLM counts no drafted tokens per position: every draft drafted each slot
        drafted = [drafts] * len(accepted)
    return {
        "num_drafts": drafts or None,  # None: no drafts counter (TensorRT-LLM), or nothing drafted
        "total_draft_tokens": int(round(after["draft_tokens"] - before["draft_tokens"])),
        "total_accepted_draft_tokens": int(round(after["accepted_tokens"] - before["accepted_tokens"])),
        "position_accepted": accepted,
        "position_drafted": drafted,
    }
