"""`dflash-trt serve` and `dflash-trt client` as processes, on the real tritonserver: bad input
in one line, the ready file, both clients, SIGTERM draining what is in flight, SIGKILL leaving
nothing behind, and a restart on the same ports answering as before."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from dflash_trt.serving.client import generate
from tests.engine_fixtures import reference_answer, shared_tiny_engine

CLI = [sys.executable, "-m", "dflash_trt.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env or ENV)


def _one_line_error(r: subprocess.CompletedProcess, fragment: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_serve_refuses_bad_sources_with_one_line(tmp_path):
    r = _run(["serve", "--model-repository", str(tmp_path / "missing"), "--grpc-port", "0", "--metrics-port", "0"])
    _one_line_error(r, "does not exist")
    r = _run(["serve", str(tmp_path), "--grpc-port", "0", "--no-allow-metrics"])  # neither engine nor repository
    _one_line_error(r, "dflash_trt.json missing")


def test_serve_without_a_usable_tritonserver_says_what_is_missing(tmp_path):
    r = _run(["serve", str(tmp_path)], env={**ENV, "DFLASH_TRT_TRITONSERVER": str(tmp_path / "nowhere" / "tritonserver")})
    _one_line_error(r, "is not an executable file")


def test_a_taken_port_is_one_line_naming_it_and_nothing_starts(tmp_path_factory):
    engine = shared_tiny_engine(tmp_path_factory)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        for flag in ("--grpc-port", "--metrics-port", "--openai-port"):
            ports = {"--grpc-port": "0", "--metrics-port": "0", "--openai-port": "0", flag: str(port)}
            r = _run(["serve", str(engine), *[x for kv in ports.items() for x in kv]])
            _one_line_error(r, f"port {port} on 127.0.0.1 ({flag}) is taken")
            assert "Started GRPCInferenceService" not in r.stderr  # refused before tritonserver ran


def _start(args: list[str], ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen(CLI + ["serve", *args, "--ready-file", str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 240
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "serve did not become ready"
        time.sleep(0.2)
    return proc


def _family(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _gone(processes: list[psutil.Process], timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_answers_both_clients_drains_on_sigterm_and_restarts_after_sigkill(tmp_path_factory, tmp_path):
    engine = shared_tiny_engine(tmp_path_factory)
    ready = tmp_path / "ready"
    proc = _start([str(engine), "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0", "--openai-port", "0",
                   "--decoupled", "--exit-timeout-secs", "60"], ready)
    try:
        address, metrics_port, http_port, openai_port = ready.read_text().split()
        ports = {"grpc": address.rsplit(":", 1)[1], "metrics": metrics_port, "http": http_port, "openai": openai_port}
        assert all(int(p) > 0 for p in ports.values())
        family = _family(proc)
        assert any(p.name() == "tritonserver" for p in family)
        assert any("triton_python_backend_stub" in " ".join(p.cmdline()) for p in family)

        # `dflash-trt client`: one user turn over gRPC, and the same through the OpenAI front
        expected = reference_answer(engine, "Hello world", 16)
        for url in (address, f"http://127.0.0.1:{openai_port}"):
            r = _run(["client", "Hello world", "--url", url, "--max-tokens", "16", "--json"])
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["text"] == expected and out["total_accepted_draft_tokens"] <= out["total_draft_tokens"]

        # SIGKILL: serve cannot clean up, yet tritonserver and its stub die with it and free the ports
        proc.kill()
        proc.wait(30)
        assert _gone(family), [p.cmdline() for p in family if p.is_running()]
        ready.unlink()
        proc = _start([str(engine), "--grpc-port", ports["grpc"], "--metrics-port", ports["metrics"],
                       "--http-port", ports["http"], "--openai-port", ports["openai"], "--decoupled",
                       "--exit-timeout-secs", "60"], ready)
        assert ready.read_text().split() == [address, metrics_port, http_port, openai_port]
        assert generate(address, "Hello world", max_tokens=16, timeout_s=60).text == expected

        # SIGTERM: a long streamed request in flight still completes, then everything stops, exit 0
        family = _family(proc)
        box: dict = {}
        first = threading.Event()
        t = threading.Thread(target=lambda: box.update(r=generate(
            address, "The capital of France is", stream=True, max_tokens=150, timeout_s=120,
            on_text=lambda _: first.set())))
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert box["r"].text == reference_answer(engine, "The capital of France is", 150)
        assert proc.wait(120) == 0
        assert _gone(family)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
