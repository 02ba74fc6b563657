"""Speculation and prefix-cache metrics on Triton's own metrics port, published by model.py through the Python
backend's custom metrics (``pb_utils.MetricFamily``, Triton >= 23.05), next to Triton's
``nv_inference_*``.

Ours, in the project's vocabulary (dflash_trt.metrics; labels ``model``, ``version``): a
request's tau (mean acceptance length, bonus token included) is observed in the
``dflash_acceptance_length`` histogram; output tokens, drafts, draft tokens, accepted tokens and
the per-position counts (label ``position``, 0-based: 0 is the first token after the anchor) are
counters.

The same counts are ALSO exported under vLLM's and TensorRT-LLM's own names and labels
(:data:`UPSTREAM_COUNTERS`, recorded with their sources in tests/upstream/spec_decode_metrics.json),
so a dashboard or a scraper written for `vllm serve` or `trtllm-serve` reads this server
unchanged: one more increment per request, no new measurement. Their gauges
(`trtllm_spec_decode_acceptance_length`, `trtllm_spec_decode_draft_overhead`) are not mirrored:
they hold the LAST iteration's batch-wide value, which a model that sees whole requests never
has, and a per-request value under that name would mean something else. docs/serving.md has the
table. Prefix caching is counted in TOKENS under ours (``dflash_prefix_cache_queries_total``,
``dflash_prefix_cache_hits_total``) and vLLM's names (``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``). Triton's metric library (prometheus-cpp) writes names as given, so
counters carry their ``_total`` here.
"""

from __future__ import annotations

import threading
from typing import Any

LABELS = ("model", "version")
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)

# the project's own speculation counters, by the quantities of tests/upstream/spec_decode_metrics.json
OUR_COUNTERS = (
    ("drafts", "dflash_drafts", LABELS),
    ("draft_tokens", "dflash_draft_tokens", LABELS),
    ("accepted_tokens", "dflash_accepted_draft_tokens", LABELS),
    ("drafted_per_position", "dflash_position_drafted", (*LABELS, "position")),
    ("accepted_per_position", "dflash_position_accepted", (*LABELS, "position")),
)
VLLM_LABELS = ("model_name", "engine")  # vllm/v1/metrics/loggers.py; engine = the engine index
TRTLLM_LABELS = ("model_name", "engine_type")  # trtllm-serve's MetricsCollector labels
# (quantity, name without _total, labels): the quantities of tests/upstream/spec_decode_metrics.json
UPSTREAM_COUNTERS = (
    ("drafts", "vllm:spec_decode_num_drafts", VLLM_LABELS),
    ("draft_tokens", "vllm:spec_decode_num_draft_tokens", VLLM_LABELS),
    ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens", VLLM_LABELS),
    ("accepted_per_position", "vllm:spec_decode_num_accepted_tokens_per_pos", (*VLLM_LABELS, "position")),
    ("draft_tokens", "trtllm_spec_decode_num_draft_tokens", TRTLLM_LABELS),
    ("accepted_tokens", "trtllm_spec_decode_num_accepted_tokens", TRTLLM_LABELS),
    ("drafted_per_position", "trtllm_spec_decode_drafted_tokens", (*TRTLLM_LABELS, "token_position")),
    ("accepted_per_position", "trtllm_spec_decode_accepted_tokens", (*TRTLLM_LABELS, "token_position")),
)
# prefix caching, in TOKENS as vLLM counts them (tests/upstream/spec_decode_metrics.json "prefix_cache"):
# ours (labels model, version) and vLLM's twins (labels model_name, engine)
PREFIX_CACHE_COUNTERS = (
    ("prefix_cache_queries", "dflash_prefix_cache_queries", LABELS),
    ("prefix_cache_hits", "dflash_prefix_cache_hits", LABELS),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", VLLM_LABELS),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", VLLM_LABELS),
)
ENGINE_TYPE = "dflash-trt"
HELP = {
    "drafts": "Verification steps that drafted at least one token",
    "draft_tokens": "Draft tokens proposed for verification",
    "accepted_tokens": "Draft tokens the target accepted (bonus token excluded)",
    "drafted_per_position": "Draft tokens proposed at draft position (0-based: 0 is the first token after the anchor)",
    "accepted_per_position": "Draft tokens the target accepted at draft position (0-based)",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens",
}


def speculation_counts(stats: Any) -> dict[str, Any]:
    """One request's counts by quantity, from its ChunkStats (serving/protocol.py). A backend that
    reports totals only (TensorRT-LLM) sends no per-position counts: those stay empty."""
    drafted = [int(x) for x in stats.position_drafted or ()]
    return {"drafts": drafted[0] if drafted else 0, "draft_tokens": int(stats.total_draft_tokens),
            "accepted_tokens": int(stats.total_accepted_draft_tokens), "drafted_per_position": drafted,
            "accepted_per_position": [int(x) for x in stats.position_accepted or ()]}


class SpeculationMetrics:
    """The model's custom metrics, registered once per model instance. `pb_utils` is the Python
    backend's module (passed in: this file is imported inside the stub, never beside a server)."""

    def __init__(self, pb_utils: Any, model: str, version: str) -> None:
        counter, histogram = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM
        # one update at a time: the 2.51 stub's metric calls are not safe from several threads at
        # once (concurrent increments from model.py's request threads crashed tritonserver, SIGSEGV
        # in libtriton_python.so; tests/test_serving_metrics.py runs requests side by side)
        self._lock = threading.Lock()
        self._families: list[Any] = []  # kept alive: a family must outlive its metrics
        self._metrics: dict[tuple, Any] = {}
        ours = {"model": model, "version": version}
        upstream = {"model_name": model, "engine": "0", "engine_type": ENGINE_TYPE}
        self._output_tokens = self._family(pb_utils, "dflash_output_tokens_total", "Generated tokens", counter)
        self._tau = self._family(pb_utils, "dflash_acceptance_length",
                                 "Per-request mean acceptance length tau (bonus token included)", histogram)
        self._cancelled = self._family(pb_utils, "dflash_cancelled_requests_total",
                                       "Requests whose client left (or that were stopped) before they finished; their "
                                       "rows were freed", counter)
        self._ours = {"output_tokens": (self._output_tokens, ours), "cancelled": (self._cancelled, ours)}
        # (quantity, family, fixed labels, position label or None)
        self._counters = []
        for quantity, name, labels in (*OUR_COUNTERS, *UPSTREAM_COUNTERS):
            family = self._family(pb_utils, f"{name}_total", HELP[quantity] + (
                "" if name.startswith("dflash") else f" (as {name} upstream: tests/upstream/spec_decode_metrics.json)"),
                counter)
            values = ours if name.startswith("dflash") else upstream
            fixed = {k: values[k] for k in labels if k in values}
            position = labels[-1] if quantity.endswith("per_position") else None
            self._counters.append((quantity, family, fixed, position))
        self._tau_labels = ours
        self._prefix = []  # (quantity, family, labels): counted only where the backend caches prefixes
        for quantity, name, labels in PREFIX_CACHE_COUNTERS:
            values = ours if name.startswith("dflash") else upstream
            self._prefix.append((quantity, self._family(pb_utils, f"{name}_total", HELP[quantity], counter),
                                 {k: values[k] for k in labels}))

    def _family(self, pb_utils: Any, name: str, description: str, kind: Any) -> Any:
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def _metric(self, family: Any, labels: dict[str, str], **kw: Any) -> Any:
        key = (id(family), tuple(sorted(labels.items())))
        if key not in self._metrics:
            self._metrics[key] = family.Metric(labels=labels, **kw)
        return self._metrics[key]

    def request_finished(self, stats: Any, prefix_caching: bool = False) -> None:
        """Count one finished request (its final ChunkStats); `prefix_caching`: the backend looked
        its prompt up in a prefix cache (queries and hits are counted then, as vLLM counts them)."""
        if stats is None:
            return
        with self._lock:
            self._count(stats)
            if prefix_caching:
                tokens = {"prefix_cache_queries": int(stats.num_prompt_tokens),
                          "prefix_cache_hits": int(stats.num_cached_tokens)}
                for quantity, family, labels in self._prefix:
                    self._metric(family, labels).increment(tokens[quantity])

    def request_cancelled(self) -> None:
        """Count one request that ended cancelled (nothing else of it is counted)."""
        family, labels = self._ours["cancelled"]
        with self._lock:
            self._metric(family, labels).increment(1)

    def _count(self, stats: Any) -> None:
        output, labels = self._ours["output_tokens"]
        self._metric(output, labels).increment(int(stats.num_output_tokens))
        counts = speculation_counts(stats)
        for quantity, family, fixed, position in self._counters:
            value = counts[quantity]
            if position is None:
                self._metric(family, fixed).increment(value)
            else:
                for j, n in enumerate(value):
                    self._metric(family, {**fixed, position: str(j)}).increment(n)
        if stats.tau:
            self._metric(self._tau, self._tau_labels, buckets=list(TAU_BUCKETS)).observe(float(stats.tau))
