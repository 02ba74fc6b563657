#!/usr/bin/env python
"""What oneDNN's shape-keyed kernel caches cost in memory: one packed linear layer on oneDNN (the
fallback where the panel GEMM cannot be built; SmolLM2-135M's MLP up-projection, 576 -> 1536,
float32) called with token counts M = 2, 3, ... (every call a
new shape, as prefills of new prompt lengths are), for each cache capacity in its own process
(oneDNN reads the capacity once). Prints the growth of malloc's live bytes and of RSS after
every 100 new shapes, and the time per call.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/kernel_cache_memory.py --capacity default --capacity 128

`default` leaves both capacities unset (1024 entries each); a number sets
ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY to it, as `dflash-trt serve` does
(dflash_trt/runtime/cpu/kernel_caches.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click


def _measure(shapes: int) -> dict:
    """In this process: the growth after every 100 new shapes (MiB) and ms per call."""
    import ctypes
    import time

    import torch
    from torch import nn

    from dflash_trt.runtime.cpu.packing import PackedCPULinear

    class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2, in its order
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def live_mib() -> float:  # bytes malloc has handed out and not had back (heap + mmapped)
        m = libc.mallinfo2()
        return (m.uordblks + m.hblkhd) / 2**20

    def rss_mib() -> float:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    torch.manual_seed(0)
    layer = PackedCPULinear(nn.Linear(576, 1536, bias=False), kernel="onednn")
    growth = []
    with torch.inference_mode():
        layer(torch.randn(1, 576))
        live0, rss0, t0 = live_mib(), rss_mib(), time.perf_counter()
        for m in range(2, shapes + 2):
            layer(torch.randn(m, 576))
            if (m - 1) % 100 == 0:
                growth.append((round(live_mib() - live0, 1), round(rss_mib() - rss0, 1)))
        ms = (time.perf_counter() - t0) * 1e3 / shapes
    return {"growth": growth, "ms_per_call": round(ms, 2)}


@click.command(help=__doc__)
@click.option("--capacity", "capacities", multiple=True, default=("default", "128"), show_default=True,
              help="Cache capacity to measure ('default': leave it unset); repeat for several.")
@click.option("--shapes", type=click.IntRange(min=100), default=1200, show_default=True,
              help="How many distinct token counts to call the layer with.")
@click.option("--child", hidden=True, is_flag=True)
def main(capacities: tuple[str, ...], shapes: int, child: bool) -> None:
    if child:
        print(json.dumps(_measure(shapes)))
        return
    for cap in capacities:
        if cap != "default" and not cap.isdigit():
            raise click.BadParameter(f"{cap!r}: give a whole number of entries or 'default'", param_hint="--capacity")
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        if cap != "default":
            env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY=cap, LRU_CACHE_CAPACITY=cap)
        out = subprocess.run([sys.executable, __file__, "--child", "--shapes", str(shapes)], env=env, check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        steps = " ".join(f"{live:.0f}/{rss:.0f}" for live, rss in r["growth"])
        print(f"capacity {cap}: malloc live / RSS growth (MiB) after each 100 new shapes: {steps}; "
              f"{r['ms_per_call']:.2f} ms per call")


if __name__ == "__main__":
    main()
