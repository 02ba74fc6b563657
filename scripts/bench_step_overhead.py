"""What a DFlash step costs against a plain step, at each concurrency (issue 44.2), in CPU time.

Batched runtimes over the same loaded pair each hold C steady rows of the embedded pair's held-out
prompts: plain (no drafter), DFlash under `--policy` (fixed:0 = drafting always off: the cost of a
k = 0 step), and with `--draft-lengths` a DFlash runtime that cycles through those k, one a step
(the cost of a drafting step and the tokens it commits per row). Their steps are taken in rotation,
so load from other processes on a shared machine hits all alike, and each step's CPU time
(time.process_time, one torch thread: what this process computed, not what the machine's other jobs
took) is recorded.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_overhead.py --concurrency 1 4 8 16 --steps 40
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_overhead.py --draft-lengths 1 3 7 --steps 30

Prints per C: the median CPU ms of a plain step and of each DFlash step kind, their ratio to the
plain step, the tokens a step commits per row (tau of those steps) and tau / cost (what DFlash /
plain would read if every step were that one); with --profile the torch profiler's top ops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Lane:
    """One runtime in the rotation; `ks`: the k it cycles through (None: its own policy decides)."""

    name: str
    runtime: Any
    ks: list[int] | None = None
    i: int = 0
    times: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # k -> CPU s
    tokens: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # k -> tokens per row

    def step(self) -> None:
        from dflash_trt.runtime.batched.policy import FixedPolicy

        rt = self.runtime
        if self.ks:
            rt.policy = FixedPolicy(self.ks[self.i % len(self.ks)])
            self.i += 1
        before = sum(len(s.out) for s in rt.rows)
        t = time.process_time()
        rt.step()
        dt = time.process_time() - t
        k = rt.last_decision.k if rt.last_decision is not None else 0
        if self.ks is None or rt.last_step_timed:  # a cycling lane: not a step that caught the drafter up
            self.times[k].append(dt)
            self.tokens[k].append((sum(len(s.out) for s in rt.rows) - before) / max(len(rt.rows), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per runtime and C")
    ap.add_argument("--policy", default="fixed:0", help="the DFlash runtime's policy: fixed:k, adaptive, none (no such lane)")
    ap.add_argument("--draft-lengths", type=int, nargs="*", default=[],
                    help="a DFlash runtime that cycles through these k, one a step")
    ap.add_argument("--max-tokens", type=int, default=None, help="each row's budget [enough for every step]")
    ap.add_argument("--profile", action="store_true", help="torch profiler: top ops of all the steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch-compile", action="store_true", help="every runtime's layers through torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.batched.policy import FixedPolicy, make_policy
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    pair = load_pair(PairSource(*default_pair_dirs()))
    codec = TextCodec.of_pair(pair)
    prompts = [codec.encode(p.prompt) for p in interleave(load_prompts("eval"))]
    budget = args.max_tokens or args.steps * (max(args.draft_lengths, default=0) + 1) + 32
    options = RuntimeOptions(max_batch=max(args.concurrency), max_seq_len=max(map(len, prompts)) + budget + 32,
                             torch_compile=args.torch_compile)

    def dflash(policy: Any) -> BatchedRuntime:
        return BatchedRuntime(pair.target, pair.draft, options, pair.speculation, RuntimeExtras(policy=policy)).start()

    lanes = [Lane("plain", BatchedRuntime(pair.target, None, options).start())]
    if args.policy != "none":
        policy = (make_policy(pair.speculation.replace(policy="adaptive")) if args.policy == "adaptive"
                  else FixedPolicy(int(args.policy.split(":")[1])))
        lanes.append(Lane(f"dflash {args.policy}", dflash(policy)))
    if args.draft_lengths:
        lanes.append(Lane("dflash k", dflash(FixedPolicy(args.draft_lengths[0])), ks=list(args.draft_lengths)))
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, threads "
          f"{torch.get_num_threads()}; CPU ms per step (median), tokens per row per step")
    for c in args.concurrency:
        for lane in lanes:
            lane.times.clear()
            lane.tokens.clear()
            rt = lane.runtime
            for i in range(c):
                rt.add(SequenceRequest(prompts[i % len(prompts)], SamplingParams(max_tokens=budget)))
            for _ in range(3):  # prefill, then the drafter's pass over the prompts
                rt.step()
        prof = None
        if args.profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        for i in range(args.steps):
            for j in range(len(lanes)):
                lane = lanes[(i + j) % len(lanes)]
                with torch.profiler.record_function(f"step:{lane.name}"):
                    lane.step()
        if prof is not None:
            prof.__exit__(None, None, None)
        plain = statistics.median(lanes[0].times[0])
        print(f"C={c}: plain {plain * 1e3:.2f} ms")
        for lane in lanes[1:]:
            for k in sorted(lane.times):
                t = statistics.median(lane.times[k])
                tau = statistics.mean(lane.tokens[k])
                print(f"    {lane.name:<16} k={k:<2} {t * 1e3:8.2f} ms = {t / plain:5.3f} plain steps, "
                      f"tau {tau:4.2f}, tau/cost {tau / (t / plain):5.3f}  ({len(lane.times[k])} steps)", flush=True)
        if prof is not None:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        for lane in lanes:
            for s in list(lane.runtime.rows):
                lane.runtime.cancel(s)


if __name__ == "__main__":
    main()
