"""Runners: turn benchmark requests into RequestRecords, `concurrency` requests in flight at a time.

The interface is one method, `run(mode, requests, concurrency, on_done)`, so a runner backed by
the batched runtime (many sequences per forward pass) can replace the serial one without touching
the sweep, the summaries or the plots.

Concurrency is a closed loop: C users, each sends its next request when the previous one ended.
Every record's clock starts when its request is SUBMITTED, so queueing shows up in ttft_s and
tokens_per_s (what a user sees), while tpot_s stays the decode pace of the request itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dflash_trt.bench.prompts import BenchPrompt
from dflash_trt.errors import DFlashError

MODES = ("dflash", "plain")


@dataclass(frozen=True)
class BenchRequest:
    prompt: BenchPrompt
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass
class RequestRecord:
    """One request's figures, named as in dflash_trt.metrics. Times in seconds from sweep start."""

    mode: str
    concurrency: int
    prompt_id: str
    category: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    tau: float
    acceptance_rate: float
    t_submit: float
    t_first: float  # first output token (in process) / first text (endpoint)
    t_end: float
    queue_s: float  # waiting for the runtime before decoding started
    finish_reason: str
    # per-step detail: only the in-process runner sees the steps (an endpoint reports totals)
    acceptance_lengths: list[int] | None = None
    position_drafted: list[int] | None = None
    position_accepted: list[int] | None = None
    output_ids: list[int] | None = None
    text: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_submit

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_submit

    @property
    def tpot_s(self) -> float:
        n = self.num_output_tokens
        return (self.t_end - self.t_first) / (n - 1) if n > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, tokens_per_s=self.tokens_per_s, latency_s=self.latency_s)
        return d


OnDone = Callable[[RequestRecord], None]


class Runner(Protocol):
    name: str
    parallel: bool  # True: concurrent requests really overlap on the device
    modes: tuple[str, ...]  # what this runner can measure

    def warmup(self) -> None: ...

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> list[RequestRecord]: ...


def _closed_loop(requests: Sequence[BenchRequest], concurrency: int, one: Callable[[BenchRequest, float], RequestRecord],
                 on_done: OnDone) -> list[RequestRecord]:
    """Run `one(request, t_submit)` with `concurrency` workers; records in request order."""
    out: list[RequestRecord | None] = [None] * len(requests)

    def task(i: int) -> None:
        rec = one(requests[i], time.perf_counter())
        out[i] = rec
        on_done(rec)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        for f in [pool.submit(task, i) for i in range(len(requests))]:
            f.result()  # re-raises the first failure
    return [r for r in out if r is not None]


# ------------------------------------------------------------------------------------------------
# in process: one decoding thread (the reference loop, or the batched runtime at one sequence)
# ------------------------------------------------------------------------------------------------
@dataclass
class InProcessRunner:
    """One request at a time on a loaded pair: DFlash with the pair's speculation settings (policy
    fixed: dflash_generate, K drafts every step; adaptive: the batched runtime at one sequence,
    choosing k <= K per step and learning across requests), plain decoding with
    autoregressive_generate.

    Concurrent users QUEUE for the one decoding thread, first come first served (as in the
    server's serial path): total tokens/s stays flat and tokens/s per user falls as 1/C. That is
    the honest figure for this runner (parallel=False is recorded). (A plain lock would not do:
    it is not fair, so a user thread that just finished could take it again and starve the others.)
    """

    pair: Any  # dflash_trt.pairs.ResolvedPair
    t0: float = field(default_factory=time.perf_counter)
    name: str = "in process (serial)"
    parallel: bool = False
    modes: tuple[str, ...] = MODES
    _decoder: ThreadPoolExecutor | None = None  # the one decoding thread, FIFO
    _ids: dict[str, list[int]] = field(default_factory=dict)
    _batched: Any = None  # BatchedRuntime for the adaptive policy, kept across requests

    def encode(self, prompt: BenchPrompt) -> list[int]:
        if prompt.id not in self._ids:
            self._ids[prompt.id] = self.pair.codec.encode_messages(prompt.chat_messages)
        return self._ids[prompt.id]

    def _params(self, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> Any:
        from dflash_trt.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                              stop_token_ids=self.pair.codec.stop_token_ids)

    def _dflash(self, ids: list[int], params: Any) -> Any:
        from dflash_trt.runtime.generate import dflash_generate

        spec = self.pair.speculation
        if spec.policy == "fixed":
            return dflash_generate(self.pair.draft, self.pair.target, ids, params, spec)
        from dflash_trt.runtime.batched import BatchedRuntime, batched_generate

        need = len(ids) + params.resolve_max_tokens()
        if self._batched is None or self._batched.max_seq_len < need:
            self._batched = BatchedRuntime(self.pair.target, self.pair.draft, max_batch=1,
                                           max_seq_len=max(need, 1024), speculation=spec)
        return batched_generate(self.pair.draft, self.pair.target, [ids], params, runtime=self._batched)[0]

    def warmup(self) -> None:
        """First calls pay for lazy initialisation in torch/transformers: keep them out of the figures."""
        from dflash_trt.runtime.generate import autoregressive_generate

        ids = self.encode(BenchPrompt("warmup", "warmup", (("user", "Hello"),)))
        self._dflash(ids, self._params(8))
        autoregressive_generate(self.pair.target, ids, self._params(8))

    def _one(self, mode: str, concurrency: int, req: BenchRequest, t_submit: float) -> RequestRecord:
        from dflash_trt.runtime.generate import autoregressive_generate

        ids = self.encode(req.prompt)
        params = self._params(req.max_new_tokens, req.temperature, req.seed)

        def decode() -> tuple[float, Any]:
            t = time.perf_counter()
            if mode == "dflash":
                return t, self._dflash(ids, params)
            return t, autoregressive_generate(self.pair.target, ids, params)

        assert self._decoder is not None
        t_start, result = self._decoder.submit(decode).result()
        s = result.stats
        # GenerationStats times count from t_start; shift them onto the sweep clock
        base = t_start - self.t0
        return RequestRecord(
            mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
            num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=s.num_output_tokens, num_steps=s.num_steps,
            total_draft_tokens=s.total_draft_tokens, total_accepted_draft_tokens=s.total_accepted_draft_tokens,
            tau=s.tau, acceptance_rate=s.acceptance_rate, t_submit=t_submit - self.t0, t_first=base + s.ttft_s,
            t_end=base + s.total_time_s, queue_s=t_start - t_submit, finish_reason=s.finish_reason,
            acceptance_lengths=list(s.acceptance_lengths), position_drafted=list(s.position_drafted),
            position_accepted=list(s.position_accepted), output_ids=list(result.output_ids),
        )

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> list[RequestRecord]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-decode") as self._decoder:
            return _closed_loop(requests, concurrency, lambda r, t: self._one(mode, concurrency, r, t), on_done)


# ------------------------------------------------------------------------------------------------
# a Triton gRPC endpoint (tritonserver with TensorRT-LLM, or `dflash-trt serve`)
# ------------------------------------------------------------------------------------------------
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


def _steps_of(tau: float, accepted: int, num_output_tokens: int) -> int:
    """Verification steps of a request from the totals an endpoint reports.

    tau = 1 + accepted / steps, so steps = accepted / (tau - 1); with nothing accepted every step
    committed exactly one token after the prefill's first one, so steps = output tokens - 1.
    """
    if accepted > 0 and tau > 1.0:
        return max(1, round(accepted / (tau - 1.0)))
    return max(0, num_output_tokens - 1)


@dataclass
class EndpointRunner:
    """Requests over Triton's gRPC streaming API through dflash_trt.serving.client.

    `mode` names what the server at `url` runs: the DFlash model; a plain-decoding baseline needs a
    second server of the same target without speculation (`plain_url`). Concurrency is real here:
    the server decides how requests share the device.
    """

    url: str
    model: str = "dflash"
    plain_url: str | None = None
    timeout_s: float = 600.0
    t0: float = field(default_factory=time.perf_counter)
    name: str = "endpoint (Triton gRPC)"
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
            generate(url, "Hello", model=self.model, stream=True, timeout_s=self.timeout_s, max_tokens=8)

    def _one(self, mode: str, concurrency: int, req: BenchRequest, t_submit: float) -> RequestRecord:
        from dflash_trt.serving.client import generate

        text = req.prompt.single_user_text
        if text is None:  # text_input carries one user turn; the server applies the chat template
            raise DFlashError(f"prompt {req.prompt.id!r} has several chat turns; an endpoint takes one user message "
                              f"per request: give one user turn per line in --prompts")
        url = self.url if mode == "dflash" else self.plain_url
        assert url is not None
        r = generate(url, text, model=self.model, stream=True, timeout_s=self.timeout_s,
                     max_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed)
        t_end = t_submit + r.latency_s
        n = int(r.stats.get("num_output_tokens", 0))
        tau = float(r.stats.get("acceptance_length", 1.0) or 1.0)
        accepted = int(r.stats.get("total_accepted_draft_tokens", 0))
        drafted = int(r.stats.get("total_draft_tokens", 0))
        # no text at all (e.g. only a stop token): the first token came with the final response
        t_first = t_submit + (r.ttft_s if r.chunks else r.latency_s)
        return RequestRecord(
            mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
            num_prompt_tokens=0, num_output_tokens=n, num_steps=_steps_of(tau, accepted, n),
            total_draft_tokens=drafted, total_accepted_draft_tokens=accepted, tau=tau,
            acceptance_rate=accepted / drafted if drafted else 0.0, t_submit=t_submit - self.t0,
            t_first=t_first - self.t0, t_end=t_end - self.t0, queue_s=float(r.stats.get("queue_time_ms", 0.0)) / 1e3,
            finish_reason=r.finish_reason, text=r.text,
        )

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> list[RequestRecord]:
        return _closed_loop(requests, concurrency, lambda r, t: self._one(mode, concurrency, r, t), on_done)
