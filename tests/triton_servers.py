"""Real tritonserver instances for the serving tests: the server `dflash-trt serve` runs (found
as it finds it: PATH, /opt/tritonserver, or the one `make setup` installed), over repositories
`deploy triton` writes for the tiny engine, with the OpenAI front beside it as `serve` starts it.

A start costs ~10 s on the 2-core machine, so the two servers most tests need are shared by the
whole session (tests/conftest.py: `triton_streaming`, decoupled; `triton_unary`, not decoupled);
a test that needs a server of its own (its own settings, a restart, a stop) starts one here.
Every server is on free ports, logs to a file beside its repository, and is stopped (its stubs
with it) when the test or the session ends.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.serving.limits import DEFAULT_MAX_STREAMS
from dflash_trt.serving.openai_front import OpenAIFront
from dflash_trt.serving.repository import TritonRepoSettings, generate_repository
from dflash_trt.serving.serve import OpenAIThread
from dflash_trt.serving.tritonserver import ServerPorts, TritonServerProcess


@dataclass
class Served:
    server: TritonServerProcess
    front: OpenAIThread | None
    repo: Path

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def http_base(self) -> str:
        assert self.server.http_url, "this server has no HTTP port"
        return self.server.http_url

    @property
    def http_port(self) -> int:
        return int(self.server.ports.http or 0)

    @property
    def openai_base(self) -> str:
        assert self.front is not None, "this server has no OpenAI front"
        return f"http://127.0.0.1:{self.front.port}"

    def metrics_text(self) -> str:
        assert self.server.metrics_url, "this server has no metrics port"
        return urllib.request.urlopen(self.server.metrics_url, timeout=10).read().decode()

    def metrics(self) -> dict[str, float]:
        """Every sample of the metrics port, by its line's name and labels."""
        values = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def cancellations(self) -> float:
        """The model's count of requests their clients cancelled (metrics.py's counter)."""
        return self.metrics().get('dflash_cancelled_requests_total{model="dflash",version="1"}', 0)

    def tokens_before_cancel(self, request_id: str, cancelled_before: float, timeout_s: float = 30) -> list[int]:
        """Waits until the model has counted a cancellation beyond `cancelled_before`, then returns
        how many tokens each cancellation of `request_id` had produced, as the model's log says."""
        deadline = time.time() + timeout_s
        while self.cancellations() <= cancelled_before:
            assert time.time() < deadline, "the model never saw the client leave"
            time.sleep(0.05)
        log = (self.repo.parent / f"tritonserver-{self.repo.name}.log").read_text()
        pattern = rf"request {re.escape(request_id)} cancelled by its client after (\d+) of"
        return [int(n) for n in re.findall(pattern, log)]

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop(grace_s=1.0)
        self.server.stop()


def serve_repository(repo: Path, http: bool = True, metrics: bool = True, openai: bool = True,
                     exit_timeout_s: float = 2.0, max_streams: int = DEFAULT_MAX_STREAMS) -> Served:
    """tritonserver over `repo` (and the OpenAI front), ready."""
    ports = ServerPorts(grpc=0, http=0 if http else None, metrics=0 if metrics else None)
    log = open(repo.parent / f"tritonserver-{repo.name}.log", "w")  # noqa: SIM115 - the server writes it while it runs
    server = TritonServerProcess(repo, ports, exit_timeout_s=exit_timeout_s, log=log).start(ready_timeout_s=300)
    front = None
    try:
        if openai:
            front = OpenAIThread(OpenAIFront(server.grpc_url, max_streams=max_streams), "127.0.0.1", 0).start()
    except BaseException:
        server.stop()
        raise
    return Served(server, front, repo)


def serve_engine(engine: Path, where: Path, settings: TritonRepoSettings | None = None, **kw) -> Served:
    """A repository for `engine` under `where` (settings as `deploy triton` takes them), served."""
    repo = generate_repository(engine, where / "repo", settings or TritonRepoSettings())
    return serve_repository(repo, **kw)
