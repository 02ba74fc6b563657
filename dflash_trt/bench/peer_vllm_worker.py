"""The vLLM side of the peer benchmark: runs in the PEER's virtualenv, imports only vllm and the stdlib.

    <peer venv>/bin/python peer_vllm_worker.py JOB.json RESULT.json

Started by :mod:`dflash_trt.bench.peer_vllm` (never imported by the project: its .venv has no
vllm, and this file must not import dflash_trt). One process = one vLLM engine: the target alone
(plain decoding) or the target with the DFlash drafter (``speculative_config={"method":
"dflash", ...}``), in vLLM's default compiled mode or ``enforce_eager``. The job lists the prompts
as token ids (encoded by the project, so both sides see identical inputs) and the concurrency
levels; at concurrency C the prompts go in waves of C submitted together to ``LLM.generate``,
greedy. Each request comes back with its output ids, vLLM's own timings (``RequestOutput.metrics``,
a ``RequestStateStats``) and, for DFlash, vLLM's per-request acceptance record
(``CompletionOutput.spec_decode_metrics`` at ``per_request_spec_decode_metrics="detailed"``: the
accepted / drafted count of every verify step). Each wave also records the change of the engine's
aggregate counters (``LLM.get_metrics()``: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``). Field names as in vLLM 0.32
(vllm/outputs.py, vllm/v1/metrics/stats.py, vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/reader.py).

Progress goes to stderr as ``[vllm-peer] ...`` lines; vLLM's own log goes wherever its logger
is pointed (the driver sends it to a log file).
"""

import json
import os
import sys
import time

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def say(msg):
    print(f"[vllm-peer] {msg}", file=sys.stderr, flush=True)


def spec_counters(llm):
    """The engine's aggregate spec-decode counters now: {name: int, per_pos: [int]} (zeros if plain)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {name: 0 for name in SPEC_COUNTERS}
    out[SPEC_PER_POS] = []
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in SPEC_COUNTERS:
            out[m.name] += m.value
        elif isinstance(m, Vector) and m.name == SPEC_PER_POS:
            per_pos = out[SPEC_PER_POS]
            per_pos.extend([0] * (len(m.values) - len(per_pos)))
            for i, v in enumerate(m.values):
                per_pos[i] += v
    return out


def counters_delta(after, before):
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    b = before[SPEC_PER_POS] + [0] * (len(after[SPEC_PER_POS]) - len(before[SPEC_PER_POS]))
    d[SPEC_PER_POS] = [a - x for a, x in zip(after[SPEC_PER_POS], b)]
    return d


def request_record(out, wave_t0_s):
    """One RequestOutput as plain JSON. Times in seconds; wave_t0_s is the wave's submit time on the run clock."""
    comp = out.outputs[0]
    m = out.metrics  # RequestStateStats: arrival_time is the frontend's wall clock, *_ts the engine core's monotonic clock
    rec = {
        "request_id": out.request_id,
        "num_prompt_tokens": len(out.prompt_token_ids or []),
        "output_ids": list(comp.token_ids),
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
        "t_submit": wave_t0_s,
        "timing_source": None,
    }
    if m is not None and m.first_token_ts > 0:
        ttft = m.first_token_latency  # frontend: arrival -> first token received
        decode = max(m.last_token_ts - m.first_token_ts, 0.0)  # engine core: first -> last token
        rec.update(ttft_s=ttft, decode_s=decode, latency_s=ttft + decode,
                   queue_s=max(m.scheduled_ts - m.queued_ts, 0.0) if m.scheduled_ts else 0.0,
                   num_generation_tokens=m.num_generation_tokens, num_preemptions=m.num_preemptions,
                   timing_source="vllm RequestStateStats")
    sd = comp.spec_decode_metrics
    rec["spec_decode"] = None if sd is None else {
        "num_spec_tokens": sd.num_spec_tokens,
        "histogram": list(sd.histogram),
        "num_draft_tokens": sd.num_draft_tokens,
        "per_step_accepted": list(sd.per_step_accepted),
        "per_step_drafted": list(sd.per_step_drafted),
    }
    return rec


def context_k_norm_fix():
    """What the project's vLLM plugin did about DFlash's per-layer context k_norm in this process
    (dflash_trt/bench/peer_vllm_plugin.py, installed by scripts/setup_peer.sh): "applied",
    "not needed", "disabled", or "plugin missing"."""
    from vllm.model_executor.models import qwen3_dflash
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # idempotent; the engine's own processes load it themselves
    return getattr(qwen3_dflash.DFlashQwen3Model, "dflash_trt_context_k_norm", None) or "plugin missing"


def run_level(llm, run, SamplingParams, TokensPrompt, t0):
    """Every prompt of `run` in waves of `concurrency`; returns the run's JSON."""
    c = run["concurrency"]
    params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], stop_token_ids=run["stop_token_ids"],
                            detokenize=False)  # our side compares ids, never text
    prompts = run["prompts"]
    requests, waves = [], []
    for i in range(0, len(prompts), c):
        wave = prompts[i: i + c]
        before = spec_counters(llm)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in wave], params,
                            use_tqdm=False)
        wall = time.perf_counter() - t
        waves.append({"prompt_ids": [p["id"] for p in wave], "t_submit": t - t0, "wall_s": wall,
                      "counters": counters_delta(spec_counters(llm), before)})
        for p, o in zip(wave, outs):
            rec = request_record(o, t - t0)
            rec["id"] = p["id"]
            if rec["timing_source"] is None:  # no per-request stats: the wave's wall clock stands in
                rec.update(ttft_s=None, decode_s=None, latency_s=wall, queue_s=0.0, timing_source="wave wall clock")
            requests.append(rec)
    return {"concurrency": c, "max_tokens": run["max_tokens"], "wall_s": sum(w["wall_s"] for w in waves),
            "waves": waves, "requests": requests}


def main(job_path, result_path):
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=job["target"], dtype=job["dtype"], enforce_eager=job["enforce_eager"],
                  max_model_len=job["max_model_len"], seed=job["seed"],
                  disable_log_stats=False)  # LLM turns stats off by default; get_metrics and metrics need them
    if job.get("draft"):
        kwargs["speculative_config"] = {"method": "dflash", "model": job["draft"],
                                        "num_speculative_tokens": job["num_speculative_tokens"]}
        kwargs["per_request_spec_decode_metrics"] = "detailed"  # per-step accepted/drafted per request
    mode = "dflash" if job.get("draft") else "plain"
    k_norm_fix = context_k_norm_fix() if job.get("draft") else None
    if k_norm_fix is not None:
        say(f"per-layer context k_norm fix (dflash_trt_peer_vllm_plugin): {k_norm_fix}")
    say(f"loading {mode} engine ({'eager' if job['enforce_eager'] else 'compiled: the first time takes minutes'})")
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    say(f"{mode} engine ready in {load_s:.1f} s")

    warm = job.get("warmup")
    warmup_s = 0.0
    if warm:  # first calls pay for lazy initialisation and any remaining compilation
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in warm["prompt_token_ids"]],
                     SamplingParams(temperature=0.0, max_tokens=warm["max_tokens"], detokenize=False), use_tqdm=False)
        warmup_s = time.perf_counter() - t

    runs = []
    for run in job["runs"]:
        best = None
        for r in range(job.get("repeats", 1)):
            res = run_level(llm, run, SamplingParams, TokensPrompt, t0)
            res["repeat"] = r
            say(f"{mode} C={run['concurrency']} repeat {r + 1}: {sum(len(q['output_ids']) for q in res['requests'])} "
                f"tokens in {res['wall_s']:.2f} s")
            if best is None or res["wall_s"] < best["wall_s"]:
                best = res
        best["repeats"] = job.get("repeats", 1)
        runs.append(best)

    result = {"mode": mode, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "enforce_eager": job["enforce_eager"], "context_k_norm_fix": k_norm_fix, "load_s": load_s, "warmup_s": warmup_s,
              "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")},
              "runs": runs}
    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    say(f"{mode} done")


if __name__ == "__main__":  # vLLM's engine core is a spawned process: everything runs under this guard
    main(sys.argv[1], sys.argv[2])
