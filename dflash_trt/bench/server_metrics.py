"""DFlash statistics from a server's Prometheus metrics, for servers whose responses carry none.

An OpenAI-compatible response says nothing about speculation, but the server's ``/metrics``
does: vLLM exports the spec-decode counters ``vllm:spec_decode_num_drafts`` (verify steps that
drafted), ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based) (vLLM 0.32,
vllm/v1/spec_decode/metrics.py; prometheus-client appends ``_total`` to each sample). Ours
(dflash_trt/serving/metrics.py) exports ``dflash_draft_tokens`` and
``dflash_accepted_draft_tokens``. The bench reads them before and after a run and pools the
difference: with concurrent requests the counters cannot be attributed to one request, so tau
and per-position acceptance are figures of the whole run (what a server's dashboard shows too).
Parsed with prometheus-client's own text parser.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashError

# our name -> the exporters' counter names (without _total)
COUNTERS = {
    "num_drafts": ("vllm:spec_decode_num_drafts",),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens", "dflash_draft_tokens"),
    "accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "dflash_accepted_draft_tokens"),
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_counters(text: str) -> dict[str, Any]:
    """{our name: summed value over label sets, "accepted_per_position": [per 0-based position]}."""
    from prometheus_client.parser import text_string_to_metric_families

    by_name = {name: ours for ours, names in COUNTERS.items() for name in names}
    out: dict[str, Any] = {ours: 0.0 for ours in COUNTERS}
    per_pos: dict[int, float] = {}
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise DFlashError(f"the metrics endpoint did not answer Prometheus text ({e}); check --metrics-url") from None
    for fam in families:
        for sample in fam.samples:
            name = sample.name.removesuffix("_total")
            if sample.name.endswith("_created"):
                continue
            if name in by_name:
                out[by_name[name]] += float(sample.value)
                seen = True
            elif name == PER_POSITION and "position" in sample.labels:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + float(sample.value)
    out["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    out["found"] = seen
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise DFlashError(f"cannot read the server's metrics at {url} ({type(e).__name__}: {e}); pass --metrics-url "
                          f"URL of its Prometheus endpoint (vLLM: the API port's /metrics; dflash-trt serve: :8002/metrics)"
                          ) from None
    return parse_counters(r.text)


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counts of one run: `after` - `before`, as the pooled figures the summaries use."""
    d = {k: after[k] - before[k] for k in COUNTERS}
    b = before["accepted_per_position"] + [0.0] * (len(after["accepted_per_position"]) - len(before["accepted_per_position"]))
    per_pos = [a - x for a, x in zip(after["accepted_per_position"], b)]
    drafts = int(round(d["num_drafts"]))
    return {
        "num_drafts": drafts or None,  # None: no steps counter (ours), or nothing drafted
        "total_draft_tokens": int(round(d["draft_tokens"])),
        "total_accepted_draft_tokens": int(round(d["accepted_tokens"])),
        # vLLM drafts every slot at every drafting step: slot j was drafted num_drafts times
        "position_accepted": [int(round(x)) for x in per_pos],
        "position_drafted": [drafts] * len(per_pos) if drafts else [],
    }
