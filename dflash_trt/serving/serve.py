"""`dflash-trt serve`: the real Triton Inference Server over a model repository, and the
OpenAI-compatible front beside it.

    tritonserver (child, its own session)      gRPC --grpc-port (8001), HTTP --http-port (8000),
      Python backend stub -> model.py            metrics --metrics-port (8002): Triton's own
    OpenAI front (this process, uvicorn)       --openai-port (9000): a tritonclient gRPC client

Everything Triton speaks (KServe v2 gRPC and REST, the generate extension, health, metadata,
statistics, cancellation, metrics) comes from tritonserver itself; this module starts it
(serving/tritonserver.py), starts the front (serving/openai_front.py), writes the ready file, and
stops both:

- SIGTERM / SIGINT: the front stops taking requests; tritonserver gets SIGTERM and lets in-flight
  requests finish for ``--exit-timeout-secs``; then everything still alive in its process group
  (the stubs) is killed. A second signal stops at once.
- tritonserver exiting on its own: after a signal of its own (Slurm's scancel signals every
  process of a step) it exits 0, and `serve` stops cleanly too; a crash stops the front and `serve`
  exits non-zero with the reason in one line.
- `serve` killed with SIGKILL: tritonserver dies with it (PR_SET_PDEATHSIG) and its stubs follow
  their parent, so no server is left holding the ports.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.serving.limits import DEFAULT_MAX_STREAMS
from dflash_trt.serving.tritonserver import ServerPorts, TritonServerProcess, check_port_free, free_port

log = logging.getLogger("dflash_trt.serving")


def ready_line(server: TritonServerProcess, openai_port: int | None) -> str:
    """What --ready-file holds: ``host:grpc_port metrics_port http_port openai_port`` (0: not served)."""
    p = server.ports
    return f"{p.address}:{p.grpc} {p.metrics or 0} {p.http or 0} {openai_port or 0}\n"


class OpenAIThread:
    """The OpenAI front on its own event loop and thread, bound to `port` before it starts."""

    def __init__(self, front: Any, address: str, port: int) -> None:  # front: openai_front.OpenAIFront
        import uvicorn

        self.front = front
        self.sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, port))
        except OSError as e:
            self.sock.close()
            raise DFlashError(f"port {port} on {address} (--openai-port) is taken ({e.strerror}); pass another "
                              f"--openai-port") from None
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(front.app(), log_config=None, access_log=False, timeout_keep_alive=5,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # `serve` owns the signals
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="openai-front",
                                       daemon=True)

    def start(self, timeout_s: float = 30.0) -> "OpenAIThread":
        self.thread.start()
        waited = 0.0
        while not self.server.started:
            if not self.thread.is_alive():
                raise DFlashError(f"the OpenAI front on port {self.port} did not start; see the log above")
            self.thread.join(0.05)
            waited += 0.05
            if waited > timeout_s:
                raise DFlashError(f"the OpenAI front on port {self.port} did not start within {timeout_s:.0f} s")
        return self

    def begin_stop(self, grace_s: float) -> None:
        """Take no new connections; requests in flight get `grace_s` to finish (not waited for here)."""
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True

    def stop(self, grace_s: float = 5.0) -> None:
        self.begin_stop(grace_s)
        self.thread.join(grace_s + 5.0)
        self.sock.close()


def run_serve(repository: str | Path, ports: ServerPorts, openai_port: int | None = 9000,
              models: list[str] | None = None, exit_timeout_s: float = 30.0, ready_file: str | Path | None = None,
              max_streams: int = DEFAULT_MAX_STREAMS, ready_timeout_s: float = 900.0,
              install_signal_handlers: bool = True) -> int:
    """Serve until a signal (or tritonserver exits); the exit code (0 after a requested stop)."""
    from dflash_trt.fsutil import write_text_atomic

    if openai_port is not None and openai_port != 0:
        check_port_free(ports.address, openai_port, "--openai-port")
    elif openai_port == 0:
        openai_port = free_port(ports.address)
    server = TritonServerProcess(Path(repository), ports, models=models, exit_timeout_s=exit_timeout_s)
    stop_requested, started = threading.Event(), threading.Event()
    front: OpenAIThread | None = None

    def on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001
        if stop_requested.is_set():
            log.info("signal %s again: stopping now", signal.Signals(signum).name)
            server.kill()
            return
        stop_requested.set()
        if not started.is_set():  # still starting: unwind now (start() kills what it started)
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    if install_signal_handlers and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            server.start(ready_timeout_s)
            started.set()
        except KeyboardInterrupt:
            log.info("stopped while tritonserver was starting")
            return 0
        except DFlashError:
            if stop_requested.is_set():  # it exited because the same signal reached it first
                log.info("stopped while tritonserver was starting")
                return 0
            raise
        if openai_port is not None:
            from dflash_trt.serving.openai_front import OpenAIFront  # Starlette: only where the front runs

            front = OpenAIThread(OpenAIFront(server.grpc_url, max_streams=max_streams), ports.address,
                                 openai_port).start()
        log.info("serving %s: gRPC %s, HTTP %s, metrics %s, OpenAI %s", repository, server.grpc_url,
                 server.http_url or "off", server.metrics_url or "off",
                 f"http://{ports.address}:{front.port}/v1" if front else "off")
        if ready_file is not None:
            write_text_atomic(ready_file, ready_line(server, front.port if front else None))
        while not stop_requested.wait(0.5):
            if not server.running:
                code = server.process.returncode  # type: ignore[union-attr]
                if code == 0:  # it was told to stop (Slurm signals every process of a step): so do we
                    log.info("tritonserver stopped (it was signalled); stopping")
                    break
                raise DFlashError(f"tritonserver exited on its own (code {code}): {_last_error(server)}")
        log.info("stopping: in-flight requests get up to %.0f s", exit_timeout_s)
        return 0
    finally:
        # both at once: the front's requests in flight are Triton requests in flight, which Triton
        # lets finish for the same exit timeout while it refuses new ones
        if front is not None:
            front.begin_stop(exit_timeout_s)
        server.stop()
        if front is not None:
            front.stop(0.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _last_error(server: TritonServerProcess) -> str:
    from dflash_trt.serving.tritonserver import explain_exit

    return explain_exit(list(server.tail), server.process.returncode if server.process else None)
