"""`dflash-trt deploy wait-ready`, the readiness wait of the serve job, against the real
tritonserver: its gRPC ServerReady (through tritonclient) while it loads a model and after, and
its HTTP /v2/health/ready."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.deploy.ready import probe, wait_ready
from dflash_trt.errors import DFlashError


@pytest.fixture(scope="module")
def starting_server(tmp_path_factory):
    """tritonserver started over the tiny engine's repository WITHOUT waiting for it: yields
    (process, grpc address, http base) while it is still loading its model."""
    from dflash_trt.serving.repository import generate_repository
    from dflash_trt.serving.tritonserver import (ServerPorts, TritonServerProcess, require_tritonserver,
                                                 resolve_ports, server_environment)
    from tests.engine_fixtures import shared_tiny_engine

    root = tmp_path_factory.mktemp("ready")
    repo = generate_repository(shared_tiny_engine(tmp_path_factory), root / "repo")
    install = require_tritonserver()
    ports = ServerPorts(grpc=0, http=0, metrics=None)
    resolve_ports(ports)
    server = TritonServerProcess(repo, ports, install=install, exit_timeout_s=2)
    with open(root / "tritonserver.log", "w") as log:
        proc = subprocess.Popen(server.command(), stdout=log, stderr=subprocess.STDOUT,
                                env=server_environment(install), start_new_session=True)
    try:
        yield proc, server.grpc_url, server.http_url
    finally:
        proc.kill()
        proc.wait(30)


def test_grpc_server_ready_is_honoured(starting_server):
    proc, address, _ = starting_server
    assert probe(address) is False  # still loading its model: Triton's gRPC is not up yet
    waited = wait_ready([f"grpc://{address}"], timeout_s=120, pid=proc.pid, interval_s=0.1)
    assert 0 < waited < 120 and probe(address) is True


def test_http_health(starting_server):
    proc, _, http = starting_server
    assert wait_ready([f"{http}/v2/health/ready"], timeout_s=120, pid=proc.pid, interval_s=0.1) < 120
    with pytest.raises(DFlashError, match="not ready after 1s"):
        wait_ready([f"{http}/v2/models/nope/ready"], timeout_s=1, interval_s=0.1)


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
