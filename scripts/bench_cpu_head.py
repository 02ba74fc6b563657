#!/usr/bin/env python
"""Stock vs oneDNN-packed lm_head on this CPU, side by side in one run.

1. The head alone: [M, H] x [V, H]^T for M = 1 (a plain step) and M = 16 (a DFlash verify).
2. End to end on held-out prompts: plain and DFlash TPOT with each head, the two heads alternated
   prompt by prompt so both see the same machine load; every output compared with the stock
   head's plain greedy output.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_cpu_head.py --num-prompts 6 --max-new-tokens 64
"""

from __future__ import annotations

import time

import click


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


@click.command()
@click.option("--num-prompts", default=6, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
def main(num_prompts: int, max_new_tokens: int, threads: int) -> None:
    """Time the stock and the packed lm_head, alone and inside plain / DFlash decoding."""
    import torch

    from dflash_trt.cli import friendly_errors
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.generation_cli import encode_prompt, stop_ids_of
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.cpu_head import PackedCPULinear
    from dflash_trt.runtime.generate import autoregressive_generate, dflash_generate
    from dflash_trt.runtime.loading import load_pair

    @friendly_errors
    def run() -> None:
        torch.set_num_threads(threads)
        pair = load_pair(*default_pair_dirs(), pack_head=False)
        stock = pair.target.get_output_embeddings()
        heads = {"stock": stock, "packed": PackedCPULinear(stock)}
        print(f"lm_head [{stock.out_features} x {stock.in_features}] float32, {threads} threads (best of 20)")
        with torch.inference_mode():
            for m in (1, 16):
                x = torch.randn(1, m, stock.in_features)
                ms = {n: _best_ms(lambda h=h: h(x), 20) for n, h in heads.items()}
                print(f"  M={m:2d}: stock {ms['stock']:6.2f} ms  packed {ms['packed']:6.2f} ms  "
                      f"({ms['stock'] / ms['packed']:.2f}x)")

        stop = stop_ids_of(pair.tokenizer, pair.target.config)
        vocab = int(pair.target.config.vocab_size)
        kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop)
        dec = {(h, m): [0.0, 0] for h in heads for m in ("plain", "dflash")}  # decode s, decode tokens
        identical = 0
        prompts = interleave(load_prompts("eval"))[:num_prompts]
        for p in prompts:
            ids = encode_prompt(pair.tokenizer, p.prompt, False, vocab)
            outs = []
            for name, head in heads.items():
                pair.target.set_output_embeddings(head)
                for mode, r in (("plain", autoregressive_generate(pair.target, ids, **kw)),
                                ("dflash", dflash_generate(pair.draft, pair.target, ids, **kw))):
                    dec[name, mode][0] += r.stats.total_time_s - r.stats.ttft_s
                    dec[name, mode][1] += r.stats.num_output_tokens - 1
                    outs.append(r.output_ids)
            identical += all(o == outs[0] for o in outs)
        pair.target.set_output_embeddings(stock)
        tpot = {k: 1e3 * s / max(n, 1) for k, (s, n) in dec.items()}
        print(f"\n{len(prompts)} held-out prompts, max_new_tokens={max_new_tokens}, greedy, batch 1")
        for name in heads:
            print(f"  {name:6s} head: plain {tpot[name, 'plain']:6.1f} ms/token  DFlash {tpot[name, 'dflash']:6.1f} "
                  f"ms/token  speedup {tpot[name, 'plain'] / tpot[name, 'dflash']:.2f}x")
        print(f"  packed/stock TPOT: plain {tpot['packed', 'plain'] / tpot['stock', 'plain']:.3f}  "
              f"DFlash {tpot['packed', 'dflash'] / tpot['stock', 'dflash']:.3f}")
        print(f"  all four outputs identical: {identical}/{len(prompts)} prompts")

    run()


if __name__ == "__main__":
    main()
