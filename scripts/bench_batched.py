"""Concurrency sweep: batched DFlash (adaptive policy) vs batched plain decoding, side by side.

At each concurrency C the same C prompts run through BOTH paths of dflash_trt.runtime.batched:
plain decoding with C sequences per forward (the honest baseline) and DFlash with the adaptive
policy (calibrated for C before the timed run; the calibration time is reported apart). Both are
greedy, and every output is checked against single-sequence greedy decoding
(autoregressive_generate) of the same prompt.

    .venv/bin/python scripts/bench_batched.py                     # embedded pair, C = 1 4 8 16
    .venv/bin/python scripts/bench_batched.py --concurrency 1 4 --max-tokens 32 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft", help="drafter directory (default: the embedded drafter)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16], help="concurrency levels")
    ap.add_argument("--max-tokens", type=int, default=48, help="max new tokens per request")
    ap.add_argument("--category", default="math", help="eval prompt category (code, math, chat)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per path, alternating plain/DFlash; the fastest counts (shared machines are noisy)")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--max-draft-len", type=int, default=None,
                    help="K: the most drafts a step verifies (default: the drafter's block_size - 1)")
    ap.add_argument("--fixed-k", type=int, default=None,
                    help="draft exactly this many tokens every step instead of the adaptive policy (0: the DFlash "
                         "runtime decoding plainly, which prices its own overhead against the plain runtime)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="static-shape passes, replayed as CUDA graphs on a GPU (both paths: plain decoding too)")
    ap.add_argument("--no-check", action="store_true", help="skip the single-sequence greedy check")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.table import Table

    from dflash_trt.embedded import pair_dirs_or_default
    from dflash_trt.fsutil import write_json_atomic
    from dflash_trt.prompts import load_prompts
    from dflash_trt.runtime import autoregressive_generate
    from dflash_trt.runtime.batched import BatchedRuntime, batched_generate, calibration_tokens
    from dflash_trt.runtime.loading import load_pair
    from dflash_trt.runtime.policy import AdaptivePolicy, FixedPolicy, make_policy
    from dflash_trt.runtime.tokens import TextCodec
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import SpeculationSettings

    console = Console(stderr=True)
    tdir, ddir = pair_dirs_or_default(args.target, args.draft)
    pair = load_pair(tdir, ddir, dtype=args.dtype, device=args.device)
    target, draft = pair.target, pair.draft
    codec = TextCodec.of_pair(pair)
    speculation = SpeculationSettings.for_block(draft.block_size, args.max_draft_len, "adaptive")
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=codec.stop_token_ids)
    texts = [p.prompt for p in load_prompts("eval", [args.category])]
    cmax = max(args.concurrency)
    texts = (texts * (cmax // max(1, len(texts)) + 1))[:cmax]
    prompts = [codec.encode(t) for t in texts]
    # room for the requests, and for calibration's dummy sequences (16-token prompts)
    calib_len = 16 + calibration_tokens(len(make_policy(speculation).candidates or []), draft.block_size)
    max_len = max(max(map(len, prompts)) + args.max_tokens, calib_len)

    truth: list[list[int]] = []
    if not args.no_check:
        with console.status(f"single-sequence greedy reference for {cmax} prompts"):
            truth = [autoregressive_generate(target, p, params).output_ids for p in prompts]

    rows = []
    for c in args.concurrency:
        ps = prompts[:c]
        plain_rt = BatchedRuntime(target, None, max_batch=c, max_seq_len=max_len, cuda_graphs=args.cuda_graphs)
        batched_generate(None, target, ps[:1], SamplingParams(max_tokens=2), runtime=plain_rt)  # warm-up
        policy = make_policy(speculation) if args.fixed_k is None else FixedPolicy(args.fixed_k)
        rt = BatchedRuntime(target, draft, max_batch=c, max_seq_len=max_len, speculation=speculation, policy=policy,
                            cuda_graphs=args.cuda_graphs)
        t = time.perf_counter()
        if isinstance(policy, AdaptivePolicy):
            rt.calibrate([c])
        calib_s = time.perf_counter() - t
        plain_s = dflash_s = float("inf")
        for _ in range(args.repeats):  # alternate, so load from other processes hits both alike
            t = time.perf_counter()
            plain = batched_generate(None, target, ps, params, runtime=plain_rt)
            plain_s = min(plain_s, time.perf_counter() - t)
            t = time.perf_counter()
            dfl = batched_generate(draft, target, ps, params, runtime=rt)
            dflash_s = min(dflash_s, time.perf_counter() - t)

        n_plain = sum(len(r.output_ids) for r in plain)
        n_dflash = sum(len(r.output_ids) for r in dfl)
        steps = sum(r.stats.num_steps for r in dfl)
        tau = sum(sum(r.stats.acceptance_lengths) for r in dfl) / steps if steps else 0.0
        ks = rt.stats().get("recent_k_counts", {str(args.fixed_k): steps})
        row = {
            "concurrency": c,
            "plain_tokens_per_s": n_plain / plain_s,
            "dflash_tokens_per_s": n_dflash / dflash_s,
            "ratio": (n_dflash / dflash_s) / (n_plain / plain_s),
            "tau": tau,
            "output_tokens": n_dflash,
            "plain_s": plain_s,
            "dflash_s": dflash_s,
            "calibration_s": calib_s,
            "k_counts": ks,
            "step_cost_s": policy.costs.to_dict() if isinstance(policy, AdaptivePolicy) else None,
            "step_cost_vs_plain": policy.costs.ratios_dict() if isinstance(policy, AdaptivePolicy) else None,
            # the policy's last 256 steps: k, estimates and measured seconds (diagnoses a ratio < 1)
            "decisions": [d.to_dict() for d in getattr(policy, "decisions", [])],
            "plain_equals_single": [r.output_ids for r in plain] == truth[:c] if truth else None,
            "dflash_equals_single": [r.output_ids for r in dfl] == truth[:c] if truth else None,
        }
        rows.append(row)
        console.log(f"C={c}: plain {row['plain_tokens_per_s']:.1f} tok/s, dflash {row['dflash_tokens_per_s']:.1f} "
                    f"tok/s (x{row['ratio']:.2f}), tau {tau:.2f}, k chosen {ks}")

    graphs = ", CUDA graphs" if args.cuda_graphs and args.device.startswith("cuda") else ""
    table = Table(title=f"batched DFlash vs batched plain decoding ({Path(str(tdir)).name}, greedy, "
                        f"{args.max_tokens} tokens, {args.device}{graphs}, {args.threads} threads)")
    for col in ("C", "plain tok/s", "DFlash tok/s", "ratio", "tau", "k chosen", "== single"):
        table.add_column(col, justify="right")
    for r in rows:
        same = "n/a" if r["dflash_equals_single"] is None else str(r["dflash_equals_single"] and r["plain_equals_single"])
        table.add_row(str(r["concurrency"]), f"{r['plain_tokens_per_s']:.1f}", f"{r['dflash_tokens_per_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{r['tau']:.2f}", json.dumps(r["k_counts"]), same)
    Console().print(table)
    if args.out:
        write_json_atomic(Path(args.out), {"config": vars(args), "torch": torch.__version__, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
