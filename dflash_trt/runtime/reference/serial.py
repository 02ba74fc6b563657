"""The reference loop behind the batched runtime's interface: one sequence, one whole request per
step, for pairs the batched runtime cannot run (sliding-window targets such as gpt-oss; see
runtime.batched.runtime.unsupported_reason). runtime/opener.open_runtime opens it in the batched
runtime's place.

A scheduler written for :class:`~dflash_trt.runtime.batched.runtime.BatchedRuntime` (``add``, ``step``,
``cancel``, ``has_work``, ``stats``) drives this unchanged: ``add`` queues, ``step`` runs the next
queued request to its end through :func:`~dflash_trt.runtime.reference.generate.dflash_generate` (its
``on_step`` callback streams and can stop it) and returns it as finished. The policy is fixed
(K drafts every step), the reference loop's schedule. A request that raises while it runs ends
alone with ``error`` set (the queued ones still run), as a failing row of the batched runtime.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from dflash_trt.errors import InvalidRequest
from dflash_trt.metrics import GenerationStats
from dflash_trt.runtime.batched.scheduling import BatchedSequence, SequenceRequest
from dflash_trt.runtime.decoding.results import GenerationResult
from dflash_trt.runtime.reference.generate import dflash_generate
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.speculation import SpeculationSettings


class SerialRuntime:
    """One request at a time through the reference loop (max_batch = 1). `reason`: why the batched
    runtime does not run this pair (runtime/opener.py opens this one in its place)."""

    max_batch = 1

    def __init__(self, target: Any, draft: Any, options: RuntimeOptions, speculation: SpeculationSettings,
                 reason: str) -> None:
        self.target, self.draft = target, draft
        self.max_seq_len = options.max_seq_len
        self.speculation = speculation.replace(policy="fixed")
        self.reason = reason
        self.waiting: deque[BatchedSequence] = deque()
        self.steps = 0

    def add(self, request: SequenceRequest) -> BatchedSequence:
        n = request.params.resolve_max_tokens()
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty (no tokens); give at least one prompt token")
        if len(request.prompt_ids) + n > self.max_seq_len:
            raise InvalidRequest(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({n}) exceeds max_seq_len="
                                 f"{self.max_seq_len}; shorten the prompt or lower max_tokens")
        seq = BatchedSequence(request, budget=n)
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting)

    @property
    def num_running(self) -> int:
        return 0  # between steps nothing runs: a step is a whole request

    def cancel(self, seq: BatchedSequence) -> None:
        """A queued sequence ends with no tokens (a running one stops through its on_step)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.result = GenerationResult(list(seq.request.prompt_ids), [], GenerationStats())

    def step(self) -> list[BatchedSequence]:
        """Run the next queued request to its end; returns it (or nothing when idle)."""
        if not self.waiting:
            return []
        seq = self.waiting.popleft()
        seq.t0 = time.perf_counter()
        try:
            seq.result = dflash_generate(self.draft, self.target, seq.request.prompt_ids, seq.request.params,
                                         self.speculation, on_step=seq.request.on_step)
        except Exception as e:  # noqa: BLE001 - this request fails, the queued ones still run
            seq.error = f"{type(e).__name__}: {e}"
            seq.result = GenerationResult(list(seq.request.prompt_ids), [], GenerationStats())
        seq.stats = seq.result.stats
        self.steps += 1
        return [seq]

    def stats(self) -> dict[str, Any]:
        return {"runtime": "reference loop (one request at a time)", "steps": self.steps, "running": 0,
                "waiting": len(self.waiting), "max_batch": 1, "speculation": self.speculation.to_dict(),
                "policy": "fixed"}
