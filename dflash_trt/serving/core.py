"""What every frontend of `dflash-trt serve` shares: the loaded models, readiness, the bound on
concurrent streams, and the accounting of each request (ModelStatistics and Prometheus metrics).

The gRPC service (grpc_service.py), the KServe REST and generate endpoints (kserve_http.py) and
the OpenAI endpoints (openai_http.py) run on ONE asyncio event loop and hand requests to the same
models, so all of them share one runtime and its batches:

- Triton-protocol requests go through the repository's model.py (:meth:`InferenceCore.submit`):
  the host checks the inputs, the model answers through its response sender, each response comes
  back to the frontend as a :class:`~dflash_trt.serving.host.Delivery` on the loop;
- OpenAI requests go to the serving Backend the model exposes (``HostedModel.backend``).

Streams: an open gRPC stream, a unary inference call and an HTTP inference request each hold one
of ``max_streams`` slots for as long as they last; past that, RESOURCE_EXHAUSTED (HTTP 429).
Health, metadata and metrics hold none, so they answer however busy the server is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from dflash_trt.serving import pb_utils
from dflash_trt.serving.host import FAILURE_REASONS, Delivery, HostedModel, InferError, make_sender
from dflash_trt.serving.metrics import ServerMetrics

SERVER_NAME = "dflash-trt"
EXTENSIONS = ["classification", "model_repository", "schedule_policy", "model_configuration", "statistics",
              "generate"]


class StreamSlots:
    """A bound on concurrent streams (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._lock = threading.Lock()

    def acquire(self, what: str) -> Callable[[], None]:
        """Take a slot (InferError RESOURCE_EXHAUSTED when none is free); returns its release,
        which may be called any number of times."""
        with self._lock:
            if self.in_use >= self.capacity:
                raise InferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{what} refused: all {self.capacity} stream slots of this server are in use "
                                 f"(--max-streams); retry later or close idle streams")
            self.in_use += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.in_use -= 1

        return release


class RequestTimer:
    """One request's accounting: queue and compute time, first response, outcome, outputs."""

    def __init__(self, core: "InferenceCore", model: HostedModel) -> None:
        self.core, self.model = core, model
        self.t0 = time.perf_counter()
        self.t_exec: float | None = None
        self.t_first: float | None = None
        self._done = False

    def executing(self) -> None:
        self.t_exec = time.perf_counter()
        self.core.metrics.request_started(self.model.name, self.model.version)

    def first(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def finish(self, ok: bool, code: grpc.StatusCode | None, values: dict[str, Any]) -> None:
        if self._done:
            return
        self._done = True
        now = time.perf_counter()
        t_exec = self.t_exec if self.t_exec is not None else self.t0
        total_ns, queue_ns = int((now - self.t0) * 1e9), int((t_exec - self.t0) * 1e9)
        st = self.model.stats
        with st.lock:
            if ok:
                st.success_count += 1
                st.success_ns += total_ns
                st.queue_ns += queue_ns
                st.compute_ns += total_ns - queue_ns
                st.inference_count += 1
                st.execution_count += 1
                st.last_inference_ms = int(time.time() * 1e3)
            else:
                st.fail_count += 1
                st.fail_ns += total_ns
        self.core.metrics.request_finished(
            self.model.name, self.model.version, ok, FAILURE_REASONS.get(code, "BACKEND") if code else "OTHER",
            total_s=now - self.t0, queue_s=t_exec - self.t0,
            first_response_s=None if self.t_first is None else self.t_first - self.t0,
            outputs=values, was_pending=self.t_exec is not None,
        )


class LoopDeliveries:
    """Responses the model sends from its own threads, handed to a coroutine on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()

    def __call__(self, delivery: Delivery) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, delivery)
        except RuntimeError:  # the loop is closed: the server stopped, nobody reads any more
            pass


async def collect_responses(deliveries: LoopDeliveries) -> list[Any]:
    """Every response of a request up to its final one (a unary gRPC or HTTP request); the first
    error the model delivered is raised."""
    out = []
    while True:
        d = await deliveries.queue.get()
        if d.error is not None:
            raise d.error
        if d.response is not None:
            out.append(d.response)
        if d.final:
            return out


class InferenceCore:
    """The models and the request accounting every frontend shares (see the module docstring)."""

    def __init__(self, models: dict[str, HostedModel], metrics: ServerMetrics, max_streams: int = 64) -> None:
        self.models = models
        self.metrics = metrics
        self.slots = StreamSlots(max_streams)
        self.ready = False
        # model.execute() runs here, off the loop: a model may do real work in it
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="model-execute")
        self._senders: set[pb_utils.ResponseSender] = set()
        self._senders_lock = threading.Lock()

    def model(self, name: str, version: str = "") -> HostedModel:
        model = self.models.get(name)
        if model is None or version not in ("", model.version):
            raise InferError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{name}'"
                             + (f" version {version}" if version else "") + f" is not found; available: "
                             f"{sorted(self.models)}")
        return model

    def model_ready(self, name: str, version: str = "") -> bool:
        model = self.models.get(name)
        return model is not None and self.ready and version in ("", model.version)

    def check_ready(self) -> None:
        if not self.ready:
            raise InferError(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")

    def timer(self, model: HostedModel) -> RequestTimer:
        return RequestTimer(self, model)

    async def submit(self, model: HostedModel, timer: RequestTimer, inputs: list[pb_utils.Tensor], request_id: str,
                     parameters: dict[str, Any], requested: list[str],
                     deliver: Callable[[Delivery], None]) -> pb_utils.ResponseSender:
        """Hand a checked request to `model`; its responses go to `deliver` (from any thread)."""
        self.check_ready()

        def on_final(ok: bool, code: grpc.StatusCode | None, values: dict[str, Any]) -> None:
            with self._senders_lock:
                self._senders.discard(sender)
            timer.finish(ok, code, values)

        sender = make_sender(deliver, on_final, timer.first)
        with self._senders_lock:
            self._senders.add(sender)
        timer.executing()
        request = pb_utils.InferenceRequest(inputs, request_id, sender, parameters, requested, model.name)
        await asyncio.get_running_loop().run_in_executor(self.executor, model.execute, request)
        return sender

    def cancel_all(self) -> None:
        """Cancel every request in flight (a second stop signal: stop now)."""
        with self._senders_lock:
            senders = list(self._senders)
        for s in senders:
            s.cancel()

    def finalize(self) -> None:
        import logging

        for m in self.models.values():
            try:
                m.finalize()
            except Exception:  # noqa: BLE001 - shutting down: log and go on with the others
                logging.getLogger("dflash_trt.serving").exception("finalize of %s failed", m.name)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """ModelStatistics of one model or all, as dicts in the KServe/Triton field names."""
        out = []
        for n in ([name] if name else sorted(self.models)):
            m = self.model(n, version)
            st = m.stats
            with st.lock:
                out.append({
                    "name": m.name, "version": m.version, "last_inference": st.last_inference_ms,
                    "inference_count": st.inference_count, "execution_count": st.execution_count,
                    "inference_stats": {
                        "success": {"count": st.success_count, "ns": st.success_ns},
                        "fail": {"count": st.fail_count, "ns": st.fail_ns},
                        "queue": {"count": st.success_count, "ns": st.queue_ns},
                        "compute_infer": {"count": st.success_count, "ns": st.compute_ns},
                    },
                })
        return out
