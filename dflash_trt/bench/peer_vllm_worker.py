"""The vLLM side of the peer benchmark: runs in the PEER's virtualenv, imports only vllm and the stdlib.

    <peer venv>/bin/python peer_vllm_worker.py ENGINE.json

Started by :mod:`dflash_trt.bench.peer_vllm` (never imported by the project: its .venv has no
vllm, and this file must not import dflash_trt). One process = one vLLM engine, kept for a whole
benchmark: the target alone (plain decoding) or the target with the DFlash drafter
(``speculative_config={"method": "dflash", ...}``), in vLLM's default compiled mode or
``enforce_eager``. After loading (and a short warm-up) it reads commands, one JSON object per line
on stdin:

- ``{"cmd": "run", "id": ..., "concurrency": C, "max_tokens": N, "stop_token_ids": [...],
  "prompts": [{"id": ..., "prompt_token_ids": [...]}, ...], "result": PATH}``: the prompts (token
  ids encoded by the project, so both sides see identical inputs) in a closed loop of C users
  through the engine (``LLMEngine.add_request`` / ``step``: a new request joins as soon as one of
  C finishes), greedy; the result JSON goes to PATH (written atomically), then ``[vllm-peer] done ID``
  on stderr;
- ``{"cmd": "quit"}``.

Each request comes back with its output ids, the client-side times of its submission, first
token and last token (seconds on this process's clock), vLLM's own ``RequestStateStats`` queue
time and, for DFlash, vLLM's per-request acceptance record (``CompletionOutput.spec_decode_metrics``
at ``per_request_spec_decode_metrics="detailed"``: accepted / drafted of every verify step). Each
run also records the change of the engine's aggregate counters (``LLM.get_metrics()``:
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``). Field names as in vLLM 0.32 (vllm/outputs.py,
vllm/v1/engine/llm_engine.py, vllm/v1/metrics/stats.py, vllm/v1/spec_decode/metrics.py,
vllm/v1/metrics/reader.py).
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


def request_record(out, times):
    """One finished RequestOutput as plain JSON; `times` holds the client-side t_submit/t_first/t_end."""
    comp = out.outputs[0]
    m = out.metrics  # RequestStateStats (engine core's monotonic clock)
    rec = {
        "request_id": out.request_id,
        "num_prompt_tokens": len(out.prompt_token_ids or []),
        "output_ids": list(comp.token_ids),
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
        **times,
        "queue_s": max(m.scheduled_ts - m.queued_ts, 0.0) if m is not None and m.scheduled_ts else 0.0,
        "num_preemptions": m.num_preemptions if m is not None else None,
    }
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


class ClosedLoop:
    """C users over one LLMEngine: each submits its next prompt when its previous one finished."""

    def __init__(self, llm, SamplingParams, TokensPrompt):
        self.engine = llm.llm_engine
        self.SamplingParams, self.TokensPrompt = SamplingParams, TokensPrompt
        self.counter = 0

    def run(self, cmd, t0):
        params = self.SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"],
                                     stop_token_ids=cmd["stop_token_ids"], detokenize=False)  # ids only
        pending = list(enumerate(cmd["prompts"]))
        live, done = {}, []

        def submit():
            i, p = pending.pop(0)
            self.counter += 1
            rid = f"r{self.counter}"
            live[rid] = (i, p, {"t_submit": time.perf_counter() - t0, "t_first": None})
            self.engine.add_request(rid, self.TokensPrompt(prompt_token_ids=p["prompt_token_ids"]), params)

        while pending and len(live) < cmd["concurrency"]:
            submit()
        while live:
            outs = self.engine.step()
            now = time.perf_counter() - t0
            for o in outs:
                entry = live.get(o.request_id)
                if entry is None:
                    continue
                i, p, times = entry
                if times["t_first"] is None and o.outputs and o.outputs[0].token_ids:
                    times["t_first"] = now
                if o.finished:
                    times["t_end"] = now
                    if times["t_first"] is None:
                        times["t_first"] = now
                    rec = request_record(o, times)
                    rec["id"] = p["id"]
                    done.append((i, rec))
                    del live[o.request_id]
                    if pending:
                        submit()
        return [rec for _, rec in sorted(done, key=lambda x: x[0])]


def main(engine_path):
    with open(engine_path, encoding="utf-8") as f:
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
    t = time.perf_counter()
    warm = job.get("warmup")
    if warm:  # first calls pay for lazy initialisation and any remaining compilation
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in warm["prompt_token_ids"]],
                     SamplingParams(temperature=0.0, max_tokens=warm["max_tokens"], detokenize=False), use_tqdm=False)
    warmup_s = time.perf_counter() - t
    engine = {"mode": mode, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "enforce_eager": job["enforce_eager"], "context_k_norm_fix": k_norm_fix, "load_s": load_s,
              "warmup_s": warmup_s, "num_speculative_tokens": job["num_speculative_tokens"] if job.get("draft") else None,
              "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}}
    loop = ClosedLoop(llm, SamplingParams, TokensPrompt)
    say(f"{mode} engine ready in {load_s:.1f} s (warm-up {warmup_s:.1f} s)")
    say("ready " + json.dumps(engine))
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        before = spec_counters(llm)
        t = time.perf_counter()
        requests = loop.run(cmd, t0)
        wall = time.perf_counter() - t
        result = {"id": cmd["id"], "concurrency": cmd["concurrency"], "wall_s": wall, "requests": requests,
                  "counters": counters_delta(spec_counters(llm), before)}
        # write-then-rename by hand: this file runs in the peer's environment and imports no dflash_trt
        # (fsutil.atomic_file is the project's one helper; the reader only waits for the final name)
        tmp = cmd["result"] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(tmp, cmd["result"])
        say(f"{mode} C={cmd['concurrency']}: {sum(len(q['output_ids']) for q in requests)} tokens in {wall:.2f} s")
        say(f"done {cmd['id']}")
    say(f"{mode} done")


if __name__ == "__main__":  # vLLM's engine core is a spawned process: everything runs under this guard
    main(sys.argv[1])
