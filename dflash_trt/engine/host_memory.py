"""Host memory of a build process: hand freed tensors back to the OS, not to malloc's heap.

A build holds one model at a time (engine/builder.py), so its peak host RSS is one model plus
what the allocator still keeps of the previous one and of the gate's activations. With glibc's
default, that second part is not small: malloc serves requests >= M_MMAP_THRESHOLD with mmap (given
back on free), but the threshold is dynamic: every mmapped block freed raises it to that block's
size, up to 32 MiB. After the checkpoint's first large tensors are freed, every later tensor
under 32 MiB (most weights and activations of a model this side of ~1B parameters) comes from the
heap, where a freed block stays resident until the heap's top is free and malloc_trim runs.
Measured by `scripts/bench_build_memory.py` (peak RSS over the checkpoint, above the interpreter
baseline): 240M fp8 1.69 -> 1.30 with the threshold fixed at 1 MiB (4 MiB: 1.36); the 128 KiB kept
here is glibc's own initial value; with the lm_head and drafter fixes (runtime/targets/adapter.py,
runtime/drafters/dflash.py) it brings the 60M builds under 1.5 too (1.43 fp8, 1.49 nvfp4; 1.48 /
1.52 at 1 MiB). Its cost is page faults on fresh activations: a process loading the 240M model and
decoding 3 prompts x 32 tokens in bfloat16 took 1.018x the wall time of the same without it (median
of 5 interleaved runs each, one core; 1 MiB: 0.99x) for a peak of 1026 instead of 1058 MiB. A GPU
build decodes on the GPUs.

glibc only (mallopt / malloc_trim via ctypes); elsewhere both calls do nothing. An operator's
MALLOC_MMAP_THRESHOLD_ in the environment wins (it also turns the dynamic threshold off).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
BUILD_MMAP_THRESHOLD = 128 << 10  # bytes: glibc's own initial value, kept from rising


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_large_frees_to_os(threshold: int = BUILD_MMAP_THRESHOLD) -> bool:
    """Serve every allocation >= `threshold` bytes by mmap, so that freeing it returns the memory
    at once, and stop glibc raising the threshold as blocks are freed. Returns whether it is in
    effect (False off glibc). Call before the first model loads."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    libc = _libc()
    try:
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)
    except AttributeError:  # a libc without mallopt (musl)
        return False


def release_freed_memory() -> None:
    """Collect what the caller just dropped (a model) before the next one loads: Python objects,
    the heap's free top (malloc_trim), and a GPU's cached blocks."""
    gc.collect()
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
