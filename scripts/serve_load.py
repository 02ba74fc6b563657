"""Load test of `dflash-trt serve`: N requests at concurrency C over gRPC and HTTP, streaming and not.

Starts `dflash-trt serve ENGINE` (tritonserver: gRPC, HTTP and metrics; the OpenAI front; free ports), sends every prompt ALONE
once per API to record its greedy answer, then N requests from C threads cycling over five kinds:
gRPC unary (tritonclient), OpenAI chat (not streamed and streamed, the real `openai` package),
OpenAI completions (raw prompt) and Triton's generate (httpx). It prints errors, how many answers
differ from the same prompt sent alone, p50/p99 latency and TTFT per kind, and the server's RSS
(tritonserver plus its Python backend stub, which runs the model; the front's beside it) after the
warm-up and at the end (growth in %), and its peak.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/serve_load.py ENGINE --requests 1000 --concurrency 16
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import click
import httpx
import openai

from dflash_trt.prompts import load_prompts
from dflash_trt.serving.client import generate
from serve_child import serve_child  # scripts/, beside this file

KINDS = ("grpc", "chat", "chat_stream", "completion", "generate")


class Endpoints:
    """One request of each kind; returns (text, ttft_s)."""

    def __init__(self, grpc_url: str, http_base: str, openai_base: str, max_tokens: int) -> None:
        self.grpc_url, self.http, self.base, self.max_tokens = grpc_url, http_base, openai_base, max_tokens
        self.local = threading.local()

    def _openai(self) -> openai.OpenAI:
        if not hasattr(self.local, "client"):
            self.local.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)
        return self.local.client

    def send(self, kind: str, prompt: str) -> tuple[str, float]:
        t0 = time.perf_counter()
        if kind == "grpc":
            r = generate(self.grpc_url, prompt, max_tokens=self.max_tokens, timeout_s=300)
            return r.text, r.ttft_s
        messages = [{"role": "user", "content": prompt}]
        if kind == "chat":
            r = self._openai().chat.completions.create(model="dflash", messages=messages, max_tokens=self.max_tokens,
                                                       temperature=0)
            return r.choices[0].message.content or "", time.perf_counter() - t0
        if kind == "chat_stream":
            parts, ttft = [], 0.0
            for chunk in self._openai().chat.completions.create(model="dflash", messages=messages, stream=True,
                                                                max_tokens=self.max_tokens, temperature=0):
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(chunk.choices[0].delta.content)
            return "".join(parts), ttft
        if kind == "completion":
            r = self._openai().completions.create(model="dflash", prompt=prompt, max_tokens=self.max_tokens,
                                                  temperature=0)
            return r.choices[0].text, time.perf_counter() - t0
        r = httpx.post(f"{self.http}/v2/models/dflash/generate", timeout=300,  # one chat turn, as gRPC's
                       json={"text_input": prompt, "text_input_format": "user",
                             "sampling_param_max_tokens": self.max_tokens})
        r.raise_for_status()
        return r.json()["text_output"], time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else (values[0] if values else 0.0)


@click.command(help=__doc__)
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=20, show_default=True)
def main(engine: str, num_requests: int, concurrency: int, max_tokens: int, num_prompts: int) -> None:
    prompts = [p.prompt for p in load_prompts(split="eval")][:num_prompts]
    with serve_child([engine, "--max-streams", str(max(64, concurrency))]) as served:
        ep = Endpoints(served.grpc, served.http_base, served.openai_base, max_tokens)
        alone = {(k, p): ep.send(k, p)[0] for p in prompts for k in ("grpc", "completion")}  # chat template / raw
        jobs = [(KINDS[i % len(KINDS)], prompts[(i // len(KINDS)) % len(prompts)]) for i in range(num_requests)]
        # warm-up at full concurrency (not counted): the allocator's and the runtime's steady state at
        # C rows is what a leak is measured against, not the one-row state of the answers sent alone
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda job: ep.send(*job), jobs[: max(concurrency * 2, num_requests // 20)]))
        rss_before = served.server_mib()
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
        errors: list[str] = []
        mismatches = 0
        lock = threading.Lock()
        trajectory: list[float] = []  # RSS (MiB) after every tenth of the run: a leak climbs, arenas plateau

        def one(job: tuple[str, str]) -> None:
            nonlocal mismatches
            kind, prompt = job
            t0 = time.perf_counter()
            try:
                text, ttft = ep.send(kind, prompt)
            except Exception as e:  # counted and printed: the figure is the error count
                with lock:
                    errors.append(f"{kind}: {type(e).__name__}: {e}")
                return
            want = alone[("completion" if kind == "completion" else "grpc", prompt)]
            with lock:
                results[kind].append((time.perf_counter() - t0, ttft))
                mismatches += text != want
                if sum(len(v) for v in results.values()) % max(1, num_requests // 10) == 0:
                    trajectory.append(served.server_mib())

        t_start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, jobs))
        wall = time.perf_counter() - t_start
        rss_after, rss_peak = served.server_mib(), served.server_mib("VmHWM")
    done = sum(len(v) for v in results.values())
    print(f"{num_requests} requests, concurrency {concurrency}, max_tokens {max_tokens}, {len(prompts)} prompts: "
          f"{done} answered in {wall:.1f} s ({done / wall:.1f} req/s), errors {len(errors)}, "
          f"answers != the prompt sent alone: {mismatches}")
    print("| kind | n | latency p50 (ms) | latency p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, rows in results.items():
        lat, ttft = [r[0] * 1e3 for r in rows], [r[1] * 1e3 for r in rows]
        if rows:
            print(f"| {kind} | {len(rows)} | {_pct(lat, 50):.0f} | {_pct(lat, 99):.0f} | {_pct(ttft, 50):.0f} | "
                  f"{_pct(ttft, 99):.0f} |")
    print(f"server RSS after the warm-up at C={concurrency} {rss_before:.0f} MiB, at the end {rss_after:.0f} MiB "
          f"(growth {100 * (rss_after - rss_before) / rss_before:+.1f}%)")
    print("server RSS after each tenth of the run (MiB): " + " ".join(f"{r:.0f}" for r in trajectory))
    print(f"peak RSS of tritonserver + its stub (VmHWM, summed): {rss_peak:.0f} MiB")
    for e in errors[:5]:
        print("  error:", e)
    sys.exit(1 if errors or mismatches else 0)


if __name__ == "__main__":
    main()
