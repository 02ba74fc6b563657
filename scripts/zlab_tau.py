"""tau of a pair under our reference loop, one pass per draft method, beside z-lab dflash 0.1.0's own loop.

The same held-out prompts (the acceptance gate's sample: the eval split, chat template), the same
target weights (two copies: ours wears the runtime's hooks), the same seeds: prompt i is decoded
with seed SEED + i by every pass (ours: the request's generator; z-lab: torch.manual_seed, its
global generator). Prints tau with its 95% interval (prompts as clusters, engine/gate.TauSample),
the acceptance rate, and how many of each pass's steps are identical to z-lab's over the horizon
both decode in full blocks (at temperature 0 every pass; above it only `probabilistic` is z-lab's
method). z-lab's oracle comes from the project's cache (scripts/setup_oracles.sh).

With ``--runtime batched`` our passes run on the batched runtime as `serve` runs it (the pair as
load_pair loads it, the drafter's draft vocabulary unless ``--full-vocab``), CONCURRENCY prompts at a
time; a seeded row draws what the reference loop draws for it, so its steps differ from the
reference loop's only where batched kernels round differently. Each of our passes after the first
also prints its tau relative to the first's, paired by prompt (engine/gate.drop_interval).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/dflash-bench.lock .venv/bin/python scripts/zlab_tau.py \\
        --temperature 0 --passes zlab,match
    ... --temperature 1 --passes zlab,match,greedy,probabilistic --json out.json
    ... --temperature 1 --passes match,greedy,probabilistic --runtime batched --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target checkpoint [the embedded SmolLM2-135M]")
    ap.add_argument("--draft", help="drafter directory [the embedded drafter]")
    ap.add_argument("--num-prompts", type=int, default=39, help="held-out prompts (the gate's default: 39)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (the gate's default: 96)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt i is decoded with seed SEED + i [0]")
    ap.add_argument("--passes", default="zlab,match,greedy,probabilistic",
                    help="zlab and/or our draft methods, in this order [zlab,match,greedy,probabilistic]")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads [1]")
    ap.add_argument("--runtime", choices=["reference", "batched"], default="reference",
                    help="where our passes run: the reference loop, or the batched runtime as `serve` runs it")
    ap.add_argument("--concurrency", type=int, default=8, help="--runtime batched: prompts decoded together [8]")
    ap.add_argument("--full-vocab", action="store_true",
                    help="--runtime batched: draft over the whole vocabulary (the reference loop's), not draft_vocab.json")
    ap.add_argument("--json", dest="json_out", help="also write every pass's per-prompt figures here")
    args = ap.parse_args()

    import torch

    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.embedded import pair_dirs_or_default
    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts
    from dflash_trt.engine.gate import TauSample, drop_interval
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.runtime.targets.loading import load_tokenizer
    from dflash_trt.runtime.decoding.tokens import stop_token_ids_of
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import DRAFT_METHODS, SpeculationSettings
    from tests.oracles import zlab

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tdir, ddir = pair_dirs_or_default(args.target, args.draft)
    passes = args.passes.split(",")
    unknown = [p for p in passes if p != "zlab" and p not in DRAFT_METHODS]
    if unknown:
        ap.error(f"unknown pass {unknown[0]!r}: use zlab or one of {', '.join(DRAFT_METHODS)}")
    if args.runtime == "batched":  # as `serve` loads it (CPU-packed layers, the lean pass)
        from dflash_trt.pairs import PairSource, load_pair
        from dflash_trt.runtime_options import RuntimeOptions

        pair = load_pair(PairSource(target=tdir, draft=ddir), RuntimeOptions(dtype=args.dtype))
        target, draft = pair.target, pair.draft
    else:
        target = load_checkpoint(tdir, dtype).eval()
        draft = load_drafter(ddir, dtype)
    tokenizer = load_tokenizer(tdir)
    stop = stop_token_ids_of(tokenizer, target.config)
    ids = encode_prompts(tokenizer, load_calibration_prompts(None, args.num_prompts, split="eval"),
                         target.config.vocab_size, 256)
    B = draft.block_size
    print(f"{len(ids)} held-out prompts x {args.max_new_tokens} tokens, T={args.temperature} top_p={args.top_p}, "
          f"{args.dtype}, {args.threads} thread(s), {type(draft).__name__} B={B}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)", flush=True)
    steps: dict[str, list[list[int]]] = {}
    samples: dict[str, TauSample] = {}  # our passes'
    report: dict[str, dict] = {}
    for name in passes:
        t0, sample, per_prompt = time.perf_counter(), TauSample(), []
        if name == "zlab":
            zm = zlab()
            ztarget = load_checkpoint(tdir, dtype).eval()  # a copy without our runtime's hooks
            cls = zm.DFlash2DraftModel if type(draft).__name__ == "DFlash2DraftModel" else zm.DFlashDraftModel
            zdraft = cls.from_pretrained(ddir, dtype=dtype).eval()
            for i, p in enumerate(ids):
                torch.manual_seed(args.seed + i)
                out = zm.dflash_generate(zdraft, ztarget, torch.tensor([p]), args.max_new_tokens, stop,
                                         temperature=args.temperature, top_p=args.top_p, return_stats=True)
                acc = list(out.acceptance_lengths)
                sample.add(sum(acc), len(acc), 0, 0)
                per_prompt.append(acc)
        else:
            spec = SpeculationSettings.for_block(B, draft_method=name)
            params = [SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                     seed=args.seed + i, stop_token_ids=tuple(stop)) for i in range(len(ids))]
            if args.runtime == "batched":
                stats = batched_stats(target, draft, ids, params, spec, args.concurrency, not args.full_vocab)
            else:
                stats = [dflash_generate(draft, target, p, sp, spec).stats for p, sp in zip(ids, params)]
            for s in stats:
                sample.add(sum(s.acceptance_lengths), s.num_steps, s.total_draft_tokens,
                           s.total_accepted_draft_tokens)
                per_prompt.append(list(s.acceptance_lengths))
            samples[name] = sample
        steps[name] = per_prompt
        lo, hi = sample.interval()
        line = (f"{name:>13}: tau {sample.tau:.3f} [{lo:.3f}, {hi:.3f}] over {sum(sample.steps)} steps"
                + (f", acceptance rate {sample.accepted / sample.drafted:.3f}" if sample.drafted else "")
                + f", {time.perf_counter() - t0:.0f} s")
        report[name] = {**sample.summary(), "per_prompt_steps": per_prompt}
        if "zlab" in steps and name != "zlab":
            same, compared, whole = identical_steps(steps["zlab"], per_prompt, args.max_new_tokens, B)
            line += f"; steps identical to z-lab's: {same} of {compared} ({whole} of {len(ids)} prompts throughout)"
            report[name]["identical_to_zlab"] = {"steps": same, "compared": compared, "prompts": whole}
        first = next(iter(samples), None)
        if first is not None and name not in (first, "zlab"):  # paired by prompt
            drop, low, high = drop_interval(samples[first], sample)
            line += f"; vs {first} {1 - drop:.3f} [{1 - high:.3f}, {1 - low:.3f}]"
            report[name][f"vs_{first}"] = {"ratio": 1 - drop, "low": 1 - high, "high": 1 - low}
        print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "passes": report}, f)


def batched_stats(target, draft, ids, params, spec, concurrency: int, draft_vocab: bool) -> list:
    """Each prompt's GenerationStats from the batched runtime, `concurrency` rows at a time."""
    from dflash_trt.runtime.batched.runtime import RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.opener import open_runtime
    from dflash_trt.runtime_options import RuntimeOptions

    options = RuntimeOptions(max_batch=concurrency, max_seq_len=max(map(len, ids)) + params[0].max_tokens)
    runtime = open_runtime(target, draft, options, spec, RuntimeExtras(use_draft_vocab=draft_vocab), choice="batched")
    seqs = [runtime.add(SequenceRequest(list(p), sp)) for p, sp in zip(ids, params)]
    runtime.run()
    return [s.result.stats for s in seqs]


def identical_steps(theirs: list[list[int]], ours: list[list[int]], budget: int, B: int) -> tuple[int, int, int]:
    """(identical steps, steps compared, prompts identical throughout), over each prompt's steps
    before z-lab's block shrinks near the budget (its last B tokens) and before either's last step."""
    same = compared = whole = 0
    for z, o in zip(theirs, ours):
        n, done, full = 0, 1, []
        for a in z[:-1]:  # the first token came from the prefill
            if budget - done < B:
                break
            full.append(a)
            done += a
        n = min(len(full), len(o) - 1)
        hits = sum(a == b for a, b in zip(full[:n], o[:n]))
        same, compared, whole = same + hits, compared + n, whole + (hits == n)
    return same, compared, whole


if __name__ == "__main__":
    main()
