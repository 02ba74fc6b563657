"""The DFlash runtime in PyTorch: the reference loop, the batched runtime, and what they are made of.

The reference loop is the oracle every faster path (the batched runtime, TensorRT-LLM) is tested
against, and the instrument that measures acceptance. Runs on CPU and GPU. Its rooms, each
standing only on the ones listed after it (tests/test_import_graph.py keeps the imports a DAG):

- ``opener.py``: :func:`open_runtime`, the one way to open a runtime over a loaded pair;
- ``reference/``: the reference loop (one sequence), and the same loop behind the batched interface;
- ``batched/``: continuous batching: the step, scheduling, slot and prefix caches, the proposers,
  the verification passes, the draft-length policy;
- ``gpu/``: torch.compile'd layers, CUDA graphs captured at start-up, host-device traffic;
- ``tiny.py``: tiny random targets and drafters (tests, ``generate --tiny``);
- ``drafters/``: the drafter families (DFlash, DFlash2), their formats, loading and checks;
- ``targets/``: the target loaded and adapted, its lean forward pass and grouped attention;
- ``cpu/``: the CPU's packed linear layers and the panel GEMM kernel;
- ``decoding/``: the tokenizer contract, sampling, rejection sampling, a decoding's result.

The names below are imported on first use (module ``__getattr__``), not with the package: the
light modules under it (``decoding/tokens.py``, the tokenizer contract) must not pull torch into a
process that only needs them (the CLI's ``--help``, ``serve``, the OpenAI front).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchedRuntime": "dflash_trt.runtime.batched.runtime",
    "RuntimeExtras": "dflash_trt.runtime.batched.runtime",
    "SequenceRequest": "dflash_trt.runtime.batched.scheduling",
    "batched_generate": "dflash_trt.runtime.batched.runtime",
    "DFlashDraftModel": "dflash_trt.runtime.drafters.dflash",
    "build_target_layer_ids": "dflash_trt.runtime.drafters.dflash",
    "GenerationResult": "dflash_trt.runtime.decoding.results",
    "autoregressive_generate": "dflash_trt.runtime.reference.generate",
    "dflash_generate": "dflash_trt.runtime.reference.generate",
    "open_runtime": "dflash_trt.runtime.opener",
    "TargetAdapter": "dflash_trt.runtime.targets.adapter",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
