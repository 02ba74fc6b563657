"""A batch-invariant float32 GEMM for decode-sized batches on CPU: the kernel behind PackedCPULinear.

Why. A decoding step multiplies a few rows (M = rows x tokens per row: 1 for a plain step at batch
1, 4 for a 3-draft verify, 16-64 for a batch) by every weight of the model. Neither library kernel
PyTorch reaches is good at that shape on this CPU: MKL's GEMV is fastest at M = 1 but re-packs the
weight for every M > 1, and oneDNN's inner product costs ~1.3x MKL's GEMV already at M = 1. Over the
embedded target's 210 decoder linears (one thread, weights streamed, `scripts/bench_cpu_packing.py`):

    rows M               1      2      4      8     16     64
    stock (MKL)        32.7   35.9   56.3   70.8   72.2  107.7  ms
    oneDNN blocked     42.1   43.2   45.3   51.1   59.6  105.4  ms
    panels (this)      27.6   29.9   32.5   37.7   48.1  101.1  ms

(2026-11-24, `OMP_NUM_THREADS=1 scripts/bench_cpu_packing.py --threads 1`, one core of a shared
2-core VM; at M = 256 and more, prefill sizes, the panels reach ~94% of oneDNN's throughput.)

How. Each weight [N, K] is reordered once into panels of 16 output columns, [ceil(N/16), K, 16];
a tile holds R rows x NB panels of accumulators in vector registers and reads each panel once for
up to 8 rows (panel_gemm.cpp). Every output element is ONE sequential sum over k = 0..K-1, whatever
M, the tile shape or the thread split: a row's result does not depend on the other rows of its
batch, bit for bit. A sequence decoded alone, in a batch, plainly or in a DFlash verify pass sees
the same linear outputs (oneDNN's and MKL's do not guarantee that: their blocking follows M).

Build. Compiled from panel_gemm.cpp on first use by the machine's C++ compiler through
torch.utils.cpp_extension (ninja), for the CPU's ISA level -- x86-64-v4 with AVX-512, x86-64-v3 with
AVX2, the compiler's baseline otherwise; never -march=native, so a cache shared by several machines
of one level stays valid -- into ``${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/kernels``. ``make setup``
builds it (~20 s). Where it cannot be built (no compiler, no ninja) or ``DFLASH_TRT_PANEL_GEMM=0``,
:func:`unavailable` says why and PackedCPULinear keeps oneDNN.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "panel_gemm.cpp"
DISABLE_ENV = "DFLASH_TRT_PANEL_GEMM"  # "0": keep oneDNN (A/B measurements, a suspected kernel fault)
PANEL = 16  # output columns per panel: one AVX-512 register of float32


def _isa_flags() -> tuple[str, list[str]]:
    """(name suffix, compiler flags) for this CPU's vector ISA level as PyTorch detects it."""
    capability = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
    if platform.machine() in ("x86_64", "AMD64"):
        if capability.startswith("AVX512"):
            return "x86_64_v4", ["-march=x86-64-v4"]
        if capability == "AVX2":
            return "x86_64_v3", ["-march=x86-64-v3"]
    return f"{platform.machine()}_base", []


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """Build (once per machine and ISA level) and load the kernel; None on success, else why not."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    if not hasattr(torch.ops, "dflash") or not hasattr(torch.ops.dflash, "panel_linear"):
        try:
            from torch.utils.cpp_extension import load

            from dflash_trt.models.smollm2 import cache_root

            suffix, flags = _isa_flags()
            name = f"dflash_panel_gemm_{suffix}"
            build_dir = cache_root() / "kernels" / f"torch-{torch.__version__.split('+')[0]}" / name
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name, [str(SOURCE)], extra_cflags=["-O3", "-ffp-contract=fast", *flags], build_directory=str(build_dir),
                 is_python_module=False, verbose=False)
        except (OSError, RuntimeError, ImportError, ValueError) as e:  # no compiler, no ninja, a failed build
            return f"cannot build {SOURCE.name}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    _register_fake()
    return None


def _register_fake() -> None:
    """Shapes for tracing (torch.compile / dynamo): the op is opaque to it, like any custom op."""
    try:
        @torch.library.register_fake("dflash::panel_linear")
        def _(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
            return x.new_empty((x.shape[0], n))
    except RuntimeError:  # registered already (another import of this module)
        pass


def unavailable() -> str | None:
    """None when the kernel is loaded (building it first if needed), else why it is not."""
    reason = _load()
    if reason is not None:
        _warn_once(reason)
    return reason


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    log.warning("panel GEMM kernel unavailable (%s): linear layers use oneDNN, slower at decoding batch sizes",
                reason)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N/16), K, 16] (a new tensor; the weight is not kept)."""
    return torch.ops.dflash.panel_pack(weight.detach())


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 -> [M, out_features], with the weight as :func:`pack` reordered it."""
    return torch.ops.dflash.panel_linear(x, panels, out_features, bias)


def main() -> None:
    """`python -m dflash_trt.runtime.panel_gemm`: build the kernel now (make setup), say the outcome."""
    reason = unavailable()
    print(f"[setup] panel GEMM kernel: {'built and loaded' if reason is None else 'unavailable: ' + reason}")


if __name__ == "__main__":
    main()
