"""What a DFlash step costs with drafting off, against a plain step, at each concurrency (issue 44.2).

Two batched runtimes over the same loaded pair -- plain (no drafter) and DFlash -- each hold C
steady rows of the embedded pair's held-out prompts; their steps are taken ALTERNATELY (plain, DFlash,
plain, ...) so load from other processes on a shared machine hits both alike, and each step's CPU
time (time.process_time, one torch thread: what this process computed, not what the machine's
other jobs took) is recorded. The DFlash runtime runs `--policy` (fixed:0 = drafting always off;
adaptive, or fixed:k, to price the draft steps too).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_overhead.py --concurrency 1 4 8 16 --steps 60

Prints per C: the median CPU ms of a plain step and of a DFlash step (and the k the steps ran),
their ratio, and with --profile the torch profiler's top ops of each (where the difference goes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per runtime and C")
    ap.add_argument("--policy", default="fixed:0", help="the DFlash runtime's policy: fixed:k or adaptive")
    ap.add_argument("--profile", action="store_true", help="torch profiler: top ops of each runtime's steps")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.batched import BatchedRuntime, RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.policy import FixedPolicy, make_policy
    from dflash_trt.runtime.tokens import TextCodec
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    pair = load_pair(PairSource(*default_pair_dirs()))
    codec = TextCodec.of_pair(pair)
    prompts = [codec.encode(p.prompt) for p in interleave(load_prompts("eval"))]
    budget = args.steps * 2 + 16  # never finishes inside the timed steps (k = 0: one token a step)
    cmax = max(args.concurrency)
    options = RuntimeOptions(max_batch=cmax, max_seq_len=max(map(len, prompts)) + budget + 32)
    if args.policy == "adaptive":
        policy = make_policy(pair.speculation.replace(policy="adaptive"))
    else:
        policy = FixedPolicy(int(args.policy.split(":")[1]))
    plain = BatchedRuntime(pair.target, None, options).start()
    dflash = BatchedRuntime(pair.target, pair.draft, options, pair.speculation, RuntimeExtras(policy=policy)).start()
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, threads "
          f"{torch.get_num_threads()}, DFlash policy {args.policy}")
    print(f"{'C':>3} {'plain ms':>9} {'dflash ms':>9} {'ratio':>7}  k of the DFlash steps")
    for c in args.concurrency:
        for rt in (plain, dflash):
            for i in range(c):
                rt.add(SequenceRequest(prompts[i % len(prompts)], SamplingParams(max_tokens=budget)))
            rt.step()  # prefill
            for _ in range(3):
                rt.step()
        times: dict[str, list[float]] = {"plain": [], "dflash": []}
        ks: dict[int, int] = {}

        def timed(name: str, rt: BatchedRuntime) -> None:
            t = time.process_time()
            rt.step()
            times[name].append(time.process_time() - t)
            if rt is dflash and rt.last_decision is not None:
                ks[rt.last_decision.k] = ks.get(rt.last_decision.k, 0) + 1

        prof = None
        if args.profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        for i in range(args.steps):
            order = ((plain, "plain"), (dflash, "dflash")) if i % 2 == 0 else ((dflash, "dflash"), (plain, "plain"))
            for rt, name in order:
                with torch.profiler.record_function(f"step:{name}"):
                    timed(name, rt)
        if prof is not None:
            prof.__exit__(None, None, None)
        p, d = statistics.median(times["plain"]) * 1e3, statistics.median(times["dflash"]) * 1e3
        print(f"{c:>3} {p:9.2f} {d:9.2f} {d / p:7.3f}  {dict(sorted(ks.items()))}", flush=True)
        if prof is not None:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        for rt in (plain, dflash):
            for s in list(rt.rows):
                rt.cancel(s)


if __name__ == "__main__":
    main()
