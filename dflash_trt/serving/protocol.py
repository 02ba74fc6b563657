"""The serving protocol: what a frontend (Triton's model.py, an HTTP/OpenAI server) hands a
backend and what it gets back. Backends (serving/pytorch_backend.py, tensorrt_llm_backend.py)
implement :class:`Backend`; serving/backends.py picks and loads one.

    backend = load_backend(engine_dir, BackendSettings(...))
    generation = backend.submit(GenerateRequest(prompt="...", params=SamplingParams(...)))
    for chunk in generation:            # blocks; chunk.text is new text only
        ...                             # the last chunk: finished, finish_reason, stats
    backend.shutdown()

- :class:`GenerateRequest`: ONE user turn (``prompt``, chat template applied unless ``raw``) or a
  conversation (``messages``, OpenAI's [{"role", "content"}]), and its :class:`SamplingParams`
  (validated when built; ``max_tokens`` None = the backend's ``default_max_tokens``).
- ``submit`` validates synchronously: a bad request raises :class:`InvalidRequest`
  (INVALID_ARGUMENT / HTTP 400) and a full queue or a shutdown :class:`ServerBusy`
  (UNAVAILABLE / HTTP 503) before anything is queued.
- :class:`Generation`: the request's :class:`Chunk` s in order, to iterate in a thread or with
  ``async for`` on an event loop (the HTTP and gRPC frontends). ``cancel()`` (or leaving the
  iteration early, or a watcher such as a Triton response sender's ``is_cancelled``) stops it;
  it then ends with finish_reason ``cancelled``. A request that fails while running (alone: the
  other requests of its batch go on) raises :class:`GenerationFailed` from the iteration.
- :class:`ChunkStats`: the final chunk's per-request statistics, named as in dflash_trt.metrics
  (``tau``: mean tokens committed per verification step, bonus token included).

Finish reasons: ``stop`` (a stop token or stop string), ``length`` (max_tokens), ``cancelled``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.runtime.decoding.tokens import ChatMessage, TextCodec, check_messages
from dflash_trt.sampling_params import GREEDY, SamplingParams

__all__ = ["Backend", "Chunk", "ChunkStats", "FINISH_REASONS", "GenerateRequest", "Generation", "GenerationFailed",
           "InvalidRequest", "ServerBusy", "finish_reason"]

FINISH_REASONS = ("stop", "length", "cancelled")


class ServerBusy(DFlashError):
    """The queue is full or the backend is shutting down (UNAVAILABLE / HTTP 503): retry later."""


class GenerationFailed(DFlashError):
    """One request failed while it ran (INTERNAL / HTTP 500); the requests decoded beside it are
    unaffected."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request: a prompt (one user turn) or chat messages, and its sampling parameters."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: SamplingParams = GREEDY
    raw: bool = False  # prompt only: the bare text, no chat template

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("a request carries a prompt or chat messages (exactly one of them)")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(check_messages(self.messages)))
        elif not isinstance(self.prompt, str) or not self.prompt:
            raise InvalidRequest("the prompt is empty; send non-empty text")
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams, got {type(self.params).__name__}")

    def prompt_ids(self, codec: TextCodec) -> list[int]:
        """The token ids the target sees (InvalidRequest when they come out empty)."""
        if self.messages is not None:
            return codec.encode_messages(list(self.messages))
        assert self.prompt is not None
        return codec.encode(self.prompt, raw=self.raw)


@dataclass
class ChunkStats:
    """Per-request speculative statistics, named as in dflash_trt.metrics. The per-step detail
    (steps, the per-position counts, the histogram) comes from a runtime that sees the steps (the
    pytorch backend); the TensorRT-LLM backend reports totals, and leaves them empty."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    tau: float = 0.0  # mean tokens committed per verification step, bonus token included
    acceptance_rate: float = 0.0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    queue_s: float = 0.0  # time spent waiting for the runtime before decoding started
    decode_s: float = 0.0  # time inside the decoding loop (prefill included)
    num_steps: int = 0  # verification steps (a step that drafted nothing included)
    max_draft_len: int = 0  # K of the runtime that decoded it (vLLM's num_spec_tokens)
    # index j: steps that drafted / accepted draft slot j+1 (0-based position j)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)  # [drafts that accepted exactly j], j = 0..K
    # prefix caching (the batched runtime's, dflash_trt/metrics.py): prompt tokens served from the cache
    # (OpenAI's usage.prompt_tokens_details.cached_tokens), the prompt's blocks reused / computed
    num_cached_tokens: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0

    @property
    def kv_cache_hit_rate(self) -> float:
        """The prompt's blocks served from the prefix cache / all its blocks (0 without blocks)."""
        blocks = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / blocks if blocks else 0.0

    @property
    def num_drafts(self) -> int:
        """Steps that drafted at least one token (each drafted slot 1)."""
        return self.position_drafted[0] if self.position_drafted else 0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @classmethod
    def from_generation(cls, stats: Any, queue_s: float, max_draft_len: int = 0) -> "ChunkStats":
        """From a runtime's GenerationStats (dflash_trt.metrics); `max_draft_len`: the runtime's K."""
        return cls(
            num_prompt_tokens=stats.num_prompt_tokens, num_output_tokens=stats.num_output_tokens,
            tau=stats.tau, acceptance_rate=stats.acceptance_rate,
            total_draft_tokens=stats.total_draft_tokens, total_accepted_draft_tokens=stats.total_accepted_draft_tokens,
            ttft_s=stats.ttft_s, tpot_s=stats.tpot_s, queue_s=queue_s, decode_s=stats.total_time_s,
            num_steps=stats.num_steps, max_draft_len=max_draft_len, position_drafted=list(stats.position_drafted),
            position_accepted=list(stats.position_accepted),
            acceptance_histogram=stats.acceptance_histogram(max_draft_len),
            num_cached_tokens=stats.num_cached_tokens, num_reused_blocks=stats.num_reused_blocks,
            num_missed_blocks=stats.num_missed_blocks,
        )


@dataclass
class Chunk:
    text: str  # text added since the previous chunk
    finished: bool = False
    finish_reason: str = ""  # set on the final chunk: stop | length | cancelled
    stats: ChunkStats | None = None  # set on the final chunk
    # final chunk, finish_reason "stop": the stop string or stop token id that ended it (None otherwise)
    stop_reason: str | int | None = None


def finish_reason(stop_string: bool, cancelled: bool, produced: bool, runtime_reason: str) -> str:
    """A request's finish reason, decided once: a stop string ends it as ``stop`` (even when the
    client left in the same step), a cancel (client gone, shutdown) or a request that produced
    nothing as ``cancelled``, otherwise what the runtime saw (``stop`` token or ``length``)."""
    if stop_string:
        return "stop"
    if cancelled or not produced:
        return "cancelled"
    return runtime_reason


class Generation:
    """The chunks of one request, in order. Iterating blocks; `cancel()` (or closing) stops it."""

    _END = object()

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self._chunks: queue.Queue[Any] = queue.Queue()
        self._watchers: list[Callable[[], bool]] = []
        self._listener: Callable[[], None] | None = None  # wakes an async consumer

    # producer side (the backend)
    def put(self, item: Chunk | BaseException) -> None:
        self._chunks.put(item)
        listener = self._listener
        if listener is not None:
            listener()

    def end(self) -> None:
        self.put(self._END)

    def finish_cancelled(self) -> None:
        """End a request that never ran (a client that left while queued, a shutdown)."""
        self.put(Chunk("", finished=True, finish_reason="cancelled", stats=ChunkStats()))
        self.end()

    # consumer side
    def cancel(self) -> None:
        self.cancelled.set()

    def watch(self, is_cancelled: Callable[[], bool]) -> None:
        """Also stop when `is_cancelled()` turns True (e.g. a Triton response sender's), polled
        before the request starts and after every decoding step, so a client that left while
        queued never costs a forward pass."""
        self._watchers.append(is_cancelled)

    def is_cancelled(self) -> bool:
        if not self.cancelled.is_set() and any(w() for w in self._watchers):
            self.cancelled.set()
        return self.cancelled.is_set()

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                item = self._chunks.get()
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # the consumer stopped early (error, disconnect): stop generating for it
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        """The chunks on an event loop: the producer (the backend's thread) wakes this consumer
        through the loop, so no thread waits per request."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed (server stopped): nobody is waiting any more
                pass

        self._listener = wake
        try:
            while True:
                try:
                    item = self._chunks.get_nowait()
                except queue.Empty:
                    ready.clear()
                    if self._chunks.empty():  # re-check: a put between get_nowait and clear() woke nobody
                        await ready.wait()
                    continue
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # the consumer stopped early (error, disconnect): stop generating for it
            self._listener = None
            self.cancel()

    def text(self) -> tuple[str, Chunk]:
        """Drain: the whole text and the final chunk (the non-streaming path)."""
        parts, last = [], Chunk("")
        for chunk in self:
            parts.append(chunk.text)
            last = chunk
        return "".join(parts), last


class Backend(Protocol):
    """What serves requests for one engine (PyTorch or TensorRT-LLM)."""

    backend: str  # "pytorch" | "tensorrt_llm"
    max_seq_len: int
    default_max_tokens: int

    def submit(self, request: GenerateRequest) -> Generation: ...

    def describe(self) -> str: ...

    def runtime_stats(self) -> dict[str, Any]: ...

    def shutdown(self, cancel_pending: bool = True) -> None: ...


def resolve_budget(params: SamplingParams, default_max_tokens: int, max_seq_len: int,
                   prompt_tokens: Sequence[int] | None = None) -> SamplingParams:
    """`params` with max_tokens resolved to the backend's default, checked against max_seq_len
    (InvalidRequest with the numbers and the fix when the request does not fit)."""
    n = params.resolve_max_tokens(default_max_tokens)
    if n > max_seq_len:
        raise InvalidRequest(f"max_tokens={n} is above this engine's max_seq_len={max_seq_len}; ask for fewer "
                             f"tokens or rebuild with a larger --max-seq-len")
    if prompt_tokens is not None and len(prompt_tokens) + n > max_seq_len:
        raise InvalidRequest(f"prompt ({len(prompt_tokens)} tokens) + max_tokens ({n}) exceeds this engine's "
                             f"max_seq_len={max_seq_len}; shorten the prompt or lower max_tokens")
    return params if params.max_tokens == n else params.replace(max_tokens=n)
