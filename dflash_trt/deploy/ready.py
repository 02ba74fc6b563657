"""Readiness probes the serve job runs before it declares the endpoints up.

`host:port` (or `grpc://host:port`): KServe v2 gRPC ServerReady through the real tritonclient,
the call Triton itself answers (and so does `dflash-trt serve`).
`http://host:port/path`: an HTTP GET that must answer 200 (trtllm-serve's /health, Triton's
/v2/health/ready).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from dflash_trt.errors import DFlashError


def probe(url: str, timeout_s: float = 2.0) -> bool:
    """True when the server behind `url` says it is ready; False while it is not (yet) up."""
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    address = url.removeprefix("grpc://")
    try:
        client = grpcclient.InferenceServerClient(url=address)
    except InferenceServerException:
        return False
    try:
        return bool(client.is_server_ready(client_timeout=timeout_s))
    except InferenceServerException:  # connection refused, deadline exceeded, not ready
        return False
    finally:
        client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (exited, not yet reaped by its parent shell) counts as gone.
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_ready(urls: Sequence[str], timeout_s: float, pid: int | None = None, interval_s: float = 1.0,
               on_ready: Callable[[str, float], None] | None = None) -> float:
    """Poll every url until all are ready; return the seconds waited.

    DFlashError when `timeout_s` passes, or at once when the server process `pid` has exited
    (a crashed server must fail the job now, not after the whole timeout).
    """
    t0 = time.monotonic()
    pending = list(urls)
    while True:
        for url in list(pending):
            if probe(url):
                pending.remove(url)
                if on_ready:
                    on_ready(url, time.monotonic() - t0)
        waited = time.monotonic() - t0
        if not pending:
            return waited
        if pid is not None and not _alive(pid):
            raise DFlashError(f"the server process {pid} exited before {', '.join(pending)} became ready; "
                              "see the per-rank logs")
        if waited >= timeout_s:
            raise DFlashError(f"{', '.join(pending)} not ready after {timeout_s:.0f}s; see the per-rank logs, "
                              "or raise --ready-timeout for large models")
        time.sleep(interval_s)
