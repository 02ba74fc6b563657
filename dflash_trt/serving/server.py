"""`dflash-trt serve`: a Triton-protocol server for a model repository, with Triton's HTTP
endpoints and an OpenAI-compatible API, for machines without a Triton binary (laptops, CI, the
embedded default) and as a drop-in beside tritonserver.

It hosts the SAME repository `dflash-trt deploy triton` writes, running its model.py through the
Python-backend interface (serving/host.py), so the real `tritonclient` (gRPC and HTTP) talks to
it exactly as to `tritonserver`, and OpenAI clients reach the same engine:

- gRPC (``--grpc-port``, 8001): KServe v2 ``inference.GRPCInferenceService`` (grpc_service.py);
- HTTP (``--http-port``, 8000): KServe v2 REST and the generate extension (kserve_http.py) and
  ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (openai_http.py), on Starlette
  and uvicorn;
- metrics (``--metrics-port``, 8002): Prometheus, Triton's metric names (metrics.py).

gRPC and HTTP run on ONE asyncio event loop (a thread of their own) and share the models,
their runtime and its batches (core.py). Limits: ``max_streams`` concurrent streams and
inference requests (RESOURCE_EXHAUSTED / HTTP 429 past it; health and metadata always answer),
``stream_idle_timeout_s`` for a gRPC stream with nothing in flight.

Entry points: :class:`TritonServer` (start/stop, for tests and embedding) and
:func:`run_server` (blocks until SIGTERM/SIGINT; used by `dflash-trt serve` and by Slurm
launchers per rank).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.serving.core import InferenceCore
from dflash_trt.serving.host import HostedModel
from dflash_trt.serving.limits import DEFAULT_MAX_STREAMS, DEFAULT_STREAM_IDLE_TIMEOUT_S
from dflash_trt.serving.metrics import ServerMetrics

log = logging.getLogger("dflash_trt.serving")


def _bind(host: str, port: int, flag: str) -> socket.socket:
    """A listening TCP socket (so a taken port is one line naming the flag, and port 0 works)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DFlashError(f"cannot bind {flag.removeprefix('--').split('-')[0].upper()} on {host}:{port} "
                          f"({e.strerror}); pass another {flag}")
    sock.setblocking(False)
    return sock


class TritonServer:
    """Loads every model of a repository and serves it over gRPC, HTTP and metrics."""

    def __init__(self, model_repository: str | Path, host: str = "127.0.0.1", grpc_port: int = 8001,
                 metrics_port: int | None = 8002, models: list[str] | None = None, http_port: int | None = None,
                 max_streams: int = DEFAULT_MAX_STREAMS,
                 stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S) -> None:
        self.repository = Path(model_repository)
        self.host = host
        self.requested_grpc_port = grpc_port
        self.requested_http_port = http_port
        self.requested_metrics_port = metrics_port
        self.only = models
        self.max_streams = max_streams
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.models: dict[str, HostedModel] = {}
        self.metrics = ServerMetrics()
        self.core: InferenceCore | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._grpc: Any = None
        self._servicer: Any = None
        self._http: Any = None
        self._http_task: asyncio.Task | None = None
        self._metrics_http = None
        self._stopped = threading.Event()
        self._done = threading.Event()

    @property
    def ready(self) -> bool:
        return self.core is not None and self.core.ready

    # -- lifecycle ----------------------------------------------------------------------------------
    def load_models(self) -> None:
        if not self.repository.is_dir():
            raise DFlashError(f"model repository {self.repository} does not exist; create one with "
                              f"`dflash-trt deploy triton ENGINE --out {self.repository}`")
        dirs = sorted(p for p in self.repository.iterdir() if (p / "config.pbtxt").is_file())
        if self.only:
            unknown = sorted(set(self.only) - {p.name for p in dirs})
            if unknown:
                raise DFlashError(f"--load-model {unknown} not in {self.repository} (it has {[p.name for p in dirs]})")
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

    def start(self) -> "TritonServer":
        if not self.models:
            self.load_models()
        self.core = InferenceCore(self.models, self.metrics, self.max_streams)
        http_sock = None
        try:
            if self.requested_http_port is not None:
                http_sock = _bind(self.host, self.requested_http_port, "--http-port")
                self.http_port = http_sock.getsockname()[1]
            if self.requested_metrics_port is not None:
                try:
                    self._metrics_http, _ = self.metrics.serve(self.requested_metrics_port, self.host)
                except OSError as e:
                    raise DFlashError(f"cannot bind metrics on {self.host}:{self.requested_metrics_port} "
                                      f"({e.strerror}); pass another --metrics-port")
                self.metrics_port = self._metrics_http.server_port
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="serving-loop", daemon=True)
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._start_async(http_sock), self._loop).result(60)
        except BaseException:
            self._teardown()
            raise
        self.core.ready = True
        log.info("serving %s: gRPC %s:%d, HTTP %s, metrics %s", sorted(self.models), self.host, self.grpc_port,
                 f"{self.host}:{self.http_port}" if self.http_port else "off",
                 f"{self.host}:{self.metrics_port}" if self.metrics_port else "off")
        return self

    async def _start_async(self, http_sock: socket.socket | None) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        from dflash_trt.serving.grpc_service import InferenceServicer

        assert self.core is not None
        self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                              ("grpc.max_send_message_length", 64 << 20),
                                              ("grpc.so_reuseport", 0)])
        self._servicer = InferenceServicer(self.core, self.stream_idle_timeout_s)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self._servicer, self._grpc)
        try:
            port = self._grpc.add_insecure_port(f"{self.host}:{self.requested_grpc_port}")
        except RuntimeError:
            port = 0
        if port == 0:
            raise DFlashError(f"cannot bind GRPC on {self.host}:{self.requested_grpc_port} (in use?); pass another "
                              f"--grpc-port")
        self.grpc_port = port
        await self._grpc.start()
        if http_sock is not None:
            import uvicorn

            config = uvicorn.Config(self.http_app(), log_config=None, access_log=False, lifespan="off",
                                    timeout_keep_alive=5, log_level="warning")
            self._http = uvicorn.Server(config)
            self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[http_sock]))
            while not self._http.started:
                if self._http_task.done():  # failed to start: surface its error
                    self._http_task.result()
                    raise DFlashError(f"the HTTP server on {self.host}:{self.http_port} did not start")
                await asyncio.sleep(0.01)

    def http_app(self) -> Any:
        """The Starlette application: KServe v2 REST, the generate extension, the OpenAI API."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse

        from dflash_trt.serving.kserve_http import KServeHTTP
        from dflash_trt.serving.openai_http import OpenAIHTTP

        assert self.core is not None

        async def not_found(request, exc):
            return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"},
                                status_code=exc.status_code)

        return Starlette(routes=KServeHTTP(self.core).routes() + OpenAIHTTP(self.core).routes(),
                         exception_handlers={404: not_found, 405: not_found})

    def stop(self, grace: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for `grace` seconds, cancel the rest.

        Idempotent; a second call (a second Ctrl-C) cancels what is still in flight at once.
        Returns once everything is down."""
        if self._stopped.is_set():
            if self.core is not None:
                self.core.cancel_all()
            self._done.wait()
            return
        self._stopped.set()
        if self.core is not None:
            self.core.ready = False
        try:
            if self._loop is not None and self._loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(self._stop_async(grace), self._loop)
                try:
                    fut.result(grace + 30)
                except Exception:  # noqa: BLE001 - shutting down: log and finish the teardown
                    log.exception("stopping the servers failed")
        finally:
            self._teardown()
            self._done.set()

    async def _stop_async(self, grace: float) -> None:
        if self._servicer is not None:
            self._servicer.wake_streams()
        waits = []
        if self._grpc is not None:
            waits.append(self._grpc.stop(grace))
        if self._http is not None and self._http_task is not None:
            self._http.config.timeout_graceful_shutdown = grace
            self._http.should_exit = True
            waits.append(self._http_task)
        await asyncio.gather(*waits, return_exceptions=True)

    def _teardown(self) -> None:
        if self.core is not None:
            self.core.ready = False
            self.core.finalize()
        elif self.models:
            InferenceCore(self.models, self.metrics).finalize()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = None

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(grace=2.0)


TritonGrpcServer = TritonServer  # the name of this class before it also served HTTP


def run_server(model_repository: str | Path, grpc_port: int = 8001, metrics_port: int | None = 8002,
               host: str = "127.0.0.1", models: list[str] | None = None, grace_s: float = 30.0,
               ready_file: str | Path | None = None, install_signal_handlers: bool = True,
               http_port: int | None = None, max_streams: int = DEFAULT_MAX_STREAMS,
               stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S) -> None:
    """Serve `model_repository` until SIGTERM/SIGINT, then shut down gracefully.

    Per-rank launchers pass rank-specific ports (e.g. grpc_port=8001 + 10 * local_rank). When
    `ready_file` is given, "host:grpc_port metrics_port http_port" (0 for a port not served) is
    written to it (atomically) once the server accepts requests, so a launcher can wait for it and
    learn ephemeral ports (port 0).
    """
    from dflash_trt.runtime.kernel_caches import bound_kernel_caches

    # before the models load (oneDNN reads the capacities once): on the oneDNN path (no panel GEMM) a
    # long-running server meets new GEMM shapes with every new prompt length, and caches of 1024
    # shapes each (~600 MiB) grew its RSS; harmless where the panel GEMM runs the linears
    log.info("oneDNN kernel caches bounded: %s", bound_kernel_caches())
    server = TritonServer(model_repository, host=host, grpc_port=grpc_port, metrics_port=metrics_port,
                          models=models, http_port=http_port, max_streams=max_streams,
                          stream_idle_timeout_s=stream_idle_timeout_s)
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

        write_text_atomic(ready_file, f"{host}:{server.grpc_port} {server.metrics_port or 0} {server.http_port or 0}\n")
    try:
        while not server._stopped.wait(0.5):  # wake up regularly so signals are handled
            pass
    finally:
        server.stop(grace_s)  # returns when the stop started by the signal has completed
