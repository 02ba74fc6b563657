"""Kernels a plain decoding step of the batched runtime launches, eager and with compiled layers.

    python scripts/step_kernels.py --device cuda --dtype bfloat16 [--target DIR]

With CUDA graphs a small target's step costs about its kernel count times a few microseconds, so
this is the figure that says what runtime/gpu/compiled_layers.py buys: one eager step at one row (after
a warm-up) under torch.profiler, kernels counted by name (on a CPU: aten operators, the launches a
GPU would make), for the lean pass as it is and through torch.compile.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_trt.embedded import pair_dirs_or_default
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime.batched.runtime import SequenceRequest
from dflash_trt.runtime.opener import open_runtime
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams


VIEWS = {f"aten::{op}" for op in ("view", "slice", "transpose", "reshape", "unsqueeze", "expand", "expand_as",
                                   "as_strided", "select", "t", "alias", "permute", "narrow",
                                   "_unsafe_view", "detach", "empty", "empty_strided", "resolve_conj", "resolve_neg")}


PROMPT = list(range(100, 132))


def step_kernels(target, device: torch.device, torch_compile: bool) -> dict:
    """One eager plain step's kernels, then a plain decode of 64 tokens with static shapes (CUDA
    graphs on a GPU): its median step time and its tokens."""
    options = RuntimeOptions(max_batch=1, max_seq_len=256, cuda_graphs=False, torch_compile=torch_compile)
    rt = open_runtime(target, None, options, choice="batched")
    rt.add(SequenceRequest(PROMPT, SamplingParams(max_tokens=64)))
    t = time.perf_counter()
    for _ in range(4):  # prefill + steps: compiles every shape class a plain step meets
        rt.step()
    warm_s = time.perf_counter() - t
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        rt.step()
    if device.type == "cuda":
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # top-level aten operators that compute (views launch nothing; compiled C++ kernels are not counted)
        names = [e.name for e in prof.events()
                 if e.name.startswith("aten::") and e.cpu_parent is None and e.name not in VIEWS]
    t = time.perf_counter()
    graphed = open_runtime(target, None, options.replace(cuda_graphs=True), choice="batched")
    startup_s = time.perf_counter() - t
    seq = graphed.add(SequenceRequest(PROMPT, SamplingParams(max_tokens=64)))
    graphed.step()  # prefill
    times = []
    while graphed.has_work():
        t = time.perf_counter()
        graphed.step()
        times.append(time.perf_counter() - t)
    return {"torch_compile": torch_compile, "kernels": len(names), "warmup_s": round(warm_s, 1),
            "top": dict(Counter(names).most_common(8)), "static_startup_s": round(startup_s, 1),
            "static_step_ms": round(1000 * sorted(times)[len(times) // 2], 3), "tokens": seq.result.output_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (no embedded target needed)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        from dflash_trt.runtime.tiny import tiny_target

        target = tiny_target("llama", vocab_size=256, seed=0).to(device=device, dtype=getattr(torch, args.dtype))
    else:
        target_dir, draft_dir = pair_dirs_or_default(args.target, None)
        options = RuntimeOptions(dtype=args.dtype, device=args.device, pack=False)
        target = load_pair(PairSource(target_dir, draft_dir), options).target
    rows = [step_kernels(target, device, c) for c in (False, True)]  # eager first: compiling is one-way
    same = rows[0].pop("tokens") == rows[1].pop("tokens")
    print(json.dumps({"device": args.device, "dtype": args.dtype, "compiled_tokens_equal_eager": same, "steps": rows}))


if __name__ == "__main__":
    main()
