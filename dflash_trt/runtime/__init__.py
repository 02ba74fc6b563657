"""The reference DFlash runtime in PyTorch: drafter, target adapter, decoding loop.

It is the oracle every faster path (batched runtime, TensorRT-LLM) is tested against, and the
instrument that measures acceptance. Runs on CPU and GPU.
"""

from dflash_trt.runtime.batched import BatchedRuntime, RuntimeExtras, SequenceRequest, batched_generate
from dflash_trt.runtime.draft_model import DFlashDraftModel, build_target_layer_ids
from dflash_trt.runtime.generate import GenerationResult, autoregressive_generate, dflash_generate
from dflash_trt.runtime.opener import open_runtime
from dflash_trt.runtime.target import TargetAdapter

__all__ = [
    "BatchedRuntime",
    "RuntimeExtras",
    "SequenceRequest",
    "batched_generate",
    "DFlashDraftModel",
    "GenerationResult",
    "TargetAdapter",
    "autoregressive_generate",
    "build_target_layer_ids",
    "dflash_generate",
    "open_runtime",
]
