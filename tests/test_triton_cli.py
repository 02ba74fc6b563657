"""`dflash-trt serve` and `dflash-trt client` as processes: ready file, real client, SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

try:
    from tests.engine_fixtures import reference_answer, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import reference_answer, shared_tiny_engine

CLI = [sys.executable, "-m", "dflash_trt.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_serve_refuses_bad_sources_with_one_line(tmp_path):
    r = _run(["serve", "--model-repository", str(tmp_path / "missing"), "--grpc-port", "0", "--metrics-port", "0"])
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _run(["serve", str(tmp_path), "--grpc-port", "0", "--no-allow-metrics"])  # neither engine nor repository
    assert r.returncode == 2 and "dflash_trt.json missing" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_engine_client_and_sigterm_drains_in_flight(tmp_path_factory, tmp_path):
    engine = shared_tiny_engine(tmp_path_factory)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(CLI + ["serve", str(engine), "--grpc-port", "0", "--metrics-port", "0",
                                   "--ready-file", str(ready), "--exit-timeout-secs", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 150
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.time() < deadline, "server did not become ready"
            time.sleep(0.2)
        address, metrics_port, _http_port = ready.read_text().split()
        assert int(metrics_port) > 0

        r = _run(["client", "Hello world", "--url", address, "--max-tokens", "16", "--json"])
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == reference_answer(engine, "Hello world", 16)
        assert out["total_accepted_draft_tokens"] <= out["total_draft_tokens"]

        # a long streamed request in flight when SIGTERM arrives still completes
        from dflash_trt.serving.client import generate

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
        assert proc.wait(60) == 0
        assert "signal" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
