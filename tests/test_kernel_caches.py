"""The server bounds oneDNN's shape-keyed kernel caches unless the operator already did, and the
bound holds memory flat on the oneDNN path (the fallback where the panel GEMM cannot be built)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_trt.runtime.cpu.kernel_caches import CAPACITY_ENV, DEFAULT_CAPACITY, bound_kernel_caches

# In a fresh process (oneDNN reads the capacities once): a oneDNN linear layer called with 120 new
# token counts M, each a new primitive; prints how much malloc's live bytes grew (MiB).
_NEW_SHAPES = """
import ctypes, sys
capacity = sys.argv[1]
if capacity != "unset":
    from dflash_trt.runtime.cpu.kernel_caches import bound_kernel_caches
    bound_kernel_caches(int(capacity))
import torch
from torch import nn
from dflash_trt.runtime.cpu.packing import PackedCPULinear

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def live():
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20

layer = PackedCPULinear(nn.Linear(64, 64, bias=False), kernel="onednn")
with torch.inference_mode():
    x = torch.randn(160, 64)
    for m in range(2, 40):  # fill the cache (and the allocator's own first-use state)
        layer(x[:m])
    before = live()
    for m in range(40, 160):
        layer(x[:m])
print(live() - before)
"""


def test_bounds_both_caches_where_unset(monkeypatch):
    for name in CAPACITY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert bound_kernel_caches() == {name: str(DEFAULT_CAPACITY) for name in CAPACITY_ENV}


def test_an_operator_value_wins(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert bound_kernel_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "LRU_CACHE_CAPACITY": "64"}


def _growth_mib(capacity: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CAPACITY_ENV}
    out = subprocess.run([sys.executable, "-c", _NEW_SHAPES, capacity], env=env, check=True, capture_output=True,
                         text=True, timeout=300).stdout
    return float(out.strip().splitlines()[-1])


@pytest.mark.integration  # two child processes (oneDNN reads the capacities once per process)
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallinfo2 is glibc's")
def test_the_bound_keeps_new_shapes_from_growing_memory():
    # unbounded, each new shape keeps ~0.5 MiB (its JIT-compiled primitive, in two caches)
    assert _growth_mib("unset") > 20
    # bounded at 16 entries, the 120 new shapes evict one another: nothing grows
    assert _growth_mib("16") < 2


def test_the_served_models_stub_gets_the_bound(monkeypatch):
    """`serve` runs the model in tritonserver's Python backend stub: its environment carries the
    bound (an operator's value still wins)."""
    from dflash_trt.serving.tritonserver import TritonInstall, server_environment

    install = TritonInstall(Path("/nowhere/bin/tritonserver"), Path("/nowhere/backends"))
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    env = server_environment(install)
    assert (env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], env["LRU_CACHE_CAPACITY"]) == ("512", str(DEFAULT_CAPACITY))
