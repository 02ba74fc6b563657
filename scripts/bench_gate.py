"""One acceptance-gate pass (engine/gate.measure_tau) on the reference loop and on the batched runtime, side by side.

The pair is loaded as `dflash-trt build` loads it for the gate (engine/checkpoint_io.load_checkpoint,
unpacked, in the engine dtype), the prompts are the gate's default sample (the held-out split, chat
template, truncated at calibration.max_length) and K the engine's default (block_size - 1). Prints
each pass's wall time, the ratio, tau, and whether every prompt's committed tokens, steps, drafted and
accepted counts are equal (in float32 they must be: the gate's interval and decision read them; a
float32 run where they differ exits 1).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_gate.py            # 39 x 96, one core
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_gate.py --num-prompts 8 --max-new-tokens 32 --device cuda
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target checkpoint [the embedded SmolLM2-135M]")
    ap.add_argument("--draft", help="drafter directory [the embedded drafter]")
    ap.add_argument("--num-prompts", type=int, default=39, help="gate prompts (the gate's default: 39)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (the gate's default: 96)")
    ap.add_argument("--max-draft-len", type=int, help="K [block_size - 1]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads [1]")
    ap.add_argument("--order", default="batched,reference,batched",
                    help="passes to run, in this order (a pass named twice brackets the other: a shared machine's "
                         "load changes over minutes) [batched,reference,batched]")
    args = ap.parse_args()

    import torch

    from dflash_trt.embedded import pair_dirs_or_default
    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.gate import measure_tau
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.targets.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tdir, ddir = pair_dirs_or_default(args.target, args.draft)
    target = load_checkpoint(tdir, dtype).to(args.device)
    draft = load_drafter(ddir, dtype=dtype, device=args.device)
    ids = encode_prompts(load_tokenizer(tdir), load_calibration_prompts(None, args.num_prompts, split="eval"),
                         target.config.vocab_size, 256)
    print(f"gate sample: {len(ids)} prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens) x {args.max_new_tokens}, "
          f"{args.dtype} on {args.device}, {args.threads} thread(s), K={args.max_draft_len or draft.block_size - 1}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    samples: dict[str, object] = {}
    times: dict[str, list[float]] = {}
    for name in args.order.split(","):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        samples[name] = measure_tau(target, draft, ids, args.max_new_tokens, name, progress=False,
                                    max_draft_len=args.max_draft_len, batched=name == "batched")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.setdefault(name, []).append(time.perf_counter() - t)
        s = samples[name]
        print(f"{name:>9}: {times[name][-1]:7.1f} s  tau {s.tau:.4f}  ({sum(s.steps)} steps, {sum(s.committed)} tokens), "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if {"reference", "batched"} <= set(samples):
        r, b = samples["reference"], samples["batched"]
        same = (r.committed, r.steps, r.drafted, r.accepted) == (b.committed, b.steps, b.drafted, b.accepted)
        differ = sum(rc != bc or rs != bs for rc, rs, bc, bs in zip(r.committed, r.steps, b.committed, b.steps))
        mean = {name: sum(v) / len(v) for name, v in times.items()}
        print(f"batched: {mean['reference'] / mean['batched']:.2f}x faster than the reference loop (mean of each "
              f"pass's runs); per-prompt tau "
              f"{'equal for every prompt' if same else f'DIFFERS at {differ} of {r.n} prompts'}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)")
    if {"reference", "batched"} <= set(samples) and not same and args.dtype == "float32":
        sys.exit("bench_gate: the batched runtime's per-prompt tau differs from the reference loop's in float32, "
                 "where the gate needs them equal (tests/test_gate_batched.py)")


if __name__ == "__main__":
    main()
