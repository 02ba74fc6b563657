"""Prometheus metrics of the gRPC server, on their own registry (one per server instance).

Where Triton has a metric, the name, labels (`model`, `version`) and unit are Triton's, so the
same dashboards work against `tritonserver` and `dflash-trt serve`. Triton exposes its counters
WITHOUT the `_total` suffix that prometheus-client's Counter adds, so those are Gauges that only
ever go up (the exposition says gauge; the series names match Triton's exactly).
DFlash-specific metrics are proper counters/histograms named in the project's vocabulary
(dflash_trt.metrics): a request's tau (mean acceptance length, bonus token included) is observed
in the `dflash_acceptance_length` histogram; drafts, draft tokens, accepted tokens and the
per-position counts (label `position`, 0-based: 0 is the first token after the anchor) are
counters.

The same counts are ALSO exported under vLLM's and TensorRT-LLM's own names and labels
(:data:`UPSTREAM_COUNTERS`, recorded with their sources in tests/upstream/spec_decode_metrics.json),
so a dashboard or a scraper written for `vllm serve` or `trtllm-serve` reads this server
unchanged: one more increment per request, no new measurement. Their gauges
(`trtllm_spec_decode_acceptance_length`, `trtllm_spec_decode_draft_overhead`) are not mirrored:
they hold the LAST iteration's batch-wide value, which the server never sees (it gets whole
requests), and a per-request value under that name would mean something else. docs/serving.md
has the table.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("model", "version")
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# the Triton outputs that are lists, one value per draft position (the rest are scalars)
PER_POSITION_OUTPUTS = ("position_drafted", "position_accepted")

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
# (quantity, name as registered (prometheus-client appends _total to the sample), labels): the
# quantities are those of tests/upstream/spec_decode_metrics.json, filled by request_finished
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
ENGINE_TYPE = "dflash-trt"


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # -- Triton's names ----------------------------------------------------------------------
        self.success = Gauge("nv_inference_request_success", "Number of successful inference requests", LABELS, registry=r)
        self.failure = Gauge("nv_inference_request_failure", "Number of failed inference requests",
                             (*LABELS, "reason"), registry=r)
        self.count = Gauge("nv_inference_count", "Number of inferences performed", LABELS, registry=r)
        self.exec_count = Gauge("nv_inference_exec_count", "Number of model executions performed", LABELS, registry=r)
        self.pending = Gauge("nv_inference_pending_request_count", "Instantaneous number of pending requests",
                             LABELS, registry=r)
        self.request_us = Gauge("nv_inference_request_duration_us", "Cumulative inference request duration in us",
                                LABELS, registry=r)
        self.queue_us = Gauge("nv_inference_queue_duration_us", "Cumulative inference queuing duration in us",
                              LABELS, registry=r)
        self.compute_us = Gauge("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in us",
                                LABELS, registry=r)
        self.first_response = Histogram("nv_inference_first_response_histogram_ms",
                                        "Duration from request to first response in milliseconds", LABELS,
                                        buckets=tuple(b * 1e3 for b in LATENCY_BUCKETS), registry=r)
        # -- DFlash -------------------------------------------------------------------------------
        self.latency = Histogram("dflash_request_latency_seconds", "Request latency, arrival to final response",
                                 LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.output_tokens = Counter("dflash_output_tokens", "Generated tokens", LABELS, registry=r)
        self.draft_tokens = Counter("dflash_draft_tokens", "Draft tokens proposed for verification", LABELS, registry=r)
        self.accepted_tokens = Counter("dflash_accepted_draft_tokens", "Draft tokens the target accepted", LABELS,
                                       registry=r)
        self.tau = Histogram("dflash_acceptance_length", "Per-request mean acceptance length tau (bonus token included)",
                             LABELS, buckets=TAU_BUCKETS, registry=r)
        self.drafts = Counter("dflash_drafts", "Verification steps that drafted at least one token", LABELS, registry=r)
        self.position_drafted = Counter("dflash_position_drafted", "Draft tokens proposed at draft position (0-based: "
                                        "0 is the first token after the anchor)", (*LABELS, "position"), registry=r)
        self.position_accepted = Counter("dflash_position_accepted", "Draft tokens the target accepted at draft "
                                         "position (0-based)", (*LABELS, "position"), registry=r)
        # -- the same counts under vLLM's and TensorRT-LLM's names --------------------------------
        self.upstream = [(quantity, Counter(name, f"As {name} upstream (tests/upstream/spec_decode_metrics.json)",
                                            labels, registry=r), labels) for quantity, name, labels in UPSTREAM_COUNTERS]

    def request_started(self, model: str, version: str) -> None:
        self.pending.labels(model, version).inc()

    def request_finished(self, model: str, version: str, ok: bool, reason: str, total_s: float, queue_s: float,
                         first_response_s: float | None, outputs: dict[str, Any], was_pending: bool = True) -> None:
        lv = (model, version)
        if was_pending:  # requests rejected before reaching the model were never pending
            self.pending.labels(*lv).dec()
        if not ok:
            self.failure.labels(*lv, reason).inc()
            return
        self.success.labels(*lv).inc()
        self.count.labels(*lv).inc()
        self.exec_count.labels(*lv).inc()
        self.request_us.labels(*lv).inc(total_s * 1e6)
        self.queue_us.labels(*lv).inc(queue_s * 1e6)
        self.compute_us.labels(*lv).inc(max(0.0, total_s - queue_s) * 1e6)
        self.latency.labels(*lv).observe(total_s)
        if first_response_s is not None:
            self.first_response.labels(*lv).observe(first_response_s * 1e3)
        if "num_output_tokens" in outputs:
            self.output_tokens.labels(*lv).inc(int(outputs["num_output_tokens"]))
        if "total_draft_tokens" in outputs:
            self._speculation(model, version, outputs)
        if outputs.get("tau"):
            self.tau.labels(*lv).observe(float(outputs["tau"]))

    def _speculation(self, model: str, version: str, outputs: dict[str, Any]) -> None:
        """One request's drafts, draft and accepted tokens and per-position counts, under our names
        and the upstream ones. A backend that reports totals only (TensorRT-LLM) sends no
        per-position counts: its drafts and per-position counters stay where they are."""
        drafted = [int(x) for x in outputs.get("position_drafted") or ()]
        accepted = [int(x) for x in outputs.get("position_accepted") or ()]
        counts: dict[str, Any] = {"drafts": drafted[0] if drafted else 0,
                                  "draft_tokens": int(outputs["total_draft_tokens"]),
                                  "accepted_tokens": int(outputs.get("total_accepted_draft_tokens", 0)),
                                  "drafted_per_position": drafted, "accepted_per_position": accepted}
        lv = (model, version)
        self.draft_tokens.labels(*lv).inc(counts["draft_tokens"])
        self.accepted_tokens.labels(*lv).inc(counts["accepted_tokens"])
        self.drafts.labels(*lv).inc(counts["drafts"])
        for j, (d, a) in enumerate(zip(drafted, accepted)):
            self.position_drafted.labels(*lv, str(j)).inc(d)
            self.position_accepted.labels(*lv, str(j)).inc(a)
        upstream_values = {"model_name": model, "engine": "0", "engine_type": ENGINE_TYPE}
        for quantity, counter, labels in self.upstream:
            values = [upstream_values[name] for name in labels if name in upstream_values]
            if isinstance(counts[quantity], list):
                for j, n in enumerate(counts[quantity]):
                    counter.labels(*values, str(j)).inc(n)
            else:
                counter.labels(*values).inc(counts[quantity])

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Start the /metrics HTTP endpoint; returns (http_server, thread)."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry)
