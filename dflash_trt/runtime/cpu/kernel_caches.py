"""Bounds on oneDNN's shape-keyed kernel caches, for long-running processes (the server).

Where the panel GEMM cannot be built (runtime/cpu/panel_gemm.py: no compiler, or
``DFLASH_TRT_PANEL_GEMM=0``), the packed CPU linear layers (packing.py) run oneDNN inner
products, and oneDNN builds one primitive (JIT-compiled kernels) per problem shape: per weight and
per token count M of the call. M differs for nearly every prefill (the prompt lengths of the
newcomers) and every draft catch-up, so a server meets new shapes for as long as it gets new
prompts. Two LRU caches keep what was built, 1024 entries each by default: oneDNN's primitive
cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's, PyTorch's oneDNN layer
(``LRU_CACHE_CAPACITY``); together they keep ~0.5 MiB per new shape, whatever the layer's size,
up to ~600 MiB (``scripts/kernel_cache_memory.py``). That was the server's RSS growth under load
before the panel GEMM (docs/serving.md, "Under load": malloc's live bytes grew with it): not a
leak, but a cache sized for far more shapes than one step uses (~20-30) or a few seconds of
traffic revisits. The panel GEMM keeps no per-shape state; the bound is for the oneDNN path.

Both capacities are read once, when oneDNN is first used (packing the weights at load): set
them before a model is loaded; later calls change nothing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Rebuilding an evicted primitive costs ~0.3-0.5 ms; at 128 entries the embedded pair's load run
# rebuilds ~1,600 over 200 s (< 1 s of work), and the caches hold at most ~75 MiB.
DEFAULT_CAPACITY = 128
CAPACITY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = DEFAULT_CAPACITY, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set both caches' capacity to `capacity` where the environment does not already set it (an
    operator's value wins); returns the values in effect. `env`: the environment of a process to
    start (`serve` bounds tritonserver's, whose Python backend stub runs the model), else this
    process's, before any model is loaded."""
    env = os.environ if env is None else env
    for name in CAPACITY_ENV:
        env.setdefault(name, str(capacity))
    return {name: env[name] for name in CAPACITY_ENV}
