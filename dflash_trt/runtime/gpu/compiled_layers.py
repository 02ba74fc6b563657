"""The target's and the drafter's decoder layers through torch.compile: few fused kernels, not ~40.

With CUDA graphs a small target's step is bound by how many kernels it runs, not by its weights:
a bf16 plain step of the embedded SmolLM2-135M is 1,261 kernels (41 a layer; transformers' RMSNorm
alone is 8: two casts, square, mean, add, rsqrt, two products) and took 3.0 ms on an H200 (~2.4 us
a kernel) where reading its 269 MB of weights takes ~0.06 ms. Inductor fuses each half of a
layer's elementwise chains (norm, rotary, residual adds, SwiGLU) into a handful of kernels around
the matrix products, which stay cuBLAS's. Measured on one H100 (scripts/step_kernels.py, bf16, one
row): 1,266 kernels a plain step -> 546, and a graphed plain step 3.10 ms -> 1.69 ms.

Regional compilation, PyTorch's recipe for a stack of identical blocks: the two halves of a layer
around its KV-cache write and attention (the target's in runtime/targets/lean_forward.py, the drafter's in
runtime/drafters/dflash.py, a DFlash2 drafter's with its convolutions in runtime/drafters/dflash2.py: attention
inputs, layer output) are compiled once, as
functions OF a layer, and all layers reuse the compiled code (their weights are the code's inputs,
not constants baked into it). ``dynamic=True`` keeps batch, length and width symbolic, so every
row bucket, draft length, mask width and prefill length shares a few compiled graphs (sizes 0 and
1 are specialised). Compilation happens on the first pass of each shape class, which the batched
runtime runs at start-up: its graph capture's passes, then two short dummy batches for the passes that
stay eager (prefills, the drafter's catch-up): never inside a request.

Numerics: fused kernels sum in another order than aten's (an RMSNorm's float32 mean, for one), so
the outputs are no longer bit for bit transformers' (casts are rounded where the eager code rounds:
``emulate_precision_casts``). `bench` reports each output's first departure from the reference loop and
the logit margin there (bench/divergence.py). Opt-in (``torch_compile``); the CPU runs it too
(Inductor's C++ backend: what the tests check), though slower to compile than it gains there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dflash_trt.checkpoints.placement import home_device
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel
from dflash_trt.runtime.targets.lean_forward import LayerFunctions, attention_inputs, layer_output
from dflash_trt.runtime.targets.adapter import TargetAdapter


def compile_unavailable(device: torch.device) -> str | None:
    """None when torch.compile can build kernels for `device` here, else what is missing."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on a GPU needs Triton (pip install the triton version your torch wheel pins)"
        return None
    if device.type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "torch.compile on a CPU needs a C++ compiler (g++ or clang++) on PATH"
        return None
    return f"torch.compile of the target's layers is not supported on {device.type}"


# emulate_precision_casts: a fused kernel rounds where the eager code casts (transformers' RMSNorm goes
# to float32 and back; bf16 products are bf16), instead of keeping float32 throughout
_OPTIONS = {"emulate_precision_casts": True}


# Each function meets a few shape classes (sizes 0/1 specialised, sizes that happen to be equal tied
# by duck sizing, views with other strides: the drafter's last layer): ~6 compiles for the drafter's
# output half over the embedded pair's start-up. Past the limit torch.compile silently runs eagerly,
# so the limit is raised where it is below what a runtime's finite, start-up-compiled set can need.
_RECOMPILE_LIMIT = 64


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True, options=_OPTIONS)


@functools.cache
def compiled_functions() -> LayerFunctions:
    """The target layer's two halves, compiled once per process and shared by every model that uses
    them (torch.compile compiles lazily, on the first call of each shape class)."""
    return LayerFunctions(_compile(attention_inputs), _compile(layer_output))


@functools.cache
def compiled_draft_functions(eager: LayerFunctions) -> LayerFunctions:
    """A drafter family's layer halves (`eager`: the model class's ``eager_layer_functions``, DFlash
    v1's in runtime/drafters/dflash.py, DFlash2's with its convolutions in runtime/drafters/dflash2.py), compiled
    as the target's, once per family and process."""
    return LayerFunctions(*(_compile(fn) for fn in eager))


def compile_target_layers(target: TargetAdapter) -> None:
    """Switch `target`'s lean pass (every adapter over this model) to the compiled layer functions,
    or say in one line why it cannot be."""
    if target.lean is None:
        raise DFlashError(f"--torch-compile: the target has no lean pass to compile ({target.lean_unsupported})")
    _require_compiler(home_device(target.model))
    object.__setattr__(target.lean, "functions", compiled_functions())


def compile_draft_layers(draft: DFlashDraftModel) -> None:
    """Switch `draft`'s layers to their family's compiled halves (cache writes and attention stay eager)."""
    _require_compiler(home_device(draft))
    draft.layer_functions = compiled_draft_functions(draft.eager_layer_functions)


def _require_compiler(device: torch.device) -> None:
    why = compile_unavailable(device)
    if why:
        raise DFlashError(f"--torch-compile: {why}; or run without --torch-compile")


@contextlib.contextmanager
def compile_errors(active: bool) -> Iterator[None]:
    """Where the start-up's first passes compile the layers: a compiler failure (Inductor, Triton, the
    C++ toolchain) becomes one line naming the way out instead of a traceback from inside torch."""
    if not active:
        yield
        return
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        yield
    except BackendCompilerFailed as e:
        first = str(e.inner_exception if getattr(e, "inner_exception", None) else e).strip().splitlines()
        raise DFlashError(f"--torch-compile: compiling the layers failed ({first[0] if first else type(e).__name__}); "
                          "run without --torch-compile") from None
