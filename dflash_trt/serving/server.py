"""A Triton-protocol (KServe v2 `inference.GRPCInferenceService`) gRPC server for a model repository.

For machines without a Triton binary (laptops, CI, the embedded default): it hosts the SAME
repository `dflash-trt deploy triton` writes, running its model.py through the Python-backend
interface, so the real `tritonclient` talks to it exactly as to `tritonserver`. One deliberate
extension: ModelInfer (unary) is accepted for a decoupled model when the model answers with one
response (stream=false); tritonserver refuses unary calls to decoupled models, so portable
clients use the streaming API (as `dflash-trt client` does).

Entry points: `TritonGrpcServer` (start/stop, for tests and embedding) and `run_server(...)`
(blocks until SIGTERM/SIGINT; used by `dflash-trt serve` and by Slurm launchers per rank).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dflash_trt import __version__
from dflash_trt.errors import DFlashError
from dflash_trt.serving.host import FAILURE_REASONS, Delivery, HostedModel, InferError, make_sender, wire_datatype
from dflash_trt.serving.host import model_config_type_name as _type_name
from dflash_trt.serving.metrics import ServerMetrics
from dflash_trt.serving import pb_utils

log = logging.getLogger("dflash_trt.serving")

SERVER_NAME = "dflash-trt"
EXTENSIONS = ["classification", "model_repository", "schedule_policy", "model_configuration", "statistics"]
_STOP = object()


def _error_text(request_id: str, message: str) -> str:
    return f"[request id: {request_id}] {message}" if request_id else message


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, server: TritonGrpcServer) -> None:
        self.s = server

    # -- health and metadata --------------------------------------------------------------------
    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.s.ready)

    def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    def ModelReady(self, request, context):
        model = self.s.models.get(request.name)
        ok = model is not None and self.s.ready and request.version in ("", model.version)
        return service_pb2.ModelReadyResponse(ready=ok)

    def _model(self, name: str, version: str, context) -> HostedModel:
        model = self.s.models.get(name)
        if model is None or version not in ("", model.version):
            what = f"'{name}'" + (f" version {version}" if version else "")
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"Request for unknown model: {what} is not found; available: {sorted(self.s.models)}")
        return model

    def ModelMetadata(self, request, context):
        m = self._model(request.name, request.version, context)
        TM = service_pb2.ModelMetadataResponse.TensorMetadata

        def meta(tensors):
            return [TM(name=t.name, datatype=wire_datatype(_type_name(t.data_type)), shape=list(t.dims)) for t in tensors]

        return service_pb2.ModelMetadataResponse(name=m.name, versions=[m.version], platform=m.config.backend,
                                                 inputs=meta(m.config.input), outputs=meta(m.config.output))

    def ModelConfig(self, request, context):
        m = self._model(request.name, request.version, context)
        return service_pb2.ModelConfigResponse(config=m.config)

    def ModelStatistics(self, request, context):
        names = [request.name] if request.name else sorted(self.s.models)
        out = service_pb2.ModelStatisticsResponse()
        for name in names:
            m = self._model(name, request.version, context)
            st = m.stats
            with st.lock:
                D = service_pb2.StatisticDuration
                out.model_stats.add(
                    name=m.name, version=m.version, last_inference=st.last_inference_ms,
                    inference_count=st.inference_count, execution_count=st.execution_count,
                    inference_stats=service_pb2.InferStatistics(
                        success=D(count=st.success_count, ns=st.success_ns), fail=D(count=st.fail_count, ns=st.fail_ns),
                        queue=D(count=st.success_count, ns=st.queue_ns),
                        compute_infer=D(count=st.success_count, ns=st.compute_ns),
                    ),
                )
        return out

    def RepositoryIndex(self, request, context):
        out = service_pb2.RepositoryIndexResponse()
        for name, m in sorted(self.s.models.items()):
            out.models.add(name=name, version=m.version, state="READY" if self.s.ready else "UNAVAILABLE")
        return out

    # -- inference --------------------------------------------------------------------------------
    def ModelInfer(self, request, context):
        responses: queue.Queue[Delivery] = queue.Queue()
        try:
            sender = self.s.dispatch(request, responses.put)
        except InferError as e:
            context.abort(e.code, _error_text(request.id, str(e)))
        context.add_callback(sender.cancel)  # client gone or deadline: stop generating for it
        data = []
        while True:
            try:
                d = responses.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():  # client gone: the callback cancelled the request
                    return service_pb2.ModelInferResponse()
                continue
            if d.error is not None:
                context.abort(d.error.code, _error_text(request.id, str(d.error)))
            if d.response is not None:
                data.append(d.response)
                if len(data) > 1:
                    sender.cancel()
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, _error_text(
                        request.id, f"model '{request.model_name}' sent more than one response (stream=true?); "
                                    f"use the streaming API (ModelStreamInfer) for decoupled responses"))
            if d.final:
                break
        if not data:
            context.abort(grpc.StatusCode.INTERNAL, _error_text(request.id, "the model sent no response"))
        return data[0]

    def ModelStreamInfer(self, request_iterator, context):
        out: queue.Queue[Any] = queue.Queue()
        lock = threading.Lock()
        state = {"inflight": 0, "reader_done": False}
        senders: list[pb_utils.ResponseSender] = []

        def on_delivery(request: Any, enable_empty_final: bool):
            def deliver(d: Delivery) -> None:
                if d.error is not None:
                    out.put(service_pb2.ModelStreamInferResponse(
                        error_message=_error_text(request.id, str(d.error)),
                        infer_response=service_pb2.ModelInferResponse(
                            model_name=request.model_name, id=request.id)))
                elif d.response is not None:
                    if enable_empty_final:
                        d.response.parameters["triton_final_response"].bool_param = d.final
                    out.put(service_pb2.ModelStreamInferResponse(infer_response=d.response))
                elif enable_empty_final:  # FINAL flag with no data: Triton's empty final response
                    r = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
                    r.parameters["triton_final_response"].bool_param = True
                    out.put(service_pb2.ModelStreamInferResponse(infer_response=r))
                if d.final:
                    with lock:
                        state["inflight"] -= 1
                    out.put(None)  # wake the writer to re-check "all done"
            return deliver

        def reader() -> None:
            try:
                for request in request_iterator:
                    enable = request.parameters["triton_enable_empty_final_response"].bool_param \
                        if "triton_enable_empty_final_response" in request.parameters else False
                    with lock:
                        state["inflight"] += 1
                    try:
                        senders.append(self.s.dispatch(request, on_delivery(request, enable)))
                    except InferError as e:
                        with lock:
                            state["inflight"] -= 1
                        out.put(service_pb2.ModelStreamInferResponse(
                            error_message=_error_text(request.id, str(e)),
                            infer_response=service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)))
            except grpc.RpcError:
                pass  # the client went away; the termination callback cancels what is in flight
            finally:
                with lock:
                    state["reader_done"] = True
                out.put(None)

        def on_terminated() -> None:
            for s in list(senders):
                s.cancel()
            out.put(_STOP)

        context.add_callback(on_terminated)
        threading.Thread(target=reader, name="stream-reader", daemon=True).start()
        while True:
            item = out.get()
            if item is _STOP:
                return
            if item is not None:
                yield item
            with lock:
                if state["reader_done"] and state["inflight"] == 0 and out.empty():
                    return


class TritonGrpcServer:
    """Loads every model of a repository and serves it over gRPC (+ Prometheus metrics)."""

    def __init__(self, model_repository: str | Path, host: str = "127.0.0.1", grpc_port: int = 8001,
                 metrics_port: int | None = 8002, models: list[str] | None = None, max_workers: int = 64) -> None:
        self.repository = Path(model_repository)
        self.host = host
        self.requested_grpc_port = grpc_port
        self.requested_metrics_port = metrics_port
        self.only = models
        self.max_workers = max_workers
        self.models: dict[str, HostedModel] = {}
        self.metrics = ServerMetrics()
        self.ready = False
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._metrics_http = None
        self._stopped = threading.Event()
        self._done = threading.Event()

    # -- lifecycle ----------------------------------------------------------------------------------
    def load_models(self) -> None:
        if not self.repository.is_dir():
            raise DFlashError(f"model repository {self.repository} does not exist; create one with "
                              f"`dflash-trt deploy triton ENGINE --out {self.repository}`")
        dirs = sorted(p for p in self.repository.iterdir() if (p / "config.pbtxt").is_file())
        if self.only:
            unknown = sorted(set(self.only) - {p.name for p in dirs})
            if unknown:
                raise DFlashError(f"--model {unknown} not in {self.repository} (it has {[p.name for p in dirs]})")
            dirs = [p for p in dirs if p.name in self.only]
        if not dirs:
            raise DFlashError(f"{self.repository} holds no model (no <model>/config.pbtxt); generate it with "
                              f"`dflash-trt deploy triton`")
        for d in dirs:
            versions = sorted((v.name for v in d.iterdir() if v.is_dir() and v.name.isdigit()), key=int)
            if not versions:
                raise DFlashError(f"{d}: no version folder (e.g. {d}/1/model.py)")
            log.info("loading model %s version %s", d.name, versions[-1])
            self.models[d.name] = HostedModel(d, versions[-1])

    def start(self) -> TritonGrpcServer:
        if not self.models:
            self.load_models()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="grpc"),
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self), server)
        try:
            port = server.add_insecure_port(f"{self.host}:{self.requested_grpc_port}")
        except RuntimeError as e:
            port, _ = 0, e
        if port == 0:
            self._finalize_models()
            raise DFlashError(f"cannot bind gRPC on {self.host}:{self.requested_grpc_port} (in use?); pass another "
                              f"--grpc-port")
        self.grpc_port = port
        if self.requested_metrics_port is not None:
            try:
                self._metrics_http, _ = self.metrics.serve(self.requested_metrics_port, self.host)
            except OSError as e:
                self._finalize_models()
                raise DFlashError(f"cannot bind metrics on {self.host}:{self.requested_metrics_port} ({e.strerror}); "
                                  f"pass another --metrics-port")
            self.metrics_port = self._metrics_http.server_port
        server.start()
        self._server = server
        self.ready = True
        log.info("serving %s on %s:%d (gRPC), metrics on %s", sorted(self.models), self.host, port,
                 f"{self.host}:{self.metrics_port}" if self.metrics_port else "off")
        return self

    def stop(self, grace: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for `grace` seconds, cancel the rest.

        Idempotent; a second call with a smaller grace (a second Ctrl-C) cuts the wait short.
        Returns once everything is down."""
        if self._stopped.is_set():
            if self._server is not None:
                self._server.stop(grace)  # grpc: a shorter grace in a later call stops sooner
            self._done.wait()
            return
        self._stopped.set()
        self.ready = False
        try:
            if self._server is not None:
                self._server.stop(grace).wait()
            self._finalize_models()
            if self._metrics_http is not None:
                self._metrics_http.shutdown()
                self._metrics_http.server_close()
        finally:
            self._done.set()

    def _finalize_models(self) -> None:
        for m in self.models.values():
            try:
                m.finalize()
            except Exception:  # noqa: BLE001 - shutting down: log and go on with the others
                log.exception("finalize of %s failed", m.name)

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> TritonGrpcServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(grace=2.0)

    # -- one request (unary or on a stream) ---------------------------------------------------------
    def dispatch(self, request: Any, deliver) -> pb_utils.ResponseSender:
        """Validate `request` and hand it to its model; responses go to `deliver(Delivery)`."""
        model = self.models.get(request.model_name)
        if model is None or request.model_version not in ("", model.version):
            raise InferError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.model_name}'"
                             + (f" version {request.model_version}" if request.model_version else "")
                             + f" is not found; available: {sorted(self.models)}")
        if not self.ready:
            raise InferError(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")
        t0 = time.perf_counter()
        try:
            inputs = model.decode_inputs(request)
        except InferError:
            self._record(model, t0, t0, None, False, grpc.StatusCode.INVALID_ARGUMENT, {}, pending=False)
            raise
        requested = [o.name for o in request.outputs]
        timing: dict[str, float] = {}

        def on_first() -> None:
            timing["first"] = time.perf_counter()

        def on_final(ok: bool, code: grpc.StatusCode | None, values: dict[str, Any]) -> None:
            self._record(model, t0, timing.get("exec", t0), timing.get("first"), ok, code, values)

        sender = make_sender(model, request.id, requested, deliver, on_final, on_first)
        params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.parameters.items()
                  if v.WhichOneof("parameter_choice")}
        self.metrics.request_started(model.name, model.version)
        timing["exec"] = time.perf_counter()
        model.execute(pb_utils.InferenceRequest(inputs, request.id, sender, params, requested, model.name))
        return sender

    def _record(self, model: HostedModel, t0: float, t_exec: float, t_first: float | None, ok: bool,
                code: grpc.StatusCode | None, values: dict[str, Any], pending: bool = True) -> None:
        now = time.perf_counter()
        total_ns, queue_ns = int((now - t0) * 1e9), int((t_exec - t0) * 1e9)
        st = model.stats
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
        self.metrics.request_finished(
            model.name, model.version, ok, FAILURE_REASONS.get(code, "BACKEND") if code else "OTHER",
            total_s=now - t0, queue_s=t_exec - t0, first_response_s=None if t_first is None else t_first - t0,
            outputs=values, was_pending=pending,
        )


def run_server(model_repository: str | Path, grpc_port: int = 8001, metrics_port: int | None = 8002,
               host: str = "127.0.0.1", models: list[str] | None = None, grace_s: float = 30.0,
               ready_file: str | Path | None = None, install_signal_handlers: bool = True) -> None:
    """Serve `model_repository` until SIGTERM/SIGINT, then shut down gracefully.

    Per-rank launchers pass rank-specific ports (e.g. grpc_port=8001 + 10 * local_rank). When
    `ready_file` is given, "host:grpc_port metrics_port" is written to it (atomically) once the
    server accepts requests, so a launcher can wait for it and learn ephemeral ports (port 0).
    """
    server = TritonGrpcServer(model_repository, host=host, grpc_port=grpc_port, metrics_port=metrics_port,
                              models=models)
    server.start()
    # signal.signal only works in the main thread; an embedding caller handles signals itself.
    if install_signal_handlers and threading.current_thread() is threading.main_thread():
        def handle(signum, frame):  # noqa: ARG001
            if server._stopped.is_set():
                log.info("signal %s again: cancelling in-flight requests now", signum)
                threading.Thread(target=server.stop, args=(0,), daemon=True).start()
                return
            log.info("signal %s: finishing in-flight requests (up to %.0fs), then stopping", signum, grace_s)
            threading.Thread(target=server.stop, args=(grace_s,), daemon=True).start()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
    if ready_file is not None:
        from dflash_trt.fsutil import write_text_atomic

        write_text_atomic(ready_file, f"{host}:{server.grpc_port} {server.metrics_port or 0}\n")
    try:
        while not server._stopped.wait(0.5):  # wake up regularly so signals are handled
            pass
    finally:
        server.stop(grace_s)  # returns when the stop started by the signal has completed
