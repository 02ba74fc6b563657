"""The one way to open a runtime over a loaded pair.

    runtime = open_runtime(pair.target, pair.draft, options, pair.speculation)

- the batched runtime (runtime/batched/runtime.py) where it can run the pair, started: its start-up
  (compiled layers, captured static shapes, the compiled eager passes' warm-up) runs here,
  before any request;
- otherwise the reference loop one request at a time (runtime/reference/serial.py), K drafts every step,
  with the reason (runtime.batched.runtime.unsupported_reason) kept on it and said once in the log,
  together with what the reference loop does not apply (the adaptive policy, torch.compile,
  CUDA graphs asked for by name).

Both answer the same interface (add, step, cancel, has_work, stats, max_batch, max_seq_len,
speculation): serving's scheduler (serving/pytorch_backend.py) and the acceptance gate
(engine/gate.py) drive either unchanged. `choice` pins one: ``batched`` (a benchmark side that
measures it, train-data's batched answers: a pair it cannot run is a DFlashError with the reason)
or ``reference`` (the gate's oracle comparisons).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, unsupported_reason
from dflash_trt.runtime.reference.serial import SerialRuntime
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.speculation import SpeculationSettings

log = logging.getLogger("dflash_trt.runtime")

Choice = Literal["auto", "batched", "reference"]


def open_runtime(target: Any, draft: Any, options: RuntimeOptions = RuntimeOptions(),
                 speculation: SpeculationSettings | None = None, extras: RuntimeExtras = RuntimeExtras(),
                 choice: Choice = "auto") -> BatchedRuntime | SerialRuntime:
    """The runtime for this pair (see the module docstring), ready for its first request."""
    why = ("the reference loop was asked for" if choice == "reference"
           else unsupported_reason(target, draft))
    if why is None:
        return BatchedRuntime(target, draft, options, speculation, extras).start()
    if choice == "batched" or draft is None or extras.capture_layer_ids is not None:
        raise DFlashError(f"batched runtime: {why}; use dflash_generate (the reference loop) for this pair")
    speculation = speculation or SpeculationSettings.for_block(draft.block_size)
    lost = [name for name, asked in (
        (f"policy {speculation.policy} (K drafts every step instead)", speculation.policy != "fixed"),
        ("torch_compile (the reference loop runs uncompiled)", options.torch_compile),
        ("cuda_graphs", options.cuda_graphs is True)) if asked]
    log.log(logging.WARNING if lost else logging.INFO, "reference loop, one request at a time: %s%s", why,
            f"; not applied there: {', '.join(lost)}" if lost else "")
    return SerialRuntime(target, draft, options, speculation, why)
