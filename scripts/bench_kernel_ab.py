#!/usr/bin/env python
"""A panel-kernel change, A/B in whole decoding steps: another version of kernels/panel_gemm.cpp
(a git revision's, or a file) against this checkout's, over ONE packed copy of the weights.

Why one copy: on a VM, two packed copies of the same weights running the same code can differ by
10-25% in speed from where they landed in memory alone (stop 51), so a sweep that packs a copy per
kernel ranks the kernels by allocation order. Both kernels read the same panel layout, so here
each step calls one or the other on the same tensors: the baseline is built under its own op
namespace, and ``panel_gemm.linear`` is switched step by step. Two runtimes decode the same rows,
their steps alternating (CPU time, so other processes' load hits both alike). The outputs of the
two kernels must be the same bits; the runtimes' tokens are compared at the end.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_kernel_ab.py --baseline-rev HEAD~1 --concurrency 1 4 8 16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 .venv/bin/python \\
        scripts/bench_kernel_ab.py --baseline-rev HEAD~1 --draft-len 3 --concurrency 1 4
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click
import torch

SOURCE = Path("dflash_trt/runtime/cpu/kernels/panel_gemm.cpp")


@click.command()
@click.option("--baseline-rev", help="The baseline kernel: this git revision's panel_gemm.cpp.")
@click.option("--baseline-source", type=click.Path(exists=True, dir_okay=False), help="... or this file.")
@click.option("--concurrency", "-c", type=int, multiple=True, default=(1, 4, 8, 16), show_default=True)
@click.option("--draft-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="k drafts every step (0: plain decoding, no drafter).")
@click.option("--steps", type=click.IntRange(min=4), default=30, show_default=True)
def main(baseline_rev: str | None, baseline_source: str | None, concurrency: tuple[int, ...], draft_len: int,
         steps: int) -> None:
    if bool(baseline_rev) == bool(baseline_source):
        raise click.UsageError("give one of --baseline-rev or --baseline-source")
    torch.set_num_threads(1)
    from torch.utils.cpp_extension import load

    from dflash_trt.runtime.cpu import panel_gemm

    variant = panel_gemm.default_variant()
    build = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    src = build / "baseline.cpp"
    src.write_text(Path(baseline_source).read_text() if baseline_source else
                   subprocess.run(["git", "show", f"{baseline_rev}:{SOURCE}"], check=True, capture_output=True,
                                  text=True).stdout)
    load("dflash_ab", [str(src)], extra_cflags=panel_gemm.build_flags(variant, "dflash_ab"), build_directory=str(build),
         is_python_module=False)
    current = panel_gemm.linear
    use_baseline = [False]

    def linear(x, panels, out_features, bias, variant=None):  # noqa: ANN001, ANN202 - the same signature
        if use_baseline[0]:
            return torch.ops.dflash_ab.panel_linear(x, panels, out_features, bias)
        return current(x, panels, out_features, bias, variant)

    panel_gemm.linear = linear  # every PackedCPULinear calls the kernel through this name

    from dflash_trt.embedded import default_pair_dirs
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.batched.policy import FixedPolicy
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    pair = load_pair(PairSource(*default_pair_dirs()))
    codec = TextCodec.of_pair(pair)
    prompts = [codec.encode(p.prompt) for p in interleave(load_prompts("eval"))]
    budget = steps * (draft_len + 1) + 8
    click.echo(f"panel kernel {variant}: baseline {baseline_rev or baseline_source} against the checkout; "
               f"{'plain' if not draft_len else f'k = {draft_len}'} steps, CPU ms (median of {steps})")
    for c in concurrency:
        options = RuntimeOptions(max_batch=c, max_seq_len=max(map(len, prompts)) + budget + 8)
        runtimes = {}
        for baseline in (False, True):
            use_baseline[0] = baseline
            rt = (BatchedRuntime(pair.target, pair.draft, options, pair.speculation,
                                 RuntimeExtras(policy=FixedPolicy(draft_len))) if draft_len
                  else BatchedRuntime(pair.target, None, options)).start()
            for i in range(c):
                rt.add(SequenceRequest(prompts[i % len(prompts)], SamplingParams(max_tokens=budget)))
            for _ in range(3):  # prefill, then the drafter's pass over the prompts
                rt.step()
            runtimes[baseline] = rt
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(steps):
            for baseline in ((False, True) if i % 2 else (True, False)):
                use_baseline[0] = baseline
                t = time.process_time()
                runtimes[baseline].step()
                times[baseline].append(time.process_time() - t)
        same = [s.out for s in runtimes[False].rows] == [s.out for s in runtimes[True].rows]
        old, new = statistics.median(times[True]), statistics.median(times[False])
        click.echo(f"C={c:<3} baseline {old * 1e3:7.2f}  checkout {new * 1e3:7.2f}  ratio {new / old:.3f}  "
                   f"tokens {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
