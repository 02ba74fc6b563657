"""What a decoding returns, the same from every runtime: the result of a sequence, its stop, the
streaming callback's type.

The reference loop (runtime/reference/generate.py), the batched runtime (runtime/batched/) and the
serial runtime end a sequence through :func:`finish`, so a request's ``finish_reason`` and counts
mean the same whichever runtime ran it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_trt.metrics import GenerationStats

# Called with the tokens each step commits (for streaming); return True to stop early.
StepCallback = Callable[[list[int]], "bool | None"]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # generated ids only (a stop token, if hit, is the last one)
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def sequence(self) -> torch.Tensor:
        """[1, prompt + generated], the shape HF generate() returns."""
        return torch.tensor([self.prompt_ids + self.output_ids], dtype=torch.long)


def truncate_at_stop(tokens: list[int], stop: set[int] | frozenset[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token, and whether there was one."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1], True
    return tokens, False


def finish(prompt: list[int], out: list[int], stop: set[int] | frozenset[int], stats: GenerationStats,
           t0: float) -> GenerationResult:
    """The result of a sequence that ended (shared by every runtime): finish_reason from its tokens."""
    stats.num_output_tokens = len(out)
    stats.finish_reason = "stop" if out and out[-1] in stop else "length"
    stats.total_time_s = time.perf_counter() - t0
    return GenerationResult(prompt, out, stats)
