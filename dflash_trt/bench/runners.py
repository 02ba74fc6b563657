"""What every side of a benchmark shares: requests, per-request records, and the closed loop.

A *side* is one system under test: our reference loop, our batched runtime, the vLLM peer, or a
server at a URL. Each runs the same requests in two *modes* (``plain`` decoding and ``dflash``)
at each concurrency level C and returns one :class:`RequestRecord` per request (plus run-level
figures a side alone can see, :class:`RunResult`).

Concurrency is a closed loop on every side: C users, each sends its next request when the
previous one ended (what `vllm bench serve --max-concurrency` and genai-perf's concurrency mode
do). Every record's clock starts when its request is SUBMITTED, so queueing shows up in ttft_s and
tokens_per_s (what a user sees), while tpot_s stays the decode pace of the request itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dflash_trt.bench.prompts import BenchPrompt
from dflash_trt.metrics import time_per_output_token, tokens_per_second

MODES = ("dflash", "plain")


@dataclass(frozen=True)
class BenchRequest:
    prompt: BenchPrompt
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass
class RequestRecord:
    """One request's figures, named as in dflash_trt.metrics. Times in seconds on the side's run clock."""

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
    # per-step detail: only a side that sees the steps has it (an endpoint reports totals)
    acceptance_lengths: list[int] | None = None
    position_drafted: list[int] | None = None
    position_accepted: list[int] | None = None
    output_ids: list[int] | None = None
    text: str | None = None
    side: str = ""  # which system produced it (reference, batched, vllm, vllm-eager, endpoint)
    server_decode_s: float | None = None  # an endpoint's own decode time (its latency minus queue and this: overhead)
    error: str | None = None  # a request an endpoint failed (counted, never summarised as a success)
    # (seconds on the run clock, tokens so far) after each step that committed tokens: a side that
    # sees its steps (the batched runtime) records it, for the throughput while all C decode (bench/steady.py)
    progress: list[tuple[float, int]] | None = None

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_submit

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_submit

    @property
    def tpot_s(self) -> float:
        return time_per_output_token(self.t_end - self.t_first, self.num_output_tokens)

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_second(self.num_output_tokens, self.latency_s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, tokens_per_s=self.tokens_per_s, latency_s=self.latency_s)
        return d


OnDone = Callable[[RequestRecord], None]


@dataclass
class RunResult:
    """One side, one mode, one concurrency level: its records and what only the side itself saw
    (`info`: the adaptive policy's cost table, per-pass timings, a server's counters, ...)."""

    records: list[RequestRecord]
    info: dict[str, Any] = field(default_factory=dict)
    # pooled acceptance counts from a server's metrics where its responses carry none
    counters: dict[str, Any] | None = None

    @property
    def wall_s(self) -> float:
        ok = [r for r in self.records if r.error is None]
        return max(r.t_end for r in ok) - min(r.t_submit for r in ok) if ok else 0.0


class Side(Protocol):
    name: str  # short key: reference, batched, vllm, vllm-eager, endpoint
    label: str  # what the table prints
    parallel: bool  # True: concurrent requests really share the device (batched passes / a server)
    modes: tuple[str, ...]  # what this side can measure

    def warmup(self) -> None: ...

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> RunResult: ...

    def close(self) -> None: ...


def closed_loop_threads(requests: Sequence[BenchRequest], concurrency: int,
                        one: Callable[[BenchRequest, float], RequestRecord], on_done: OnDone) -> list[RequestRecord]:
    """Run `one(request, t_submit)` with `concurrency` client threads; records in request order.
    For sides whose requests block a thread each (a queue in process, a network client)."""
    out: list[RequestRecord | None] = [None] * len(requests)

    def task(i: int) -> None:
        rec = one(requests[i], time.perf_counter())
        out[i] = rec
        on_done(rec)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        for f in [pool.submit(task, i) for i in range(len(requests))]:
            f.result()  # re-raises the first failure
    return [r for r in out if r is not None]
