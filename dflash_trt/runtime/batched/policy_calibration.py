"""Calibration of the adaptive policy's cost table (policy.py) on a batched runtime, before serving.

At each batch size, dummy greedy sequences decode a few rounds in which every candidate k takes
one step; the median of each k's step times goes into the table. A sample is kept only when the
runtime timed the step as the policy would online (BatchedRuntime.last_step_timed): no prefill
in it, no drafter catch-up, and with CUDA graphs every pass replayed. The policy's costs then
describe the steps it will run; on the first GPU run they included captures and eager catch-ups.

Rounds over all candidates, not all reps of one k after another, and the median, not the minimum:
k = 0 is re-measured online on every plain step (an average under whatever load the machine has),
so a k > 0 entry kept at its luckiest sample would look cheaper than it is next to it, and the
policy would speculate where it loses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.policy import AdaptivePolicy, FixedPolicy
from dflash_trt.runtime.batched.scheduling import SequenceRequest
from dflash_trt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dflash_trt.runtime.batched.runtime import BatchedRuntime

Progress = Callable[[int, int, float], None]  # (batch, k, seconds)


def calibration_tokens(num_candidates: int, block_size: int, reps: int = 3) -> int:
    """Tokens each dummy sequence of :func:`calibrate` may generate (its prompt comes on top):
    prefill, one untimed pass, then `reps` rounds over the candidates, each with one step more (a
    drafting step right after a plain one catches the drafter up and is taken again), and spares."""
    return 2 + (2 + reps) * (num_candidates + 1) * block_size


@torch.inference_mode()
def calibrate(runtime: "BatchedRuntime", batch_sizes: Sequence[int], prompt_len: int = 16, reps: int = 3,
              progress: Progress | None = None) -> None:
    """Measure the step cost of every candidate k at each batch size (dummy prompts, greedy) into
    the runtime's adaptive policy's cost table; online measurements refine it afterwards."""
    policy = runtime.policy
    if not isinstance(policy, AdaptivePolicy) or runtime.has_work():
        raise DFlashError("calibrate() needs an idle runtime with the adaptive policy")
    cands = list(policy.candidates or [0])
    budget = calibration_tokens(len(cands), runtime.block_size, reps)
    if prompt_len + budget > runtime.max_seq_len:
        raise DFlashError(f"max_seq_len={runtime.max_seq_len} is too small to calibrate ({prompt_len + budget} needed)")
    gen = torch.Generator().manual_seed(0)
    try:
        for n in batch_sizes:
            n = min(n, runtime.max_batch)
            seqs = [runtime.add(SequenceRequest(torch.randint(0, runtime.target.vocab_size, (prompt_len,),
                                                              generator=gen).tolist(),
                                                SamplingParams(max_tokens=budget))) for _ in range(n)]
            runtime.policy = FixedPolicy(max(cands))
            runtime.step()  # prefill
            runtime.step()  # the first decode pass also drafts the whole prompt's context: not timed
            samples: dict[int, list[float]] = {k: [] for k in cands}

            def timed_step(k: int) -> bool:
                runtime.policy = FixedPolicy(k)
                t = time.perf_counter()
                runtime.step()
                if runtime.last_step_timed:
                    samples[k].append(time.perf_counter() - t)
                return runtime.last_step_timed

            for _ in range(reps):
                for k in cands:
                    if not timed_step(k):  # a catch-up after the plain step: the next one is steady
                        timed_step(k)
            for k in cands:
                if not samples[k]:  # never timed: one untimed sample beats no entry
                    runtime.policy = FixedPolicy(k)
                    t = time.perf_counter()
                    runtime.step()
                    samples[k].append(time.perf_counter() - t)
                cost = statistics.median(samples[k])
                policy.costs.set(n, k, cost)
                if progress is not None:
                    progress(n, k, cost)
            for s in seqs:
                runtime.cancel(s)
    finally:
        runtime.policy = policy
        for s in list(runtime.rows):
            runtime.cancel(s)
        runtime.reset_prefix_cache()  # its dummy prompts' blocks: no request shares them
