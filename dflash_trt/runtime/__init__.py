"""The reference DFlash runtime in PyTorch: drafter, target adapter, decoding loop.

It is the oracle every faster path (batched runtime, TensorRT-LLM) is tested against, and the
instrument that measures acceptance. Runs on CPU and GPU.

The names below are imported on first use (module ``__getattr__``), not with the package: the
light modules beside them (``tokens``, the tokenizer contract) must not pull torch into a process
that only needs them (the CLI's ``--help``, ``serve``, the OpenAI front).
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
    "TargetAdapter": "dflash_trt.runtime.target.adapter",
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
