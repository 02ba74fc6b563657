#!/usr/bin/env python
"""Bounded load run against the Triton-protocol server over loopback (a benchmark, not a test).

    scripts/bench_serve.py ENGINE_OR_REPO -n 64 -c 8 --max-tokens 32      # starts a server in-process
    scripts/bench_serve.py --url 127.0.0.1:8001 -n 64 -c 8                 # an already running server

N requests at concurrency C through the real tritonclient streaming API. Reports errors (must
be 0), p50/p99 latency and TTFT, and splits each request's latency into the time it waited for
the runtime (queue_time_ms, from the model), decoding (decode_time_ms, from the model) and the
rest: server overhead (gRPC, (de)serialization, the Python-backend shim, thread hand-offs).
The pytorch backend decodes up to the engine's max_batch_size requests together (the batched
runtime); beyond that, and for pairs it cannot batch, requests queue and queue_time_ms grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Explain speculative decoding in one sentence.", "Write a haiku about GPUs.",
    "What is 12 times 7?", "Name three primary colors.", "Hello! How are you today?",
    "Translate 'good morning' to French.", "Give one tip for writing clean code.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_load(url: str, n: int, concurrency: int, max_tokens: int, stream: bool, model: str) -> dict:
    from dflash_trt.serving.client import generate

    def one(i: int):
        t0 = time.perf_counter()
        try:
            r = generate(url, PROMPTS[i % len(PROMPTS)], model=model, stream=stream, max_tokens=max_tokens,
                         timeout_s=600, request_id=str(i))
            return r, None, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - counted and reported
            return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0

    t_start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t_start
    ok = [r for r, err, _ in results if r is not None]
    errors = [err for _, err, _ in results if err is not None]
    lat = [r.latency_s * 1e3 for r in ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    queue_ms = [r.stats.get("queue_time_ms", 0.0) for r in ok]
    decode_ms = [r.stats.get("decode_time_ms", 0.0) for r in ok]
    overhead = [l - q - d for l, q, d in zip(lat, queue_ms, decode_ms)]
    tokens = sum(int(r.stats.get("num_output_tokens", 0)) for r in ok)
    taus = [r.stats.get("acceptance_length", 0.0) for r in ok]
    return {
        "requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "stream": stream,
        "errors": len(errors), "first_errors": errors[:3],
        "latency_ms": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "mean": statistics.fmean(lat) if lat else 0},
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "breakdown_ms_mean": {
            "queue": statistics.fmean(queue_ms) if ok else 0, "decode": statistics.fmean(decode_ms) if ok else 0,
            "server_overhead": statistics.fmean(overhead) if ok else 0,
        },
        "server_overhead_ms": {"p50": percentile(overhead, 0.5), "p99": percentile(overhead, 0.99)},
        "overhead_share_of_latency": (sum(overhead) / sum(lat)) if lat else 0.0,
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "tau_mean": statistics.fmean(taus) if taus else 0.0,
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="engine directory or model repository (starts a server in-process)")
    ap.add_argument("--url", help="address of a running server (host:port) instead of SOURCE")
    ap.add_argument("-n", "--requests", type=int, default=32, help="total requests [32]")
    ap.add_argument("-c", "--concurrency", type=int, default=8, help="requests in flight at once [8]")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request [32]")
    ap.add_argument("--no-stream", action="store_true", help="one response per request instead of streaming")
    ap.add_argument("--model", default="dflash", help="model name [dflash]")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured [2]")
    ap.add_argument("--json", dest="json_out", help="also write the report to this file")
    args = ap.parse_args()
    if bool(args.source) == bool(args.url):
        ap.error("give SOURCE (engine or repository) or --url, not both")
    if args.requests < 1 or args.concurrency < 1:
        ap.error("--requests and --concurrency must be >= 1")

    server = None
    tmp = None
    try:
        if args.source:
            from dflash_trt.engine.manifest import MANIFEST_NAME
            from dflash_trt.serving.repository import generate_repository
            from dflash_trt.serving.server import TritonGrpcServer

            repo = Path(args.source)
            if (repo / MANIFEST_NAME).is_file():
                tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
                repo = generate_repository(repo, Path(tmp.name) / "repo")
            server = TritonGrpcServer(repo, grpc_port=0, metrics_port=None, models=[args.model]).start()
            url = f"127.0.0.1:{server.grpc_port}"
        else:
            url = args.url
        if args.warmup:
            run_load(url, args.warmup, 1, args.max_tokens, not args.no_stream, args.model)
        report = run_load(url, args.requests, args.concurrency, args.max_tokens, not args.no_stream, args.model)
    finally:
        if server is not None:
            server.stop(grace=5)
        if tmp is not None:
            tmp.cleanup()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
