"""`dflash-trt serve` as the child of a measurement script (serve_load.py, serve_overhead.py).

Started on free ports with a ready file, waited for, and stopped when the script ends, however it
ends: at the end of the block, or, where the script dies without its `finally` (a SIGTERM, a
SIGKILL), by the kernel, which sends serve a SIGTERM when its parent dies (PR_SET_PDEATHSIG);
otherwise serve, and the tritonserver it runs, would be left orphaned. serve stops tritonserver and
its stubs itself.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ready:
    """What serve's ready file says: `host:grpc_port metrics_port http_port openai_port`."""
    proc: subprocess.Popen
    grpc: str
    metrics_port: str
    http_port: str
    openai_port: str

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def openai_base(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def server_mib(self, field: str = "VmRSS") -> float:
        """RSS (VmRSS) or peak RSS (VmHWM) of tritonserver plus its stub, summed: the processes
        under serve (whose own is the OpenAI front)."""
        import psutil

        return sum(_status_mib(p.pid, field) for p in psutil.Process(self.proc.pid).children(recursive=True))


def _status_mib(pid: int, field: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:  # the process has just gone
        pass
    return 0.0


def _stop_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the block's end still stops it
        pass


@contextmanager
def serve_child(args: list[str]) -> Iterator[Ready]:
    """`dflash-trt serve ARGS` on ephemeral ports until the block ends (its log: a temporary file,
    its tail printed if serve exits before it is ready)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, log = Path(tmp) / "ready", Path(tmp) / "serve.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", *args, "--grpc-port", "0",
                                     "--http-port", "0", "--metrics-port", "0", "--openai-port", "0",
                                     "--exit-timeout-secs", "5", "--ready-file", str(ready)],
                                    stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_stop_with_parent)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    sys.exit(f"error: serve exited: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield Ready(proc, *ready.read_text().split())
        finally:
            proc.terminate()
            proc.wait(60)
