"""A Triton gRPC endpoint as a benchmark side (tritonserver with TensorRT-LLM, or `dflash-trt serve`).

Requests go through dflash_trt.serving.client (streaming on a decoupled repository, unary on one that is
not: TTFT is only meaningful against `deploy triton --decoupled`); every response
carries the model's statistics outputs (tau, total_draft_tokens, ...,
queue_time_ms, decode_time_ms, the per-position counts), so each request has its own tau and
per-position acceptance, and its latency splits into
waiting for the runtime, decoding, and the rest (gRPC, (de)serialisation, the Python-backend
stub's IPC: server overhead). ``mode`` names what a server runs: `url` the DFlash model; a plain
baseline needs a second server of the same target without speculation (`plain_url`).
A request the server fails is recorded with its error and counted; the run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_trt.bench.runners import MODES, BenchRequest, OnDone, RequestRecord, RunResult, closed_loop_threads
from dflash_trt.errors import DFlashError


def check_endpoint(url: str, model: str, timeout_s: float = 5.0) -> None:
    """Fail fast with one line if nothing serves `model` at `url`."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(url=url) as c:
            live = c.is_server_live(client_timeout=timeout_s)
            ready = live and c.is_model_ready(model, client_timeout=timeout_s)
    except InferenceServerException as e:
        raise DFlashError(f"cannot reach a Triton gRPC server at {url} ({' '.join(str(e.message()).split())}); "
                          f"start one with `dflash-trt serve` or fix --url") from None
    except Exception as e:  # noqa: BLE001 - e.g. a malformed address rejected by grpc
        raise DFlashError(f"cannot use --url {url!r} ({type(e).__name__}: {e}); give host:port") from None
    if not ready:
        raise DFlashError(f"the server at {url} does not have model {model!r} ready; check --model or the server log")


def steps_of(tau: float, accepted: int, num_output_tokens: int) -> int:
    """Verification steps of a request from the totals an endpoint reports.

    tau = 1 + accepted / steps, so steps = accepted / (tau - 1); with nothing accepted every step
    committed exactly one token after the prefill's first one, so steps = output tokens - 1.
    """
    if accepted > 0 and tau > 1.0:
        return max(1, round(accepted / (tau - 1.0)))
    return max(0, num_output_tokens - 1)


def failed_record(side: str, mode: str, concurrency: int, req: BenchRequest, t_submit: float, t_end: float,
                  error: str) -> RequestRecord:
    return RequestRecord(mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
                         num_prompt_tokens=0, num_output_tokens=0, num_steps=0, total_draft_tokens=0,
                         total_accepted_draft_tokens=0, tau=0.0, acceptance_rate=0.0, t_submit=t_submit,
                         t_first=t_end, t_end=t_end, queue_s=0.0, finish_reason="error", side=side, error=error)


def request_text(req: BenchRequest) -> tuple[str, str]:
    """(text_input, text_input_format) of a prompt: one user turn as it is ("user"), a conversation
    as a JSON array of its messages ("messages"); the model applies the chat template either way."""
    import json

    text = req.prompt.single_user_text
    if text is not None:
        return text, "user"
    return json.dumps(list(req.prompt.chat_messages)), "messages"


@dataclass
class TritonEndpointSide:
    url: str
    model: str = "dflash"
    plain_url: str | None = None
    timeout_s: float = 600.0
    stream: bool = True
    t0: float = field(default_factory=time.perf_counter)
    name: str = "endpoint"
    label: str = "endpoint (Triton gRPC)"
    parallel: bool = True

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.plain_url else ("dflash",)

    def check(self) -> None:
        check_endpoint(self.url, self.model)
        if self.plain_url:
            check_endpoint(self.plain_url, self.model)

    def warmup(self) -> None:
        from dflash_trt.serving.client import generate

        for url in {self.url, self.plain_url} - {None}:
            generate(url, "Hello", model=self.model, stream=self.stream, timeout_s=self.timeout_s, max_tokens=8)

    def _one(self, mode: str, concurrency: int, req: BenchRequest, t_submit: float) -> RequestRecord:
        from dflash_trt.serving.client import generate

        text, text_format = request_text(req)
        url = self.url if mode == "dflash" else self.plain_url
        assert url is not None
        try:
            r = generate(url, text, model=self.model, stream=self.stream, timeout_s=self.timeout_s,
                         max_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed,
                         text_input_format=text_format)
        except DFlashError as e:
            return failed_record(self.name, mode, concurrency, req, t_submit - self.t0, time.perf_counter() - self.t0,
                                 str(e))
        t_end = t_submit + r.latency_s
        n = int(r.stats.get("num_output_tokens", 0))
        tau = float(r.stats.get("tau", 1.0) or 1.0)
        accepted = int(r.stats.get("total_accepted_draft_tokens", 0))
        drafted = int(r.stats.get("total_draft_tokens", 0))
        # no text at all (e.g. only a stop token), or one response: the first token came with the final one
        t_first = t_submit + (r.ttft_s if r.chunks else r.latency_s)
        decode_ms = r.stats.get("decode_time_ms")
        return RequestRecord(
            mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
            num_prompt_tokens=int(r.stats.get("num_input_tokens", 0)), num_output_tokens=n,
            num_steps=int(r.stats["num_steps"]) if "num_steps" in r.stats else steps_of(tau, accepted, n),
            total_draft_tokens=drafted, total_accepted_draft_tokens=accepted, tau=tau,
            acceptance_rate=accepted / drafted if drafted else 0.0, t_submit=t_submit - self.t0,
            t_first=t_first - self.t0, t_end=t_end - self.t0, queue_s=float(r.stats.get("queue_time_ms", 0.0)) / 1e3,
            finish_reason=r.finish_reason, text=r.text, side=self.name,
            server_decode_s=float(decode_ms) / 1e3 if decode_ms is not None else None,
            # the per-position counts, where the server sends them (dflash-trt's model.py does)
            position_drafted=r.stats.get("position_drafted"), position_accepted=r.stats.get("position_accepted"),
        )

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> RunResult:
        return RunResult(closed_loop_threads(requests, concurrency, lambda r, t: self._one(mode, concurrency, r, t),
                                             on_done))

    def close(self) -> None:
        pass
