#!/usr/bin/env python
"""Benchmark the embedded pair on the held-out (eval) prompts: DFlash vs plain decoding.

Both use the same runtime, greedy, batch 1, on this CPU, interleaved prompt by prompt so both see
the same machine load: `--runtime reference` (default) is the reference loop
(dflash_trt.runtime.generate: DFlash verifies K drafts every step, K = block - 1 unless
--max-draft-len); `--runtime batched` is
the serving runtime at one sequence (dflash_trt.runtime.batched: adaptive draft length, calibrated
once at start, learning acceptance across the prompts; its tau counts the steps it decoded plain
too; plain = the same runtime without a drafter). Prints mean tau, per-category tau, per-position
acceptance, decode speedup (plain TPOT / DFlash TPOT, token-weighted over all prompts) and whether
every output is identical to plain greedy decoding.

    .venv/bin/python scripts/bench_embedded.py                    # all eval prompts
    .venv/bin/python scripts/bench_embedded.py --num-prompts 6    # a quick subset (all categories)
    .venv/bin/python scripts/bench_embedded.py --runtime batched  # the serving runtime, adaptive k
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click


@click.command()
@click.option("--target", "target_dir", type=click.Path(file_okay=False), help="Target dir [embedded SmolLM2].")
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False), help="Drafter dir [embedded drafter].")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Only the first N eval prompts (round-robin over categories).")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--max-draft-len", type=click.IntRange(min=1),
              help="K: the most drafts a step verifies [default: the drafter's block_size - 1].")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1), help="torch threads.")
@click.option("--dtype", default="float32", show_default=True,
              help="Dtype of both decoders. bfloat16/auto run faster on AVX512-BF16 CPUs but are not bit-exact: "
                   "a 16-token verify pass rounds differently from a 1-token step, so outputs can drift from plain greedy.")
@click.option("--pack/--no-pack", default=True, show_default=True,
              help="oneDNN-packed linear layers for float32 on CPU (dflash_trt/runtime/cpu_packing.py).")
@click.option("--runtime", default="reference", show_default=True, type=click.Choice(["reference", "batched"]),
              help="reference: the reference loop (K drafts every step); batched: the serving runtime at batch 1 "
                   "(adaptive k <= K).")
@click.option("--split", default="eval", show_default=True, type=click.Choice(["eval", "train"]))
@click.option("--tau-only", is_flag=True,
              help="Decode with DFlash only: acceptance figures (deterministic at temperature 0) in half the time, "
                   "no speedup and no identity check. For comparing drafters.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Also write every figure as JSON here.")
def main(target_dir, draft_dir, num_prompts, max_new_tokens, max_draft_len, threads, dtype, pack, runtime, split,
         tau_only, json_out) -> None:
    """DFlash vs plain greedy decoding of the embedded pair on held-out prompts."""
    import torch

    from dflash_trt.cli_helpers import friendly_errors
    from dflash_trt.embedded import pair_dirs_or_default
    from dflash_trt.metrics import GenerationStats
    from dflash_trt.prompts import CATEGORIES, interleave, load_prompts
    from dflash_trt.runtime.cpu_packing import num_packed
    from dflash_trt.runtime.loading import load_pair
    from dflash_trt.runtime.tokens import TextCodec
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import SpeculationSettings

    @friendly_errors
    def run() -> None:
        torch.set_num_threads(threads)
        t_dir, d_dir = pair_dirs_or_default(target_dir, draft_dir)
        pair = load_pair(t_dir, d_dir, dtype, pack=pack)
        prompts = interleave(load_prompts(split))[:num_prompts]
        codec = TextCodec.of_pair(pair)
        params = SamplingParams(max_tokens=max_new_tokens, stop_token_ids=codec.stop_token_ids)
        speculation = SpeculationSettings.for_block(pair.draft.block_size, max_draft_len,
                                                    "adaptive" if runtime == "batched" else "fixed")
        decode_dflash, decode_plain = _decoders(runtime, pair, speculation)
        # warm-up: first calls pay for lazy initialisation in torch and transformers
        warm = codec.encode("Hello")
        decode_dflash(warm, params.replace(max_tokens=8))
        if not tau_only:
            decode_plain(warm, params.replace(max_tokens=8))

        total = GenerationStats()
        per_cat = {c: GenerationStats() for c in CATEGORIES}
        dec = {"dflash": [0.0, 0], "plain": [0.0, 0]}  # decode seconds, decode tokens
        rows = []
        in_vocab = out_tokens = 0  # output tokens inside the drafter's draft vocabulary (if it ships one)
        subset = set(pair.draft.draft_vocab.tolist()) if pair.draft.draft_vocab is not None else None
        t0 = time.time()
        for n, p in enumerate(prompts, 1):
            ids = codec.encode(p.prompt)
            d = decode_dflash(ids, params)
            a = None if tau_only else decode_plain(ids, params)
            same = None if a is None else d.output_ids == a.output_ids
            if subset is not None:
                out_ids = (d if a is None else a).output_ids  # greedy: DFlash's output stands in for plain's with --tau-only
                in_vocab += sum(t in subset for t in out_ids)
                out_tokens += len(out_ids)
            for acc in (total, per_cat[p.category]):
                _merge(acc, d.stats)
            for name, r in (("dflash", d), ("plain", a)):
                if r is not None:
                    dec[name][0] += r.stats.total_time_s - r.stats.ttft_s
                    dec[name][1] += r.stats.num_output_tokens - 1
            rows.append({"id": p.id, "category": p.category, "tokens": d.stats.num_output_tokens,
                         "tau": round(d.stats.tau, 3), "dflash_tpot_ms": round(d.stats.tpot_s * 1e3, 1),
                         "plain_tpot_ms": None if a is None else round(a.stats.tpot_s * 1e3, 1),
                         "identical": same})
            print(f"[{n}/{len(prompts)}] {p.id:14s} tokens={d.stats.num_output_tokens:3d} tau={d.stats.tau:5.2f} "
                  f"tpot dflash={d.stats.tpot_s * 1e3:6.1f}ms "
                  + ("(tau only)" if a is None else f"plain={a.stats.tpot_s * 1e3:6.1f}ms identical={same}"),
                  file=sys.stderr, flush=True)
        tpot = {k: (s / t if t else 0.0) for k, (s, t) in dec.items()}
        result = {
            "prompts": len(prompts), "split": split, "runtime": runtime, "max_new_tokens": max_new_tokens, "threads": threads,
            "dtype": str(pair.target.dtype).removeprefix("torch."),
            "block_size": pair.draft.block_size, "max_draft_len": speculation.max_draft_len,
            "packed_linears": num_packed(pair.target) + num_packed(pair.draft),
            "tau": round(total.tau, 3),
            "tau_per_category": {c: round(s.tau, 3) for c, s in per_cat.items() if s.num_steps},
            "acceptance_rate": round(total.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 3) for x in total.per_position_acceptance],
            "dflash_tpot_ms": round(tpot["dflash"] * 1e3, 2), "plain_tpot_ms": round(tpot["plain"] * 1e3, 2),
            "speedup": round(tpot["plain"] / tpot["dflash"], 3) if tpot["dflash"] and not tau_only else None,
            "identical_all": None if tau_only else all(r["identical"] for r in rows),
            "draft_vocab": None if subset is None else {
                "size": len(subset), "used_by": "batched runtime" if runtime == "batched" else "nothing (reference loop)",
                "coverage_of_outputs": round(in_vocab / max(out_tokens, 1), 4)},
            "wall_s": round(time.time() - t0, 1),
            "rows": rows,
        }
        print(f"\nDFlash vs plain greedy, {runtime} runtime, {len(prompts)} {split} prompts, "
              f"max_new_tokens={max_new_tokens}, batch 1, {threads} CPU threads, {result['dtype']}, block {result['block_size']}, "
              f"K {result['max_draft_len']}, "
              f"{result['packed_linears']} packed linear layers")
        print(f"  mean tau            {result['tau']:.2f}   (acceptance_rate {result['acceptance_rate']:.3f})")
        print("  tau per category    " + "  ".join(f"{c}={t:.2f}" for c, t in result["tau_per_category"].items()))
        print("  per-position accept " + " ".join(f"{x:.2f}" for x in result["per_position_acceptance"]))
        if not tau_only:
            print(f"  TPOT                dflash={result['dflash_tpot_ms']:.1f} ms  plain={result['plain_tpot_ms']:.1f} ms"
                  f"  -> decode speedup {result['speedup']:.2f}x")
        if subset is not None:
            print(f"  draft vocabulary    {len(subset)} ids ({result['draft_vocab']['used_by']}); they cover "
                  f"{result['draft_vocab']['coverage_of_outputs']:.1%} of the plain outputs' tokens")
        if not tau_only:
            print(f"  identical to plain greedy on every prompt: {result['identical_all']}")
        if json_out:
            from dflash_trt.fsutil import write_json_atomic

            write_json_atomic(Path(json_out), result)

    run()


def _decoders(runtime: str, pair, speculation):
    """(dflash(ids, params), plain(ids, params)) -> GenerationResult, on the chosen runtime."""
    from dflash_trt.runtime.generate import autoregressive_generate, dflash_generate

    if runtime == "reference":
        return (lambda ids, params: dflash_generate(pair.draft, pair.target, ids, params, speculation),
                lambda ids, params: autoregressive_generate(pair.target, ids, params))
    from dflash_trt.runtime.batched import BatchedRuntime, batched_generate

    max_len = 4096
    rt = BatchedRuntime(pair.target, pair.draft, max_batch=1, max_seq_len=max_len, speculation=speculation)
    rt.calibrate([1])
    plain_rt = BatchedRuntime(pair.target, None, max_batch=1, max_seq_len=max_len)

    def run(draft, rt_):
        def decode(ids, params):
            return batched_generate(draft, pair.target, [ids], params, runtime=rt_)[0]
        return decode

    return run(pair.draft, rt), run(None, plain_rt)


def _merge(acc, s) -> None:
    acc.acceptance_lengths.extend(s.acceptance_lengths)
    acc.total_draft_tokens += s.total_draft_tokens
    acc.total_accepted_draft_tokens += s.total_accepted_draft_tokens
    for j in range(len(s.position_drafted)):
        if j >= len(acc.position_drafted):
            acc.position_drafted.append(0)
            acc.position_accepted.append(0)
        acc.position_drafted[j] += s.position_drafted[j]
        acc.position_accepted[j] += s.position_accepted[j]


if __name__ == "__main__":
    main()
