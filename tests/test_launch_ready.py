"""`dflash-trt deploy wait-ready`, the readiness wait of the serve job, against real servers:
a grpcio server implementing KServe v2 ServerReady (tritonclient's own protos) and an HTTP server
(trtllm-serve's /health)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from concurrent import futures

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.deploy.ready import probe, wait_ready
from dflash_trt.errors import DFlashError


@pytest.fixture
def kserve_server():
    """A gRPC server whose ServerReady answers `state['ready']`; yields (address, state)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    state = {"ready": False, "calls": 0}

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerReady(self, request, context):  # noqa: N802 - the protocol's name
            state["calls"] += 1
            return service_pb2.ServerReadyResponse(ready=state["ready"])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", state
    finally:
        server.stop(0)


@pytest.fixture
def http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_grpc_server_ready_is_honoured(kserve_server):
    address, state = kserve_server
    assert probe(address) is False and state["calls"] == 1  # up but not ready
    threading.Timer(0.5, lambda: state.update(ready=True)).start()
    waited = wait_ready([f"grpc://{address}"], timeout_s=10, interval_s=0.1)
    assert 0.3 < waited < 10 and probe(address) is True


def test_http_health(http_server):
    assert wait_ready([f"{http_server}/health"], timeout_s=5, interval_s=0.1) < 5
    with pytest.raises(DFlashError, match="not ready after 1s"):
        wait_ready([f"{http_server}/v2/health/ready"], timeout_s=1, interval_s=0.1)


def test_dead_server_process_fails_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(DFlashError, match=f"server process {proc.pid} exited"):
        wait_ready(["127.0.0.1:1"], timeout_s=60, pid=proc.pid, interval_s=0.1)
    assert time.monotonic() - t0 < 10  # not the whole timeout


def test_cli_timeout_is_one_line_and_non_zero():
    result = CliRunner().invoke(main, ["deploy", "wait-ready", "--timeout", "0.5", "--interval", "0.1", "127.0.0.1:1"])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: 127.0.0.1:1 not ready after") and "Traceback" not in result.output
