"""A batch-invariant float32 GEMM for decode-sized batches on CPU: the kernel behind PackedCPULinear.

Why. A decoding step multiplies a few rows (M = rows x tokens per row: 1 for a plain step at batch
1, 4 for a 3-draft verify, 16-64 for a batch) by every weight of the model. Neither library kernel
PyTorch reaches is good at that shape on this CPU: MKL's GEMV is fastest at M = 1 but re-packs the
weight for every M > 1, and oneDNN's inner product costs ~1.3x MKL's GEMV already at M = 1. Over the
embedded target's 210 decoder linears (one thread, weights streamed, `scripts/bench_cpu_packing.py`):

    rows M               1      2      4      8     16     64
    stock (MKL)        33.9   36.5   57.6   75.3   80.7  139.7  ms
    oneDNN blocked     40.4   43.4   47.3   55.6   67.9  125.6  ms
    panels (this)      28.7   30.1   30.4   35.0   45.7  117.0  ms

(2026-11-27, `OMP_NUM_THREADS=1 scripts/bench_cpu_packing.py --threads 1`, one core of a shared
2-core VM, in a slower hour than the 2026-11-24 run: stock read 32.7 / 107.7 ms at M = 1 / 64 then.
Prefetching each panel stream 48 rows ahead, kernels/panel_gemm.cpp, took M = 2-4 from ~13 GB/s of
weights to M = 1's pace: 30.4 against 32.5 ms at M = 4 that day. At M = 256 and more, prefill
sizes, the panels reach ~94% of oneDNN's throughput.)

How. Each weight [N, K] is reordered once into panels of 16 output columns, [ceil(N/16), K, 16];
a tile holds R rows x NB panels of accumulators in vector registers and reads each panel once for
up to 8 rows (panel_gemm.cpp). Every output element is ONE sequential sum over k = 0..K-1, whatever
M, the tile shape or the thread split: a row's result does not depend on the other rows of its
batch, bit for bit. A sequence decoded alone, in a batch, plainly or in a DFlash verify pass sees
the same linear outputs (oneDNN's and MKL's do not guarantee that: their blocking follows M).

Build. Compiled from panel_gemm.cpp on first use by the machine's C++ compiler through
torch.utils.cpp_extension (ninja), one variant per ISA level -- x86-64-v4 with AVX-512, x86-64-v3
with AVX2, the compiler's baseline elsewhere; never -march=native, so a cache shared by several
machines of one level stays valid -- into ``${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/kernels``,
one directory per variant and source version. Each variant registers its ops under its own
namespace (``torch.ops.dflash_x86_64_v3``...), so a machine loads every variant it can run: the
best one serves the runtime (:func:`default_variant`), and the tests run the others too (an
AVX-512 machine checks the AVX2 build, bit for bit against its own). ``make setup`` builds them
(~20 s each). Where the kernel cannot be built (no compiler, no ninja) or
``DFLASH_TRT_PANEL_GEMM=0``, :func:`unavailable` says why and PackedCPULinear keeps oneDNN.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "panel_gemm.cpp"
DISABLE_ENV = "DFLASH_TRT_PANEL_GEMM"  # "0": keep oneDNN (A/B measurements, a suspected kernel fault)
PANEL = 16  # output columns per panel: one AVX-512 register of float32

# x86-64 variants, best first: (ISA level, the torch CPU capabilities that run it, compiler flags).
# torch's capability (ATEN_CPU_CAPABILITY=avx2 lowers it) says which the machine runs: an AVX-512
# machine runs both, an AVX2 one the v3 build only.
X86_VARIANTS = (
    ("x86_64_v4", ("AVX512",), ["-march=x86-64-v4"]),
    ("x86_64_v3", ("AVX512", "AVX2"), ["-march=x86-64-v3"]),
)


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"


def variants() -> list[str]:
    """The kernel variants this CPU runs, best first (x86_64_v4 and x86_64_v3 on AVX-512,
    x86_64_v3 on AVX2, the compiler's baseline build elsewhere)."""
    cap = _capability()
    if platform.machine() in ("x86_64", "AMD64"):
        here = [name for name, caps, _ in X86_VARIANTS if any(cap.startswith(c) for c in caps)]
        if here:
            return here
    return [f"{platform.machine().lower()}_base"]


def default_variant() -> str:
    """The variant packed layers use unless told otherwise: the best this CPU runs."""
    return variants()[0]


def _flags(variant: str) -> list[str]:
    return next((flags for name, _, flags in X86_VARIANTS if name == variant), [])


def namespace(variant: str | None = None) -> str:
    """The torch.ops namespace of a variant's ops."""
    return f"dflash_{variant or default_variant()}"


def build_flags(variant: str, ops_namespace: str | None = None) -> list[str]:
    """The compiler flags of `variant`, its ops registered under `ops_namespace` (default: the
    variant's own, :func:`namespace`; scripts/bench_kernel_ab.py builds another source beside it)."""
    return ["-O3", "-ffp-contract=fast", f"-DDFLASH_OPS_NAMESPACE={ops_namespace or namespace(variant)}",
            *_flags(variant)]


def build_dir(variant: str) -> Path:
    """Where `variant` of THIS source version is built and cached: one directory per source version
    and flags, compiled from a copy inside it, so checkouts of other versions (or of the same
    version at another path) sharing the cache do not rebuild it in turn."""
    from dflash_trt.models.smollm2 import cache_root

    # torch's build files name its include directories, i.e. the virtualenv's path: two
    # environments (or one reached through a symlink) sharing the cache would rebuild it in turn
    torch_dir = str(Path(torch.__file__).parent)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([*build_flags(variant), torch_dir]).encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"torch-{torch.__version__.split('+')[0]}" / f"dflash_panel_gemm_{variant}-{digest}"


@functools.lru_cache(maxsize=None)
def _load(variant: str) -> str | None:
    """Build (once per machine, variant and source version) and load a variant; None on success, else why not."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    if variant not in variants():
        return f"variant {variant} does not run on this CPU (torch reports {_capability()}; runs {', '.join(variants())})"
    ns = namespace(variant)
    if not hasattr(getattr(torch.ops, ns), "panel_linear"):
        try:
            from torch.utils.cpp_extension import load

            from dflash_trt.fsutil import atomic_file

            directory = build_dir(variant)
            directory.mkdir(parents=True, exist_ok=True)
            source = SOURCE.read_bytes()
            copy = directory / SOURCE.name
            if not copy.is_file() or copy.read_bytes() != source:
                with atomic_file(copy) as tmp:
                    tmp.write_bytes(source)
            with _sole_builder(directory):
                load(f"dflash_panel_gemm_{variant}", [str(copy)], extra_cflags=build_flags(variant),
                     build_directory=str(directory), is_python_module=False, verbose=False)
        # no compiler or ninja, a failed build, a read-only cache (atomic_file's one line)
        except (OSError, DFlashError, RuntimeError, ImportError, ValueError) as e:
            return f"cannot build {SOURCE.name}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    _register_fake(ns)
    return None


@contextlib.contextmanager
def _sole_builder(build_dir: Path) -> Iterator[None]:
    """Hold the build directory against every other process of ours while torch builds or loads it.

    Why: torch.utils.cpp_extension marks a build with a plain ``lock`` file and waits, without a
    timeout, for it to vanish. A process killed while building (a stopped job, a timed-out test)
    leaves that file, and every later load on the machine waits forever: ``make setup`` once hung
    for the whole of a CI run on it. An flock is released by the kernel when its holder dies, so
    whoever holds ours knows that no live process of ours is building: a ``lock`` file found then
    is stale and goes.
    """
    with open(build_dir / ".dflash-build.flock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a live builder finishes in ~20 s; then it is ours
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _register_fake(ns: str) -> None:
    """Shapes for tracing (torch.compile / dynamo): the op is opaque to it, like any custom op."""
    try:
        @torch.library.register_fake(f"{ns}::panel_linear")
        def _(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
            return x.new_empty((x.shape[0], n))
    except RuntimeError:  # registered already (another import of this module)
        pass


def unavailable(variant: str | None = None) -> str | None:
    """None when the variant (default: :func:`default_variant`) is loaded, building it first if
    needed, else why it is not."""
    reason = _load(variant or default_variant())
    if reason is not None:
        _warn_once(reason)
    return reason


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    log.warning("panel GEMM kernel unavailable (%s): linear layers use oneDNN, slower at decoding batch sizes",
                reason)


def pack(weight: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N/16), K, 16] (a new tensor; the weight is not kept).
    Every variant reads the same layout. Loads the variant (building it if needed): RuntimeError
    where it cannot be."""
    reason = unavailable(variant)
    if reason is not None:
        raise RuntimeError(f"panel GEMM kernel unavailable: {reason}")
    return getattr(torch.ops, namespace(variant)).panel_pack(weight.detach())


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           variant: str | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, out_features], with the weight as :func:`pack` reordered it (the
    variant must be loaded: :func:`pack` or :func:`unavailable` loads it)."""
    return getattr(torch.ops, namespace(variant)).panel_linear(x, panels, out_features, bias)


def main() -> None:
    """`python -m dflash_trt.runtime.cpu.panel_gemm`: build every variant this CPU runs now (make
    setup), say the outcome of each."""
    for variant in variants():
        reason = unavailable(variant)
        role = "serves the runtime" if variant == default_variant() else "tested beside it"
        print(f"[setup] panel GEMM kernel {variant}: "
              + (f"built and loaded ({role})" if reason is None else "unavailable: " + reason))


if __name__ == "__main__":
    main()
