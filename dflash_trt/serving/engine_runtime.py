"""Run requests against an engine directory: the logic behind the Triton model's model.py.

Interface (kept small so a batched runtime can replace the serial one):

    engine = load_engine_runtime(engine_dir)          # picks TensorRT-LLM or the reference runtime
    for chunk in engine.submit(GenerateRequest(...)): # validates synchronously, then streams
        chunk.text, chunk.finished, chunk.stats
    engine.shutdown()

The reference runtime decodes concurrent requests TOGETHER with the batched runtime
(dflash_trt.runtime.batched): one scheduler thread takes requests from a bounded queue, admits
them into the running batch between steps (up to the engine's max_batch_size rows), runs one
draft + verify pass per step for all rows, and streams each sequence's new tokens back. Each
request still gets exactly the answer it would get alone (greedy), and the adaptive policy picks
the draft length per step so that sharing passes never makes DFlash slower than plain decoding.
Pairs the batched runtime cannot run (GptOss: sliding window + sinks) fall back to one request at
a time through dflash_generate; the fallback and its reason are logged. Cancelling a request (the
client went away) makes the next `on_step` callback return True (or the scheduler drops it
between steps), which frees its row for the next request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash_trt.errors import DFlashError

log = logging.getLogger("dflash_trt.serving")

FINISH_REASONS = ("stop", "length", "cancelled")


class RequestError(DFlashError):
    """The request itself is invalid (maps to INVALID_ARGUMENT); the server keeps serving."""


class ServerBusy(DFlashError):
    """The queue is full or the engine is shutting down (maps to UNAVAILABLE)."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int | None = None  # None: the engine's default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the output is cut before the first one
    raw: bool = False  # True: do not apply the chat template


@dataclass
class ChunkStats:
    """Per-request speculative statistics, named as in dflash_trt.metrics (tau = acceptance_length)."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    acceptance_length: float = 0.0  # tau: mean tokens committed per step, bonus token included
    acceptance_rate: float = 0.0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    queue_s: float = 0.0  # time spent waiting for the runtime before decoding started
    decode_s: float = 0.0  # time inside the decoding loop (prefill included)


@dataclass
class Chunk:
    text: str  # text added since the previous chunk
    finished: bool = False
    finish_reason: str = ""  # set on the final chunk: stop | length | cancelled
    stats: ChunkStats | None = None  # set on the final chunk


class Generation:
    """The chunks of one request, in order. Iterating blocks; `cancel()` (or closing) stops it."""

    _END = object()

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self._chunks: queue.Queue[Any] = queue.Queue()
        self._watchers: list[Callable[[], bool]] = []

    # producer side (the runtime)
    def put(self, item: Chunk | BaseException) -> None:
        self._chunks.put(item)

    def end(self) -> None:
        self._chunks.put(self._END)

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

    def text(self) -> tuple[str, Chunk]:
        """Drain: the whole text and the final chunk (the non-streaming path)."""
        parts, last = [], Chunk("")
        for chunk in self:
            parts.append(chunk.text)
            last = chunk
        return "".join(parts), last


class EngineRuntime(Protocol):
    backend: str
    max_seq_len: int
    default_max_tokens: int

    def submit(self, request: GenerateRequest) -> Generation: ...

    def shutdown(self, cancel_pending: bool = True) -> None: ...


# ------------------------------------------------------------------------------------------------
# incremental detokenization with stop strings
# ------------------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the final text.

    Byte-level BPE can end on half a UTF-8 character (decoded as U+FFFD until the next token
    completes it), and the tail may be the start of a stop string: both are held back until
    they are settled, so a streamed answer never has to take text back.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), lock: Any = None) -> None:
        self.tokenizer = tokenizer
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def _decode(self) -> str:
        # Whole-sequence decode each step: O(n^2) chars over a request, negligible next to a
        # forward pass at these lengths, and immune to tokenizers' context-dependent spacing.
        with self.lock:
            return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _delta(self, text: str, upto: int) -> str:
        if not text.startswith(self.emitted):  # decoder rewrote already-sent text: never retract
            log.debug("detokenizer: text is not prefix-stable; continuing from the emitted length")
        n = len(self.emitted)
        delta = text[n:upto] if upto > n else ""
        self.emitted += delta
        return delta

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        text = self._decode()
        if self.stop:
            start = max(0, len(self.emitted) - max(map(len, self.stop)))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._delta(text, min(hits))
        stable = text.rstrip("\ufffd")
        upto = len(stable)
        for s in self.stop:  # hold back a tail that could still become a stop string
            for k in range(min(len(s) - 1, len(stable)), 0, -1):
                if stable.endswith(s[:k]):
                    upto = min(upto, len(stable) - k)
                    break
        return self._delta(text, upto)

    def flush(self) -> str:
        """The rest of the text at the end of generation (nothing after a stop string)."""
        if self.stopped:
            return ""
        return self._delta(self._decode(), 1 << 62)


# ------------------------------------------------------------------------------------------------
# the reference runtime (PyTorch, one request at a time)
# ------------------------------------------------------------------------------------------------
def _stats_of(gen_stats: Any, queue_s: float) -> ChunkStats:
    return ChunkStats(
        num_prompt_tokens=gen_stats.num_prompt_tokens, num_output_tokens=gen_stats.num_output_tokens,
        acceptance_length=gen_stats.tau, acceptance_rate=gen_stats.acceptance_rate,
        total_draft_tokens=gen_stats.total_draft_tokens,
        total_accepted_draft_tokens=gen_stats.total_accepted_draft_tokens,
        ttft_s=gen_stats.ttft_s, tpot_s=gen_stats.tpot_s, queue_s=queue_s, decode_s=gen_stats.total_time_s,
    )


@dataclass
class _Job:
    generation: Generation
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class _Active:
    generation: Generation
    seq: Any  # BatchedSequence
    detok: IncrementalDetokenizer


@dataclass
class ReferenceRuntime:
    """dflash_trt's own DFlash runtime behind the serving interface (CPU or one GPU)."""

    engine_dir: Path
    target: Any  # TargetAdapter
    draft: Any  # DFlashDraftModel
    tokenizer: Any
    stop_token_ids: list[int]
    max_seq_len: int
    default_max_tokens: int
    max_queue: int = 64
    max_batch: int = 8  # rows decoded together (the engine's max_batch_size)
    speculation: str = "adaptive"  # adaptive | full (see TritonRepoSettings.speculation)
    cuda_graphs: bool = False  # see TritonRepoSettings.cuda_graphs
    backend: str = "reference"
    batched: Any = field(init=False, default=None)  # BatchedRuntime, or None: one request at a time
    _queue: queue.Queue[_Job | None] = field(init=False)
    _worker: threading.Thread = field(init=False)
    _closing: threading.Event = field(init=False)
    # HF fast tokenizers are Rust objects that can raise "Already borrowed" when two threads use
    # one at once; requests are encoded on server threads while the worker decodes.
    _tok_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._queue = queue.Queue()
        self._closing = threading.Event()
        from dflash_trt.runtime.batched import BatchedRuntime, unsupported_reason

        why = unsupported_reason(self.target.model, self.draft)
        if why is None:
            from dflash_trt.runtime.policy import FixedPolicy

            policy = FixedPolicy(self.draft.block_size - 1) if self.speculation == "full" else None
            self.batched = BatchedRuntime(self.target, self.draft, max_batch=self.max_batch,
                                          max_seq_len=self.max_seq_len, policy=policy, cuda_graphs=self.cuda_graphs)
            log.info("engine %s: batched runtime, up to %d requests per pass", self.engine_dir, self.max_batch)
        else:
            log.warning("engine %s: requests run one at a time (%s)", self.engine_dir, why)
        run = self._run_batched if self.batched is not None else self._run
        self._worker = threading.Thread(target=run, name="dflash-runtime", daemon=True)
        self._worker.start()

    # -- validation (synchronous: the caller gets the error before anything is queued) ---------
    def encode(self, request: GenerateRequest) -> list[int]:
        from dflash_trt.generation_cli import encode_prompt

        with self._tok_lock:
            return encode_prompt(self.tokenizer, request.prompt, request.raw, int(self.target.vocab_size))

    def validate(self, request: GenerateRequest) -> tuple[list[int], int]:
        if not request.prompt:
            raise RequestError("text_input is empty; send a non-empty prompt")
        max_tokens = self.default_max_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens} must be >= 1")
        if max_tokens > self.max_seq_len:
            raise RequestError(f"max_tokens={max_tokens} is above this engine's max_seq_len={self.max_seq_len}; "
                               f"ask for fewer tokens or rebuild with a larger --max-seq-len")
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise RequestError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={request.temperature} "
                               f"top_p={request.top_p}")
        ids = self.encode(request)
        if len(ids) + max_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds this engine's "
                               f"max_seq_len={self.max_seq_len}; shorten the prompt or lower max_tokens")
        return ids, max_tokens

    def submit(self, request: GenerateRequest) -> Generation:
        ids, max_tokens = self.validate(request)
        if self._closing.is_set():
            raise ServerBusy("the engine is shutting down; retry on another replica")
        if self._queue.qsize() >= self.max_queue:
            raise ServerBusy(f"{self._queue.qsize()} requests already queued (max {self.max_queue}); retry later")
        generation = Generation(request)
        self._queue.put(_Job(generation, ids, max_tokens))
        return generation

    # -- the worker -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            g = job.generation
            if g.is_cancelled() or self._closing.is_set():
                g.put(Chunk("", finished=True, finish_reason="cancelled", stats=ChunkStats()))
                g.end()
                continue
            try:
                self._generate(job)
            except Exception as e:  # noqa: BLE001 - report to this request, keep serving others
                log.exception("generation failed")
                g.put(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
            g.end()

    # -- the batched scheduler ------------------------------------------------------------------
    def _run_batched(self) -> None:
        """Admit queued requests between steps, one shared step for all rows, stream tokens back."""
        rt = self.batched
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
                    self._complete(active.pop(id(a.seq)))
            if not rt.has_work():
                continue
            try:
                finished = rt.step()
            except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving others
                log.exception("batched generation step failed")
                for a in active.values():
                    rt.cancel(a.seq)
                    a.generation.put(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
                    a.generation.end()
                active.clear()
                continue
            for seq in finished:
                self._complete(active.pop(id(seq)))

    def _admit(self, job: _Job, active: dict[int, "_Active"]) -> None:
        from dflash_trt.runtime.batched import SequenceRequest

        g, req = job.generation, job.generation.request
        if g.is_cancelled() or self._closing.is_set():
            g.put(Chunk("", finished=True, finish_reason="cancelled", stats=ChunkStats()))
            g.end()
            return
        detok = IncrementalDetokenizer(self.tokenizer, req.stop, lock=self._tok_lock)
        on_step = self._streamer(g, detok)
        try:
            seq = self.batched.add(SequenceRequest(job.prompt_ids, job.max_tokens, req.temperature, req.top_p,
                                                   req.seed, tuple(self.stop_token_ids), on_step))
        except DFlashError as e:
            g.put(RequestError(str(e)))
            g.end()
            return
        active[id(seq)] = _Active(g, seq, detok)

    def _complete(self, a: "_Active") -> None:
        g, result = a.generation, a.seq.result
        tail = a.detok.flush()
        if a.detok.stopped:
            reason = "stop"
        elif g.is_cancelled() or self._closing.is_set() or not result.output_ids:
            reason = "cancelled"
        else:
            reason = result.stats.finish_reason
        queue_s = max(0.0, a.seq.t0 - g.submitted_at) if a.seq.t0 else time.perf_counter() - g.submitted_at
        g.put(Chunk(tail, finished=True, finish_reason=reason, stats=_stats_of(result.stats, queue_s)))
        g.end()

    def _streamer(self, g: Any, detok: "IncrementalDetokenizer"):
        """The runtime's per-step callback: stream the new text; True stops generation after this
        step (a stop string, a cancelled client, shutdown)."""

        def on_step(new_ids: list[int]) -> bool:
            delta = detok.add(new_ids)
            if delta:
                g.put(Chunk(delta))
            return detok.stopped or g.is_cancelled() or self._closing.is_set()

        return on_step

    def runtime_stats(self) -> dict[str, Any]:
        """The batched runtime's state (policy decisions, costs, acceptance), for logs and debugging."""
        return self.batched.stats() if self.batched is not None else {"policy": "serial"}

    def _generate(self, job: _Job) -> None:
        from dflash_trt.runtime.generate import dflash_generate

        g, req = job.generation, job.generation.request
        queue_s = time.perf_counter() - g.submitted_at
        detok = IncrementalDetokenizer(self.tokenizer, req.stop, lock=self._tok_lock)
        on_step = self._streamer(g, detok)
        result = dflash_generate(
            self.draft, self.target, job.prompt_ids, max_new_tokens=job.max_tokens, temperature=req.temperature,
            top_p=req.top_p, stop_token_ids=self.stop_token_ids, seed=req.seed, on_step=on_step,
        )
        tail = detok.flush()
        if detok.stopped:
            reason = "stop"
        elif g.is_cancelled() or self._closing.is_set():
            reason = "cancelled"
        else:
            reason = result.stats.finish_reason
        g.put(Chunk(tail, finished=True, finish_reason=reason, stats=_stats_of(result.stats, queue_s)))

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
                job.generation.put(Chunk("", finished=True, finish_reason="cancelled", stats=ChunkStats()))
                job.generation.end()


# ------------------------------------------------------------------------------------------------
# TensorRT-LLM (GPU clusters). Cannot run on the development machines: see environment.md.
# ------------------------------------------------------------------------------------------------
def tensorrt_llm_status() -> tuple[bool, str]:
    """(usable, why): TensorRT-LLM is used only when importable AND it has native DFlash."""
    try:
        import tensorrt_llm  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return False, f"tensorrt_llm is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    version = getattr(tensorrt_llm, "__version__", "?")
    try:
        from tensorrt_llm.llmapi import DFlashDecodingConfig  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001
        return False, f"tensorrt_llm {version} has no tensorrt_llm.llmapi.DFlashDecodingConfig (no native DFlash)"
    return True, f"tensorrt_llm {version} with DFlashDecodingConfig"


class TensorRTLLMRuntime:
    """TensorRT-LLM's LLM API, configured by the engine's llm_api_options.yaml (one-model DFlash)."""

    backend = "tensorrt_llm"

    def __init__(self, engine_dir: Path, manifest: Any, default_max_tokens: int) -> None:
        import asyncio

        import yaml
        from tensorrt_llm import LLM  # type: ignore[import-not-found]
        from tensorrt_llm.llmapi import DFlashDecodingConfig  # type: ignore[import-not-found]

        self.engine_dir = engine_dir
        self.max_seq_len = manifest.limits.max_seq_len
        self.default_max_tokens = default_max_tokens
        options = yaml.safe_load((engine_dir / manifest.llm_api_options).read_text()) or {}
        spec = dict(options.pop("speculative_config", {}) or {})
        spec.pop("decoding_type", None)
        model_path = spec.get("speculative_model")
        if model_path and not Path(model_path).is_absolute():  # paths in the YAML are engine-relative
            spec["speculative_model"] = str(engine_dir / model_path)
        options.pop("backend", None)
        self._llm = LLM(model=str(engine_dir / manifest.target.path),
                        speculative_config=DFlashDecodingConfig(**spec), **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trtllm-loop", daemon=True)
        self._thread.start()

    def submit(self, request: GenerateRequest) -> Generation:
        import asyncio

        max_tokens = self.default_max_tokens if request.max_tokens is None else request.max_tokens
        if not 1 <= max_tokens <= self.max_seq_len:
            raise RequestError(f"max_tokens={max_tokens} must be in 1..{self.max_seq_len} (this engine's max_seq_len)")
        g = Generation(request)
        asyncio.run_coroutine_threadsafe(self._run(g, max_tokens), self._loop)
        return g

    async def _run(self, g: Generation, max_tokens: int) -> None:
        from tensorrt_llm import SamplingParams  # type: ignore[import-not-found]

        req = g.request
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed, stop=list(req.stop) or None, return_perf_metrics=True)
        try:
            stream = self._llm.generate_async(req.prompt, params, streaming=True)
            out = None
            async for out in stream:
                if g.is_cancelled():
                    stream.abort()
                    break
                o = out.outputs[0]
                if o.text_diff and not out.finished:
                    g.put(Chunk(o.text_diff))
            stats = ChunkStats()
            reason = "cancelled" if g.cancelled.is_set() else "length"
            tail = ""
            if out is not None:
                o = out.outputs[0]
                tail = "" if g.cancelled.is_set() else o.text_diff
                reason = reason if g.cancelled.is_set() else (o.finish_reason or "length")
                stats.num_output_tokens = len(o.token_ids)
                spec = getattr(getattr(o, "request_perf_metrics", None), "speculative_decoding", None)
                if spec is not None:
                    stats.total_draft_tokens = int(spec.total_draft_tokens)
                    stats.total_accepted_draft_tokens = int(spec.total_accepted_draft_tokens)
                    stats.acceptance_rate = float(spec.acceptance_rate)
            g.put(Chunk(tail, finished=True, finish_reason=reason, stats=stats))
        except Exception as e:  # noqa: BLE001
            g.put(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
        g.end()

    def shutdown(self, cancel_pending: bool = True) -> None:
        self._llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
BACKENDS = ("auto", "tensorrt_llm", "reference")


def _load_pair(engine_dir: Path, dtype: str, device: str) -> Any:
    # The engine loader re-checks every file's sha256 and dequantizes FP8/NVFP4 targets.
    from dflash_trt.engine.loader import load_engine

    return load_engine(engine_dir, dtype=dtype, device=device)


def load_engine_runtime(engine_dir: str | Path, backend: str = "auto", dtype: str = "float32", device: str = "cpu",
                        default_max_tokens: int | None = None, max_queue: int = 64,
                        speculation: str = "adaptive", cuda_graphs: bool = False) -> EngineRuntime:
    """Load `engine_dir` with TensorRT-LLM when it can run DFlash here, else the reference runtime.

    The choice and its reason are logged: silently serving with the slow path is a failure mode.
    """
    from dflash_trt.engine.manifest import load_manifest

    if backend not in BACKENDS:
        raise DFlashError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    engine_dir = Path(engine_dir).resolve()
    manifest = load_manifest(engine_dir)
    limit = manifest.limits.max_seq_len
    default = default_max_tokens or min(256, max(1, limit // 2))
    usable, why = tensorrt_llm_status()
    if backend == "tensorrt_llm" and not usable:
        raise DFlashError(f"backend tensorrt_llm requested but {why}; use --backend reference or a TensorRT-LLM >= "
                          f"{manifest.min_tensorrt_llm_version} container")
    if usable and backend != "reference":
        log.info("engine %s: TensorRT-LLM LLM API (%s)", engine_dir, why)
        return TensorRTLLMRuntime(engine_dir, manifest, default)
    reason = "requested" if backend == "reference" else why
    log.info("engine %s: dflash_trt reference runtime (%s)", engine_dir, reason)

    from dflash_trt.generation_cli import stop_ids_of
    from dflash_trt.runtime.target import TargetAdapter

    pair = _load_pair(engine_dir, dtype, device)
    if pair.tokenizer is None:
        raise DFlashError(f"{engine_dir / manifest.target.path}: no tokenizer (tokenizer.json); the server needs one "
                          f"for text in/out: rebuild the engine from a checkpoint that has a tokenizer")
    return ReferenceRuntime(
        engine_dir=engine_dir, target=TargetAdapter(pair.target), draft=pair.draft, tokenizer=pair.tokenizer,
        stop_token_ids=stop_ids_of(pair.tokenizer, pair.target.config), max_seq_len=limit,
        default_max_tokens=min(default, limit), max_queue=max_queue, max_batch=manifest.limits.max_batch_size,
        speculation=speculation, cuda_graphs=cuda_graphs,
    )
