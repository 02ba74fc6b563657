"""The real Triton Inference Server: which one, what it needs to run our model, and its process.

Which tritonserver (:func:`find_tritonserver`), the first found of:

1. ``$DFLASH_TRT_TRITONSERVER`` (a path to the binary), for a site with its own build;
2. ``tritonserver`` on ``PATH``;
3. ``/opt/tritonserver/bin/tritonserver``, as in NVIDIA's containers;
4. the one ``make setup`` installed from PyPI's nvidia-pytriton wheel (serving/triton_install.py).

Its Python backend runs our model.py in a *stub* process, and the stub (tried on this kind of
machine: ../shared/design/triton-real.md) needs

- a stub built for this Python's major.minor, in ``<backends>/python/``;
- this Python's shared ``libpython<major.minor>.so`` on ``LD_LIBRARY_PATH`` (the library of the
  interpreter the virtualenv was made from: another build of the same version fails at load);
- this virtualenv's ``bin/`` first on ``PATH`` (the stub finds its packages through the first
  ``python3`` there);
- numpy < 2 in this environment: numpy 2 breaks every BYTES tensor in the 2.51 stub, and the stub
  dies at the first text request.

:func:`stub_problems` names each missing piece in one line (``doctor`` prints them) and
:func:`require_tritonserver` refuses to start with the first of them.

:class:`TritonServerProcess` starts tritonserver in a session of its own, passes its log
through, waits until it is ready (or says in one line why it exited), and stops it: SIGTERM, then
after Triton's own ``--exit-timeout-secs`` and a margin, SIGKILL to its whole process group, so
the stubs go with it. The server dies with the process that started it (``PR_SET_PDEATHSIG``),
so a ``serve`` killed with SIGKILL leaves no server holding its ports.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dflash_trt.errors import DFlashError

ENV_BINARY = "DFLASH_TRT_TRITONSERVER"
CONTAINER_BINARY = Path("/opt/tritonserver/bin/tritonserver")
STUB = "triton_python_backend_stub"
SETUP_HINT = "run `make setup` (or `dflash-trt setup-tritonserver`)"


@dataclass(frozen=True)
class TritonInstall:
    """A tritonserver binary and what running it takes."""

    binary: Path
    backends: Path  # --backend-directory: holds python/ (libtriton_python.so, the stub, pb utils)
    lib_dirs: tuple[Path, ...] = ()  # its bundled libraries (the wheel's nvidia_pytriton.libs)
    origin: str = ""  # where it was found, for messages

    @property
    def stub(self) -> Path:
        return self.backends / "python" / STUB


def _from_binary(binary: Path, origin: str) -> TritonInstall:
    """An install from its binary: backends and bundled libraries sit beside bin/ (a container's
    /opt/tritonserver, or the wheel's pytriton/tritonserver)."""
    binary = binary.resolve()
    prefix = binary.parent.parent
    libs = tuple(p for p in (prefix.parent.parent / "nvidia_pytriton.libs", prefix / "lib") if p.is_dir())
    return TritonInstall(binary, prefix / "backends", libs, origin)


def find_tritonserver() -> TritonInstall | None:
    """The tritonserver this machine would run (module docstring), or None."""
    env = os.environ.get(ENV_BINARY)
    if env:
        return _from_binary(Path(env), f"${ENV_BINARY}")
    on_path = shutil.which("tritonserver")
    if on_path:
        return _from_binary(Path(on_path), "PATH")
    if CONTAINER_BINARY.is_file():
        return _from_binary(CONTAINER_BINARY, str(CONTAINER_BINARY.parent.parent))
    from dflash_trt.serving.triton_install import SERVER_ROOT, install_root, is_installed

    root = install_root()
    if is_installed(root):
        return _from_binary(root / SERVER_ROOT / "bin" / "tritonserver", f"dflash-trt's install ({root})")
    return None


def python_libdir() -> Path | None:
    """The directory of this interpreter's shared libpython, or None when it was built static."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    name = sysconfig.get_config_var("LDLIBRARY")
    if not libdir or not name or not (Path(libdir) / name).exists():
        return None
    return Path(libdir)


def _stub_python(stub: Path) -> str | None:
    """The major.minor a stub was built for, from the libpython it links (None: unreadable)."""
    try:
        data = stub.read_bytes()
    except OSError:
        return None
    found = re.search(rb"libpython(3\.\d+)\.so", data)
    return found.group(1).decode() if found else None


@dataclass(frozen=True)
class StubFacts:
    """What the stub needs of this Python environment, as read off it (:meth:`here`)."""

    python: str  # major.minor of the interpreter
    libdir: Path | None  # where its shared libpython is (None: built static, or the library is missing)
    numpy: str | None  # numpy's version in this environment (None: not installed)
    prefix: str = ""  # the environment, for messages

    @classmethod
    def here(cls) -> "StubFacts":
        try:
            numpy_version = importlib.metadata.version("numpy")
        except importlib.metadata.PackageNotFoundError:
            numpy_version = None
        return cls(f"{sys.version_info.major}.{sys.version_info.minor}", python_libdir(), numpy_version, sys.prefix)


def stub_problems(install: TritonInstall | None, facts: StubFacts | None = None) -> list[str]:
    """What keeps tritonserver's Python backend from running our model here, one line each."""
    if install is None:
        return [f"no tritonserver found (not ${ENV_BINARY}, not on PATH, not in {CONTAINER_BINARY.parent.parent}, "
                f"not installed by dflash-trt); {SETUP_HINT}, or run in NVIDIA's Triton container"]
    facts = facts or StubFacts.here()
    here = facts.python
    problems = []
    if not install.binary.is_file() or not os.access(install.binary, os.X_OK):
        problems.append(f"{install.binary} ({install.origin}) is not an executable file; {SETUP_HINT}")
    if not install.stub.is_file():
        problems.append(f"no Python backend stub in {install.stub.parent} for Python {here}; {SETUP_HINT}, or copy "
                        f"python_backend_stubs/{here}/{STUB} there")
    else:
        built_for = _stub_python(install.stub)
        if built_for is not None and built_for != here:
            problems.append(f"the Python backend stub {install.stub} is built for Python {built_for}, this "
                            f"environment runs {here}; serve from a Python {built_for} virtualenv, or install a stub "
                            f"for {here} ({SETUP_HINT})")
    if facts.libdir is None:
        problems.append(f"this Python ({here}) has no shared libpython{here}.so, which the stub links; use a Python "
                        f"built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)")
    if facts.numpy is None:
        problems.append(f"numpy is not installed in {facts.prefix}; the Python backend needs it (`pip install "
                        f"'numpy<2'`)")
    elif int(facts.numpy.split(".")[0]) >= 2:
        problems.append(f"numpy {facts.numpy} in {facts.prefix}: Triton's Python backend stub garbles every text "
                        f"(BYTES) tensor with numpy 2; `pip install 'numpy<2'` ({SETUP_HINT} pins it)")
    return problems


def require_tritonserver() -> TritonInstall:
    """The tritonserver to run, or DFlashError naming the first thing missing and its fix."""
    install = find_tritonserver()
    problems = stub_problems(install)
    if problems:
        raise DFlashError(problems[0])
    assert install is not None
    return install


def server_environment(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver and its stubs run in (module docstring)."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join([venv_bin, *[p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]])
    libs = [str(p) for p in (python_libdir(), *install.lib_dirs) if p is not None]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *[p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]])
    # where model.py runs `import dflash_trt` from: this process's copy (a checkout run with
    # PYTHONPATH, or the installed package)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    # a server meets new GEMM shapes for as long as it gets new prompts: bound oneDNN's caches in
    # the stub that runs the model (an operator's values win; runtime/cpu/kernel_caches.py says why)
    from dflash_trt.runtime.cpu.kernel_caches import bound_kernel_caches

    bound_kernel_caches(env=env)
    return env


# ----------------------------------------------------------------------------------------------
# ports
# ----------------------------------------------------------------------------------------------

@dataclass
class ServerPorts:
    """The endpoints of one server. A port of 0 is replaced by a free one at start; None turns
    that endpoint off (HTTP, metrics)."""

    grpc: int = 8001
    http: int | None = None
    metrics: int | None = 8002
    address: str = "127.0.0.1"

    def named(self) -> list[tuple[str, int | None]]:
        return [("--grpc-port", self.grpc), ("--http-port", self.http), ("--metrics-port", self.metrics)]


def free_port(address: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def check_port_free(address: str, port: int, flag: str) -> None:
    """DFlashError naming the port and its flag when something already listens there."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            raise DFlashError(f"port {port} on {address} ({flag}) is taken ({e.strerror}); pass another {flag}, "
                              f"or stop what holds it (`ss -ltnp 'sport = :{port}'` names it)") from None


def resolve_ports(ports: ServerPorts, extra: list[tuple[str, int | None]] = ()) -> None:
    """Fill in every 0 with a free port and check the others are free (in place)."""
    taken: set[int] = set()
    for flag, port in [*ports.named(), *extra]:
        if port is None or port == 0:
            continue
        check_port_free(ports.address, port, flag)
        if port in taken:
            raise DFlashError(f"port {port} is given to two endpoints ({flag} and another); give each its own")
        taken.add(port)

    def pick() -> int:
        while (p := free_port(ports.address)) in taken:
            pass
        taken.add(p)
        return p

    if ports.grpc == 0:
        ports.grpc = pick()
    if ports.http == 0:
        ports.http = pick()
    if ports.metrics == 0:
        ports.metrics = pick()


# ----------------------------------------------------------------------------------------------
# the process
# ----------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # its own process group: the stubs are in it, and one killpg stops them all
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: stop() still kills the group
        pass


_LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version (\d+): (.*)")
_ERROR_LINE = re.compile(r"^E\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] (.*)$")


def _clean(message: str) -> str:
    """One line of a Triton log message: quotes, escapes and the Python backend's traceback
    ("\\n\\nAt:\\n  file(line): function ...") off."""
    message = message.strip().strip('"').split("\\n\\nAt:", 1)[0]
    return " ".join(message.replace("\\n", " ").replace('\\"', '"').split())


def explain_exit(lines: list[str], code: int | None) -> str:
    """One line saying why tritonserver exited, from its last log lines."""
    for line in reversed(lines):
        m = _LOAD_FAILURE.search(line)
        if m:
            cause = _clean(m.group(3))
            cause = re.sub(r"^(Internal|Invalid argument|Not found|Unavailable|Unknown): ", "", cause)
            cause = re.sub(r"^\w+(Error|Exception): ", "", cause)  # the Python exception's class
            return f"tritonserver could not load model {m.group(1)!r}: {cause}"
    for line in reversed(lines):
        if "already in use" in line or "Address already in use" in line:
            return f"tritonserver could not bind a port: {_clean(line.split(']', 1)[-1])}; pass other ports"
    errors = [_clean(m.group(1)) for line in lines if (m := _ERROR_LINE.match(line.strip()))]
    errors = [e for e in errors if "CudaDriverHelper" not in e and "NVML" not in e]
    if errors:
        return f"tritonserver exited (code {code}): {errors[-1]}"
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return f"tritonserver exited (code {code}): {last}"


@dataclass
class TritonServerProcess:
    """tritonserver over one model repository, started and stopped with its stubs.

        with TritonServerProcess(repo, ServerPorts(grpc=0, http=0, metrics=0)) as server:
            ...server.grpc_url...
    """

    repository: Path
    ports: ServerPorts = field(default_factory=ServerPorts)
    models: list[str] | None = None  # load only these (--model-control-mode=explicit)
    exit_timeout_s: float = 30.0  # Triton's --exit-timeout-secs: in-flight requests get this long at stop
    install: TritonInstall | None = None
    log: IO[str] | None = None  # where its log goes (default: this process's stderr)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    process: subprocess.Popen | None = None
    _pump: threading.Thread | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.ports.address}:{self.ports.grpc}"

    @property
    def http_url(self) -> str | None:
        return f"http://{self.ports.address}:{self.ports.http}" if self.ports.http else None

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.ports.address}:{self.ports.metrics}/metrics" if self.ports.metrics else None

    def command(self) -> list[str]:
        assert self.install is not None
        p = self.ports
        cmd = [str(self.install.binary), f"--model-repository={self.repository}",
               f"--backend-directory={self.install.backends}",
               f"--grpc-port={p.grpc}", f"--grpc-address={p.address}",
               f"--exit-timeout-secs={int(round(self.exit_timeout_s))}", "--log-verbose=0"]
        cmd += [f"--http-port={p.http}", f"--http-address={p.address}"] if p.http else ["--allow-http=false"]
        cmd += ([f"--metrics-port={p.metrics}", f"--metrics-address={p.address}", "--allow-gpu-metrics=false"]
                if p.metrics else ["--allow-metrics=false"])
        if self.models:
            cmd += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in self.models]]
        return cmd + self.extra_args

    def start(self, ready_timeout_s: float = 900.0) -> "TritonServerProcess":
        """Start and wait until the server and every model are ready; DFlashError (one line: why it
        exited, or that it did not get ready in time) with nothing left running otherwise."""
        if not self.repository.is_dir():
            raise DFlashError(f"model repository {self.repository} does not exist; write one with `dflash-trt deploy "
                              f"triton ENGINE --out {self.repository}`")
        if not any(self.repository.glob("*/config.pbtxt")):
            raise DFlashError(f"{self.repository} holds no model (no <model>/config.pbtxt); write it with "
                              f"`dflash-trt deploy triton`")
        self.install = self.install or require_tritonserver()
        resolve_ports(self.ports)
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                        env=self.env or server_environment(self.install),
                                        preexec_fn=_die_with_parent)
        self._pump = threading.Thread(target=self._pass_log, name="tritonserver-log", daemon=True)
        self._pump.start()
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def _pass_log(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        sink = self.log or sys.stderr
        for line in self.process.stdout:
            self.tail.append(line.rstrip("\n"))
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):  # the sink closed (a test's capture ended): keep draining
                pass

    def _wait_ready(self, timeout_s: float) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while True:
                if self.process.poll() is not None:
                    if self._pump is not None:
                        self._pump.join(5)  # the last lines say why
                    raise DFlashError(explain_exit(list(self.tail), self.process.returncode))
                try:
                    if client.is_server_ready(client_timeout=2.0):
                        return
                except InferenceServerException:
                    pass
                if time.monotonic() > deadline:
                    raise DFlashError(f"tritonserver was not ready after {timeout_s:.0f} s (models still loading?); "
                                      f"raise --ready-timeout, or read its log above")
                time.sleep(0.25)
        finally:
            client.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM (Triton lets in-flight requests finish for its exit timeout), then SIGKILL the
        whole group after `grace_s` (default: the exit timeout + 15 s); returns the exit code."""
        if self.process is None:
            return None
        if self.running:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(self.exit_timeout_s + 15.0 if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL tritonserver and everything in its group (its stubs); returns its exit code."""
        if self.process is None:
            return None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.process.wait()
        if self._pump is not None:
            self._pump.join(5)
        return code

    def __enter__(self) -> "TritonServerProcess":
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
