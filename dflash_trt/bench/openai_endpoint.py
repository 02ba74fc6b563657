"""Any OpenAI-compatible server as a benchmark side: `vllm serve`, `trtllm-serve`, SGLang, `dflash-trt serve`.

One streaming client (httpx, server-sent events) on ``POST /v1/chat/completions`` with the
prompt's chat messages (the server applies the chat template, as our in-process runs do with the
tokenizer contract), ``stream_options.include_usage`` for the token count, and vLLM's
``return_token_ids`` extension where the server accepts it (output ids, so the identity check
compares ids; a server that refuses it is asked again without, and text is compared instead).

Figures per request from the client's clock: TTFT = first chunk with content, TPOT = (last -
first) / (completion_tokens - 1). DFlash statistics: from the response where it carries them (our
server's ``dflash`` object; vLLM's ``metrics.speculative_decoding``, which `vllm serve
--per-request-spec-decode-metrics summary` adds; or usage keys named as in dflash_trt.metrics),
else pooled over the run from the server's Prometheus counters (bench/server_metrics.py). Plain decoding needs a second server
of the same target without speculation (`plain_url`), as with the Triton endpoint.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.bench.runners import MODES, BenchRequest, OnDone, RequestRecord, RunResult, closed_loop_threads
from dflash_trt.bench.triton_endpoint import failed_record
from dflash_trt.errors import DFlashError

STAT_KEYS = ("acceptance_length", "total_draft_tokens", "total_accepted_draft_tokens", "num_steps")
# our `dflash` object -> the keys above; per-position counts travel as lists
OURS = {"tau": "acceptance_length", "total_draft_tokens": "total_draft_tokens",
        "total_accepted_draft_tokens": "total_accepted_draft_tokens", "num_steps": "num_steps"}
# vLLM's metrics.speculative_decoding (tests/upstream/spec_decode_metrics.json) -> the keys above
VLLM = {"mean_acceptance_length": "acceptance_length", "num_draft_tokens": "total_draft_tokens",
        "num_accepted_draft_tokens": "total_accepted_draft_tokens", "num_spec_steps": "num_steps"}


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


@dataclass
class StreamedAnswer:
    text: str = ""
    token_ids: list[int] | None = None
    completion_tokens: int | None = None
    finish_reason: str = ""
    ttft_s: float | None = None  # request sent -> first chunk with content
    latency_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # DFlash statistics, where the server sends them


def _numbers(src: Any, names: dict[str, str]) -> dict[str, float]:
    if not isinstance(src, dict):
        return {}
    return {names[k]: float(v) for k, v in src.items() if k in names and isinstance(v, (int, float))}


def _vllm_positions(spec: dict[str, Any]) -> dict[str, list[int]]:
    """Per-position counts from vLLM's histogram: position j was accepted by every draft that
    accepted more than j tokens; it was drafted by every draft only where each drafted K tokens."""
    hist, steps, k = spec.get("acceptance_histogram"), spec.get("num_spec_steps"), spec.get("num_spec_tokens")
    if not isinstance(hist, list) or not isinstance(steps, int) or not isinstance(k, int) or not k:
        return {}
    out = {"position_accepted": [sum(hist[j + 1:]) for j in range(k)]}
    if spec.get("num_draft_tokens") == steps * k:
        out["position_drafted"] = [steps] * k
    return out


def _stats_in(chunk: dict[str, Any]) -> dict[str, Any]:
    """DFlash statistics a response may carry: our `dflash` object, vLLM's per-request
    `metrics.speculative_decoding`, or usage keys of our vocabulary."""
    out: dict[str, Any] = _numbers(chunk.get("usage"), {k: k for k in STAT_KEYS})
    spec = (chunk.get("metrics") or {}).get("speculative_decoding") if isinstance(chunk.get("metrics"), dict) else None
    if isinstance(spec, dict):
        out.update(_numbers(spec, VLLM))
        out.update(_vllm_positions(spec))
    ours = chunk.get("dflash")
    if isinstance(ours, dict):
        out.update(_numbers(ours, OURS))
        out.update({k: [int(x) for x in ours[k]] for k in ("position_drafted", "position_accepted")
                    if isinstance(ours.get(k), list)})
    return out


class OpenAIClient:
    """The few calls the bench makes; one connection pool shared by the client threads."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self.token_ids = True  # ask for vLLM's return_token_ids until the server refuses it
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[str]:
        import httpx

        try:
            r = self.http.get("/v1/models", timeout=10.0)
            r.raise_for_status()
            return [m["id"] for m in r.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise DFlashError(f"cannot list the models of an OpenAI server at {self.base_url} ({type(e).__name__}: "
                              f"{e}); is `vllm serve` / `dflash-trt serve` running there? fix --url") from None

    def chat(self, model: str, messages: list[dict[str, str]], max_tokens: int, temperature: float,
             seed: int | None) -> StreamedAnswer:
        """One streamed chat completion; DFlashError with the server's message on an HTTP error."""
        import httpx

        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        if seed is not None:
            body["seed"] = seed
        if self.token_ids:
            body["return_token_ids"] = True
        out = StreamedAnswer()
        parts: list[str] = []
        ids: list[int] = []
        t0 = time.perf_counter()
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code >= 400:
                    detail = " ".join(r.read().decode("utf-8", errors="replace").split())[:300]
                    if self.token_ids and r.status_code == 400 and "return_token_ids" in detail:
                        with self._lock:
                            self.token_ids = False  # an OpenAI server without vLLM's extension: compare text
                        return self.chat(model, messages, max_tokens, temperature, seed)
                    raise DFlashError(f"{self.base_url} answered HTTP {r.status_code}: {detail}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    out.stats.update(_stats_in(chunk))
                    if chunk.get("usage"):
                        out.completion_tokens = chunk["usage"].get("completion_tokens", out.completion_tokens)
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or ""
                        new_ids = choice.get("token_ids") or []
                        if (text or new_ids) and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - t0
                        parts.append(text)
                        ids.extend(new_ids)
                        if choice.get("finish_reason"):
                            out.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as e:
            raise DFlashError(f"request to {self.base_url} failed ({type(e).__name__}: {e})") from None
        except json.JSONDecodeError as e:
            raise DFlashError(f"{self.base_url} streamed a chunk that is not JSON ({e.msg}); is it an OpenAI server?"
                              ) from None
        out.latency_s = time.perf_counter() - t0
        out.text = "".join(parts)
        out.token_ids = ids if self.token_ids and ids else None
        return out


@dataclass
class OpenAIEndpointSide:
    url: str
    model: str | None = None  # None: the server's first (usually only) model
    plain_url: str | None = None
    metrics_url: str | None = None  # None: <url>/metrics (vLLM serves it on the API port)
    timeout_s: float = 600.0
    t0: float = field(default_factory=time.perf_counter)
    name: str = "endpoint"
    label: str = "endpoint (OpenAI HTTP)"
    parallel: bool = True
    _clients: dict[str, OpenAIClient] = field(default_factory=dict)
    _models: dict[str, str] = field(default_factory=dict)

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.plain_url else ("dflash",)

    def _url(self, mode: str) -> str:
        url = self.url if mode == "dflash" else self.plain_url
        assert url is not None
        return url

    def client(self, mode: str) -> OpenAIClient:
        url = self._url(mode)
        if url not in self._clients:
            self._clients[url] = OpenAIClient(url, self.timeout_s)
        return self._clients[url]

    def check(self) -> None:
        for mode in self.modes:
            names = self.client(mode).models()
            if self.model is not None and self.model not in names:
                raise DFlashError(f"the server at {self._url(mode)} serves {names}, not {self.model!r}; fix --model")
            if not names:
                raise DFlashError(f"the server at {self._url(mode)} lists no model; check its log")
            self._models[mode] = self.model or names[0]
        self.model = self._models["dflash"]  # what the report names: the model the DFlash server serves

    def warmup(self) -> None:
        for mode in self.modes:
            self.client(mode).chat(self._models[mode], [{"role": "user", "content": "Hello"}], 8, 0.0, None)

    def _metrics_url(self) -> str:
        return self.metrics_url or self.client("dflash").base_url + "/metrics"

    def _one(self, mode: str, concurrency: int, req: BenchRequest, t_submit: float) -> RequestRecord:
        try:
            a = self.client(mode).chat(self._models[mode], req.prompt.chat_messages, req.max_new_tokens,
                                       req.temperature, req.seed)
        except DFlashError as e:
            return failed_record(self.name, mode, concurrency, req, t_submit - self.t0, time.perf_counter() - self.t0,
                                 str(e))
        n = a.completion_tokens if a.completion_tokens is not None else len(a.token_ids or []) or (1 if a.text else 0)
        tau = a.stats.get("acceptance_length", 0.0)
        drafted = int(a.stats.get("total_draft_tokens", 0))
        accepted = int(a.stats.get("total_accepted_draft_tokens", 0))
        steps = int(a.stats.get("num_steps", 0)) or (round(accepted / (tau - 1)) if tau > 1 else 0)
        positions = "position_drafted" in a.stats and "position_accepted" in a.stats
        return RequestRecord(
            mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
            num_prompt_tokens=0, num_output_tokens=n, num_steps=steps, total_draft_tokens=drafted,
            total_accepted_draft_tokens=accepted, tau=tau, acceptance_rate=accepted / drafted if drafted else 0.0,
            t_submit=t_submit - self.t0, t_first=t_submit - self.t0 + (a.ttft_s if a.ttft_s is not None else a.latency_s),
            t_end=t_submit - self.t0 + a.latency_s, queue_s=0.0, finish_reason=a.finish_reason or "length",
            position_drafted=a.stats["position_drafted"] if positions else None,
            position_accepted=a.stats["position_accepted"] if positions else None,
            output_ids=a.token_ids, text=a.text, side=self.name,
        )

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> RunResult:
        from dflash_trt.bench.server_metrics import delta, scrape

        before: Any = None
        if mode == "dflash":  # before the run, in case the responses carry no statistics
            try:
                before = scrape(self._metrics_url())
            except DFlashError as e:  # only an error if the responses turn out to lack them too
                before = e
        records = closed_loop_threads(requests, concurrency, lambda r, t: self._one(mode, concurrency, r, t), on_done)
        counters = None
        if before is not None and not any(r.num_steps for r in records):  # the responses carried no statistics
            if isinstance(before, DFlashError):
                raise before
            counters = delta(scrape(self._metrics_url()), before)
        return RunResult(records, {"model": self._models.get(mode), "token_ids": self.client(mode).token_ids},
                         counters)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
