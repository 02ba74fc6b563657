#!/usr/bin/env python
"""The CPU linear kernels side by side in one run: stock, oneDNN (plain and blocked layout), panels
(the ISA build serving the runtime, and every other one this CPU runs).

1. The target's 210 decoder linear layers alone (every layer once, like one forward pass, weights
   streamed from memory): [M, in] x [out, in]^T for M = 1 (a plain step) up to 64 (16 rows verifying
   3 drafts each), with four kernels: stock (MKL, which re-packs the weight on every call), oneDNN
   on the weight in its plain layout (``to_mkldnn()``), oneDNN on the weight reordered into its
   blocked layout, and the panel GEMM (runtime/cpu/panel_gemm.py). runtime/cpu/packing.py packs for the
   panels, or for blocked oneDNN (MKL's GEMV at M = 1) where the panel kernel cannot be built.
2. End to end on held-out prompts: plain and DFlash TPOT with the stock path and each packed
   kernel, alternated prompt by prompt so all see the same machine load; every output compared
   with the stock path's plain greedy output.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_cpu_packing.py --num-prompts 6 --max-new-tokens 64
"""

from __future__ import annotations

import time

import click


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


@click.command()
@click.option("--num-prompts", default=6, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--max-draft-len", type=click.IntRange(min=1),
              help="K: the most drafts a DFlash step verifies [the drafter's block_size - 1].")
def main(num_prompts: int, max_new_tokens: int, threads: int, max_draft_len: int | None) -> None:
    """Time stock and packed linear layers, alone and inside plain / DFlash decoding."""
    import torch

    from dflash_trt.cli_helpers import friendly_errors
    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.cpu import panel_gemm
    from dflash_trt.runtime.cpu.packing import KERNELS, PackedCPULinear, pack_weight, packed_bytes, repack, set_packed
    from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import SpeculationSettings

    @friendly_errors
    def run() -> None:
        torch.set_num_threads(threads)
        pair = load_pair(PairSource(*default_pair_dirs()))
        models = (pair.target, pair.draft)
        layers = [m for m in pair.target.modules() if isinstance(m, PackedCPULinear)]
        if not layers:
            raise SystemExit("nothing was packed (needs float32 on CPU and a PyTorch with oneDNN)")
        mb = sum(packed_bytes(m) for m in models) / 2**20
        print(f"{len(layers)} target linear layers packed (+{mb:.0f} MB for the packed copies, drafter's included), "
              f"float32, {threads} threads; each kernel timed in 3 rounds, the median round")

        decoder = [m for m in pair.target.model.layers.modules() if isinstance(m, PackedCPULinear)]
        plain_layout = [m.weight.detach().to_mkldnn() for m in decoder]
        blocked = [pack_weight(m.weight) for m in decoder]
        pointwise = torch.ops.mkldnn._linear_pointwise
        kernels = {
            "stock": lambda i, x: torch.nn.functional.linear(x, decoder[i].weight),
            "oneDNN plain": lambda i, x: pointwise(x, plain_layout[i], None, "none", [], ""),
            "oneDNN blocked": lambda i, x: pointwise(x, blocked[i], None, "none", [], ""),
        }
        if panel_gemm.unavailable() is None:
            panels = [panel_gemm.pack(m.weight) for m in decoder]
            # every ISA build this CPU runs (an AVX-512 machine also times the AVX2 one)
            for v in panel_gemm.variants():
                if panel_gemm.unavailable(v) is None:
                    name = "panels" if v == panel_gemm.default_variant() else f"panels {v}"
                    kernels[name] = lambda i, x, v=v: panel_gemm.linear(x, panels[i], decoder[i].out_features, None, v)
        else:
            print(f"  (panel GEMM unavailable: {panel_gemm.unavailable()})")

        with torch.inference_mode():
            for m in (1, 2, 4, 8, 16, 20, 24, 32, 64):  # 20-32: a C=16 verify with some rows drafting
                xs = {d: torch.randn(m, d) for d in {layer.in_features for layer in decoder}}
                # rounds over the kernels, median per kernel: a shared machine's drift hits all three
                times: dict[str, list[float]] = {k: [] for k in kernels}
                for _ in range(3):
                    for name, kernel in kernels.items():
                        times[name].append(_median_ms(lambda: [kernel(i, xs[lay.in_features])
                                                               for i, lay in enumerate(decoder)], 5))
                print(f"  M={m:2d}: " + "  ".join(f"{name} {sorted(t)[1]:6.1f} ms" for name, t in times.items()))

        codec = TextCodec.of_pair(pair)
        params = SamplingParams(max_tokens=max_new_tokens, stop_token_ids=codec.stop_token_ids)
        speculation = SpeculationSettings.for_block(pair.draft.block_size, max_draft_len)
        # the stock path, then each packed kernel this machine has (re-packing both models in turn)
        kernels_here = [k for k in KERNELS if k != "panels" or panel_gemm.unavailable() is None]
        paths = ("stock", *kernels_here)
        dec = {(h, m): [0.0, 0] for h in paths for m in ("plain", "dflash")}  # decode s, decode tokens
        identical = 0
        prompts = interleave(load_prompts("eval"))[:num_prompts]
        for p in prompts:
            ids = codec.encode(p.prompt)
            outs = []
            for name in paths:
                for model in models:
                    set_packed(model, name != "stock")
                    if name != "stock":
                        repack(model, name)
                for mode, r in (("plain", autoregressive_generate(pair.target, ids, params)),
                                ("dflash", dflash_generate(pair.draft, pair.target, ids, params, speculation))):
                    dec[name, mode][0] += r.stats.total_time_s - r.stats.ttft_s
                    dec[name, mode][1] += r.stats.num_output_tokens - 1
                    outs.append(r.output_ids)
            identical += all(o == outs[0] for o in outs)
        tpot = {k: 1e3 * s / max(n, 1) for k, (s, n) in dec.items()}
        print(f"\n{len(prompts)} held-out prompts, max_new_tokens={max_new_tokens}, greedy, batch 1, "
              f"DFlash block {pair.draft.block_size}, K {speculation.max_draft_len}")
        for name in paths:
            print(f"  {name:6s}: plain {tpot[name, 'plain']:6.1f} ms/token  DFlash {tpot[name, 'dflash']:6.1f} "
                  f"ms/token  speedup {tpot[name, 'plain'] / tpot[name, 'dflash']:.2f}x  "
                  f"(TPOT vs stock: plain {tpot[name, 'plain'] / tpot['stock', 'plain']:.3f}, "
                  f"DFlash {tpot[name, 'dflash'] / tpot['stock', 'dflash']:.3f})")
        print(f"  all {2 * len(paths)} outputs identical: {identical}/{len(prompts)} prompts")

    run()


if __name__ == "__main__":
    main()
