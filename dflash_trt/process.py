"""What a long command knows about its own process: the time and peak memory of each phase
(:class:`Profile`), SIGTERM turned into a clean interrupt, and the versions it ran with.

`build` is the first user (its ``--profile`` table, the manifest's ``timings_s`` and
``versions``, the temporary engine directory removed on ``scancel``); nothing here knows what a
phase does.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Profile:
    """Wall time and memory of each named phase, in the order they first ran."""

    phases: dict[str, float] = field(default_factory=dict)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    peak_gpu_mib: dict[str, float] = field(default_factory=dict)  # largest per-GPU peak, when on GPUs
    rss_mib: dict[str, float] = field(default_factory=dict)  # resident at the end of the phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
            # The process's peak so far: read after each phase, the first phase whose value jumps
            # is the one that set the peak.
            self.peak_rss_mib[name] = peak_rss_mib()
            self.rss_mib[name] = _proc_status_mib("VmRSS") or 0.0
            gpu = _gpu_peak_mib()
            if gpu is not None:
                self.peak_gpu_mib[name] = gpu


def _proc_status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (MiB): VmHWM on Linux, which starts afresh at
    exec; getrusage's ru_maxrss survives exec, so a build started by a large parent process would
    report the parent's peak."""
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _gpu_peak_mib() -> float | None:
    """The largest peak allocation on any GPU so far (None when torch has not touched a GPU)."""
    if "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 2**20


def render_profile(prof: Profile, console: Any) -> None:
    """The profile as a rich table: one row a phase, then the total."""
    from rich.table import Table

    t = Table(title="build profile")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    t.add_column("peak RSS so far (MiB)", justify="right")
    t.add_column("RSS at end (MiB)", justify="right")
    gpu = bool(prof.peak_gpu_mib)
    if gpu:
        t.add_column("peak GPU so far (MiB, largest GPU)", justify="right")
    for name, secs in prof.phases.items():
        row = [name, f"{secs:.2f}", f"{prof.peak_rss_mib.get(name, 0):.0f}", f"{prof.rss_mib.get(name, 0):.0f}"]
        t.add_row(*row, *([f"{prof.peak_gpu_mib.get(name, 0):.0f}"] if gpu else []))
    total = ["total", f"{sum(prof.phases.values()):.2f}", f"{max(prof.peak_rss_mib.values(), default=0):.0f}", ""]
    t.add_row(*total, *([f"{max(prof.peak_gpu_mib.values()):.0f}"] if gpu else []))
    console.print(t)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (timeout, scancel, kill) into KeyboardInterrupt so the temporary engine
    directory is removed; by default SIGTERM kills Python without running any cleanup."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


BASE_LIBRARIES = ("torch", "transformers", "safetensors", "pydantic", "pyyaml")


def library_versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """dflash-trt's, Python's and the libraries' versions ("not installed" for a missing one):
    what an artifact records about the process that made it."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from dflash_trt import __version__

    out = {"dflash-trt": __version__, "python": platform.python_version()}
    for lib in (*BASE_LIBRARIES, *extra):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = "not installed"
    return out
