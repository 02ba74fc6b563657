"""The PyTorch backend: dflash-trt's own DFlash runtime behind the serving protocol (CPU or one GPU).

What it runs, stated plainly (``--backend pytorch``; ``reference`` is the old name):

- the batched runtime (runtime/batched/runtime.py): concurrent requests share one draft and one verify
  pass per step, up to the engine's max_batch_size rows; k <= K drafts per step are chosen by the
  policy in the settings (``adaptive`` by default when serving: measured step costs, never slower
  than plain decoding; ``fixed``: K every step, the reference loop's schedule). Each request gets
  exactly the answer it would get alone (greedy), and a seeded sample the same text under any load;
- for pairs the batched runtime cannot run (gpt-oss: sliding window and attention sinks), the
  reference loop one request at a time (runtime/reference/serial.py), K drafts every step. The choice is
  runtime/opener.open_runtime's (serving/backends.load_backend opens the runtime), which logs it
  with its reason; describe() repeats the reason.

ONE scheduler thread drives either runtime: it takes requests from a bounded queue, admits them
between steps, drops requests whose client left (or all of them at shutdown), runs a step, and
streams every sequence's new text back through its :class:`Generation`. The serial runtime is a
one-row use of the same scheduler (a step is a whole request).

One failing request never fails the others: a row the runtime fails alone (sampling parameters
that give no distribution, an exception inside the reference loop) and a row whose streaming
fails here end with :class:`GenerationFailed` for that request only; the rest of its batch goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import InvalidRequest
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.serving.detokenizer import IncrementalDetokenizer
from dflash_trt.serving.protocol import (
    Chunk,
    ChunkStats,
    GenerateRequest,
    Generation,
    GenerationFailed,
    ServerBusy,
    finish_reason,
    resolve_budget,
)
from dflash_trt.speculation import SpeculationSettings

log = logging.getLogger("dflash_trt.serving")


@dataclass
class _Job:
    generation: Generation
    prompt_ids: list[int]
    params: Any  # SamplingParams, max_tokens resolved, the tokenizer's stop ids added


@dataclass
class _Active:
    generation: Generation
    detok: IncrementalDetokenizer
    seq: Any = None  # BatchedSequence
    error: str | None = None  # streaming this request failed (it alone stops)


@dataclass
class PyTorchBackend:
    """dflash-trt's DFlash runtime for one engine (see the module docstring)."""

    engine_dir: Path
    # opened by runtime.opener.open_runtime: the BatchedRuntime, or the SerialRuntime (reference
    # loop) for pairs the batched runtime cannot run, which says why in its `reason`
    runtime: Any
    codec: TextCodec
    default_max_tokens: int
    max_queue: int = 64
    backend: str = "pytorch"
    _queue: queue.Queue[_Job | None] = field(init=False)
    _worker: threading.Thread = field(init=False)
    _closing: threading.Event = field(init=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue()
        self._closing = threading.Event()
        log.info("engine %s: %s", self.engine_dir, self.describe())
        self._worker = threading.Thread(target=self._schedule, name="dflash-runtime", daemon=True)
        self._worker.start()

    # -- what the runtime holds, by the names the serving layer reads
    @property
    def speculation(self) -> SpeculationSettings:
        return self.runtime.speculation

    @property
    def draft(self) -> Any:  # DFlashDraftModel
        return self.runtime.draft

    @property
    def max_seq_len(self) -> int:
        return self.runtime.max_seq_len

    @property
    def max_batch(self) -> int:  # rows decoded together (the engine's max_batch_size; 1 on the reference loop)
        return self.runtime.max_batch

    @property
    def why_serial(self) -> str | None:
        """Why the batched runtime does not serve this pair (None: it does)."""
        return getattr(self.runtime, "reason", None)

    def describe(self) -> str:
        s = self.speculation
        if self.why_serial is None:
            return (f"pytorch backend: batched runtime, up to {self.max_batch} requests per pass, policy {s.policy}, "
                    f"K={s.max_draft_len} of block {s.block_size}, draft method {s.draft_method}")
        return (f"pytorch backend: reference loop, one request at a time ({self.why_serial}), policy fixed, "
                f"K={s.max_draft_len} of block {s.block_size}, draft method {s.draft_method}")

    # -- submission (synchronous validation: the caller gets the error before anything is queued)
    def submit(self, request: GenerateRequest) -> Generation:
        params = resolve_budget(request.params, self.default_max_tokens, self.max_seq_len)
        ids = request.prompt_ids(self.codec)
        params = resolve_budget(params, self.default_max_tokens, self.max_seq_len, ids)
        if self._closing.is_set():
            raise ServerBusy("the engine is shutting down; retry on another replica")
        if self._queue.qsize() >= self.max_queue:
            raise ServerBusy(f"{self._queue.qsize()} requests already queued (max {self.max_queue}); retry later")
        generation = Generation(request)
        self._queue.put(_Job(generation, ids, params.with_stop_token_ids(self.codec.stop_token_ids)))
        return generation

    # -- the scheduler (one thread) --------------------------------------------------------------
    def _schedule(self) -> None:
        """Admit queued requests between steps, one step for all rows, stream tokens back."""
        rt = self.runtime
        active: dict[int, _Active] = {}
        accepting = True
        while True:
            while accepting:  # block for work only when nothing is running
                try:
                    job = self._queue.get(block=not rt.has_work())
                except queue.Empty:
                    break
                if job is None:
                    accepting = False
                    break
                self._admit(job, active)
            if not rt.has_work():
                if not accepting:
                    return
                continue
            for a in list(active.values()):  # clients that left or a shutdown: drop between steps
                if a.generation.is_cancelled() or self._closing.is_set():
                    rt.cancel(a.seq)
                    if a.seq.done:
                        self._complete(active.pop(id(a.seq)))
            if not rt.has_work():
                continue
            try:
                finished = rt.step()
            except Exception as e:  # noqa: BLE001 - a fault of the shared pass itself (not of one row's
                # parameters, which fail alone above): fail what ran in it, keep serving what comes next
                log.exception("generation step failed")
                for a in active.values():
                    rt.cancel(a.seq)
                    a.generation.put(GenerationFailed(f"generation failed: {type(e).__name__}: {e}"))
                    a.generation.end()
                active.clear()
                continue
            for seq in finished:
                self._complete(active.pop(id(seq)))

    def _admit(self, job: _Job, active: dict[int, _Active]) -> None:
        from dflash_trt.runtime.batched.runtime import SequenceRequest

        g = job.generation
        if g.is_cancelled() or self._closing.is_set():
            g.finish_cancelled()
            return
        a = _Active(g, IncrementalDetokenizer(self.codec, job.params.stop))
        try:
            a.seq = self.runtime.add(SequenceRequest(job.prompt_ids, job.params, self._streamer(a)))
        except InvalidRequest as e:
            g.put(e)
            g.end()
            return
        active[id(a.seq)] = a

    def _streamer(self, a: _Active):
        """The runtime's per-step callback: stream the new text; True stops generation after this
        step (a stop string, a cancelled client, shutdown, a failure of this request's own)."""

        def on_step(new_ids: list[int]) -> bool:
            try:
                delta = a.detok.add(new_ids)
            except Exception as e:  # noqa: BLE001 - this request stops alone, its batch goes on
                a.error = f"detokenizing failed: {type(e).__name__}: {e}"
                return True
            if delta:
                a.generation.put(Chunk(delta))
            return a.detok.stopped or a.generation.is_cancelled() or self._closing.is_set()

        return on_step

    def _complete(self, a: _Active) -> None:
        g, seq = a.generation, a.seq
        error = a.error or getattr(seq, "error", None)
        if error is not None:
            log.warning("request failed alone (the others of its batch go on): %s", error)
            g.put(GenerationFailed(error))
            g.end()
            return
        result = seq.result
        tail = a.detok.flush()
        reason = finish_reason(stop_string=a.detok.stopped, cancelled=g.is_cancelled() or self._closing.is_set(),
                               produced=bool(result.output_ids), runtime_reason=result.stats.finish_reason)
        stop_reason = None
        if reason == "stop":  # the stop string, else the stop token that ended it
            stop_reason = a.detok.stop_hit if a.detok.stopped else (result.output_ids[-1] if result.output_ids else None)
        queue_s = max(0.0, seq.t0 - g.submitted_at) if seq.t0 else time.perf_counter() - g.submitted_at
        stats = ChunkStats.from_generation(result.stats, queue_s, self.speculation.max_draft_len)
        g.put(Chunk(tail, finished=True, finish_reason=reason, stats=stats, stop_reason=stop_reason))
        g.end()

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """The runtime's prefix cache, runtime-wide (runtime/batched/prefix_cache.PrefixCache.stats): requests,
        ``queries`` and ``hits`` in TOKENS (vLLM's vllm:prefix_cache_queries / vllm:prefix_cache_hits),
        blocks cached and their budget; None where the runtime has none (the reference loop, or
        prefix_cache off). Plain ints read from another thread: a scrape may lag a step."""
        cache = getattr(self.runtime, "prefix_cache", None)
        return cache.stats() if cache is not None else None

    def runtime_stats(self) -> dict[str, Any]:
        """The runtime's state (policy decisions, costs, acceptance), for logs and debugging."""
        return self.runtime.stats()

    def shutdown(self, cancel_pending: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting work; cancel queued and running requests (each gets a final chunk)."""
        if cancel_pending:
            self._closing.set()
        self._queue.put(None)
        self._worker.join(timeout)
        self._closing.set()
        while True:  # anything still queued behind the sentinel
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.generation.finish_cancelled()
