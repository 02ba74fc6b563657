"""Our two runtimes as benchmark sides, on one loaded pair.

- :class:`ReferenceSide`: the reference loop (runtime/reference/generate.py): ``dflash_generate`` with K
  drafts every step, plain decoding with ``autoregressive_generate``. It decodes one request at a
  time: concurrent users QUEUE for its one decoding thread, first come first served (as the
  server's serial path does), so total tokens/s stays flat and tokens/s per user falls as 1/C.
- :class:`BatchedSide`: the batched runtime (runtime/batched/runtime.py), what `dflash-trt serve` runs:
  one runtime for DFlash (policy adaptive or fixed:K) and one without a drafter (plain decoding
  with C sequences per pass, the honest baseline), each kept for the whole run as a server keeps
  it, driven in a closed loop of C users: a request joins the running batch the step after the
  previous one of its user finished.

Both record, on a CPU, where each step's time goes (bench/phases.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.bench.phases import PassTimer, StepTiming, summarize_steps, timer_for
from dflash_trt.bench.prompts import BenchPrompt
from dflash_trt.bench.runners import MODES, BenchRequest, OnDone, RequestRecord, RunResult, closed_loop_threads
from dflash_trt.metrics import summarize


@dataclass
class PairInputs:
    """What both sides share: the loaded pair (dflash_trt.pairs.LoadedPair) and its prompt ids."""

    pair: Any
    _ids: dict[str, list[int]] = field(default_factory=dict)

    def encode(self, prompt: BenchPrompt) -> list[int]:
        if prompt.id not in self._ids:
            self._ids[prompt.id] = self.pair.codec.encode_messages(prompt.chat_messages)
        return self._ids[prompt.id]

    def ids_of(self, prompt_id: str) -> list[int]:
        """The ids of a prompt encoded before (every prompt a run decoded)."""
        return self._ids[prompt_id]

    def params(self, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> Any:
        from dflash_trt.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                              stop_token_ids=self.pair.codec.stop_token_ids)

    def warm_ids(self) -> list[int]:
        return self.encode(BenchPrompt("warmup", "warmup", (("user", "Hello"),)))


def record_of(side: str, mode: str, concurrency: int, req: BenchRequest, stats: Any, output_ids: list[int],
              t_submit: float, t_first: float, t_end: float, queue_s: float,
              progress: list[tuple[float, int]] | None = None) -> RequestRecord:
    s = stats
    return RequestRecord(
        mode=mode, concurrency=concurrency, prompt_id=req.prompt.id, category=req.prompt.category,
        num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=len(output_ids), num_steps=s.num_steps,
        total_draft_tokens=s.total_draft_tokens, total_accepted_draft_tokens=s.total_accepted_draft_tokens,
        tau=s.tau, acceptance_rate=s.acceptance_rate, t_submit=t_submit, t_first=t_first, t_end=t_end,
        queue_s=queue_s, finish_reason=s.finish_reason, acceptance_lengths=list(s.acceptance_lengths),
        position_drafted=list(s.position_drafted), position_accepted=list(s.position_accepted),
        output_ids=list(output_ids), side=side, progress=progress,
    )


# ------------------------------------------------------------------------------------------------
# the reference loop: one request at a time
# ------------------------------------------------------------------------------------------------
@dataclass
class ReferenceSide:
    inputs: PairInputs
    speculation: Any  # SpeculationSettings (policy fixed: K drafts every step)
    name: str = "reference"
    label: str = "ours, reference loop"
    parallel: bool = False
    modes: tuple[str, ...] = MODES
    t0: float = field(default_factory=time.perf_counter)
    _decoder: ThreadPoolExecutor | None = None  # the one decoding thread, FIFO
    _timer: PassTimer | None = None

    def _decode(self, mode: str, ids: list[int], params: Any, on_step: Any = None) -> Any:
        from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate

        pair = self.inputs.pair
        if mode == "dflash":
            return dflash_generate(pair.draft, pair.target, ids, params, self.speculation.replace(policy="fixed"),
                                   on_step=on_step)
        return autoregressive_generate(pair.target, ids, params, on_step=on_step)

    def warmup(self) -> None:
        """First calls pay for lazy initialisation in torch/transformers: keep them out of the figures."""
        for mode in self.modes:
            self._decode(mode, self.inputs.warm_ids(), self.inputs.params(8))

    def _one(self, mode: str, concurrency: int, req: BenchRequest, t_submit: float,
             steps: list[StepTiming]) -> RequestRecord:
        ids = self.inputs.encode(req.prompt)
        params = self.inputs.params(req.max_new_tokens, req.temperature, req.seed)
        timer = self._timer

        def decode() -> tuple[float, Any, dict[str, float] | None]:
            prefill: dict[str, float] = {}

            def first_tokens(_new: list[int]) -> None:
                if timer is not None and not prefill:
                    prefill.update(timer.take()[0] or {"target": 0.0})

            if timer is not None:
                timer.take()
            t = time.perf_counter()
            result = self._decode(mode, ids, params, on_step=first_tokens)
            return t, result, (timer.take()[0] if timer is not None else None)

        assert self._decoder is not None
        t_start, result, decode_passes = self._decoder.submit(decode).result()
        s = result.stats
        if decode_passes is not None and s.num_steps:  # the request's mean decoding step
            n = s.num_steps
            k = round(s.total_draft_tokens / n) if mode == "dflash" else 0
            steps.append(StepTiming(rows=1, k=k, step_s=(s.total_time_s - s.ttft_s) / n,
                                    passes={p: v / n for p, v in decode_passes.items()}, weight=n))
        base = t_start - self.t0  # GenerationStats times count from the decode's start
        return record_of(self.name, mode, concurrency, req, s, result.output_ids, t_submit - self.t0,
                         base + s.ttft_s, base + s.total_time_s, t_start - t_submit)

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> RunResult:
        pair = self.inputs.pair
        steps: list[StepTiming] = []
        timer = timer_for(pair.target, pair.draft if mode == "dflash" else None)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-decode") as self._decoder:
            with timer if timer is not None else _null():
                self._timer = timer
                records = closed_loop_threads(requests, concurrency,
                                              lambda r, t: self._one(mode, concurrency, r, t, steps), on_done)
        self._timer = None
        info: dict[str, Any] = {"speculation": self.speculation.replace(policy="fixed").to_dict()}
        if timer is not None:
            info["step_timing"] = summarize_steps(steps)
        return RunResult(records, info)

    def close(self) -> None:
        pass


def graphs_in_run(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the static passes did during one timed run: replays, shapes captured (must be 0: all
    were captured at start-up), misses (a shape never captured, run eagerly: must be 0), eager
    passes by reason (prefills, drafter catch-ups, sampled steps), host syncs and uploads."""
    eager = {k: v - before["eager_passes"].get(k, 0) for k, v in after["eager_passes"].items()
             if v - before["eager_passes"].get(k, 0)}
    return {key: after[key] - before[key] for key in ("replays", "captured", "misses", "syncs", "uploads")} | {
        "eager_passes": eager}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------------------------------------
# the batched runtime: C sequences per pass, closed loop
# ------------------------------------------------------------------------------------------------
@dataclass
class BatchedSide:
    """`policy`: "adaptive" (what serve runs), "schedule" (the speculation's draft-length schedule)
    or "fixed:k" (k drafts every step; k = 0: the DFlash runtime decoding plainly, which prices its
    own overhead against the plain runtime). `baseline`: the side whose plain decoding this side's
    DFlash is measured against, where this side runs no plain mode (several policies side by side)."""

    inputs: PairInputs
    speculation: Any  # SpeculationSettings: B, K
    policy: str
    # RuntimeOptions of both modes' runtimes (the same graphs and compiled layers: a fair ratio)
    options: Any
    calibrate_levels: Sequence[int] = ()  # adaptive: measure every candidate's step cost at these C first
    name: str = "batched"
    label: str = "ours, batched runtime"
    parallel: bool = True
    modes: tuple[str, ...] = MODES
    baseline: str | None = None
    calibration_s: float = 0.0
    _runtimes: dict[str, Any] = field(default_factory=dict)
    _startup: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode -> build time, captured graphs

    def runtime(self, mode: str) -> Any:
        """The mode's runtime, built once: with static shapes every shape it will time is captured
        here, before the warm-up and the timed runs."""
        if mode not in self._runtimes:
            t = time.perf_counter()
            from dflash_trt.runtime.batched.runtime import RuntimeExtras
            from dflash_trt.runtime.opener import open_runtime
            from dflash_trt.runtime.batched.policy import FixedPolicy, make_policy

            pair = self.inputs.pair
            if mode == "plain":
                rt = open_runtime(pair.target, None, self.options, choice="batched")
            else:
                kind, _, k = self.policy.partition(":")
                spec = self.speculation.replace(policy=kind)
                policy = FixedPolicy(int(k)) if kind == "fixed" else make_policy(spec)
                rt = open_runtime(pair.target, pair.draft, self.options, spec, RuntimeExtras(policy=policy),
                                  choice="batched")
            self._runtimes[mode] = rt
            self._startup[mode] = {"build_s": round(time.perf_counter() - t, 3), "graphs": rt.graph_stats()}
        return self._runtimes[mode]

    def warmup(self) -> None:
        from dflash_trt.runtime.batched.runtime import SequenceRequest
        from dflash_trt.runtime.batched.policy import AdaptivePolicy

        for mode in self.modes:
            rt = self.runtime(mode)
            rt.add(SequenceRequest(self.inputs.warm_ids(), self.inputs.params(8)))
            rt.run()
            if isinstance(getattr(rt, "policy", None), AdaptivePolicy):
                # a few steps drafting 15 on a greeting (no costs known yet): acceptance so low on
                # them that the first timed run at C = 1 decoded 48 steps plainly before drafting
                rt.policy.reset_acceptance()
        if self.policy == "adaptive" and self.calibrate_levels and "dflash" in self.modes:
            from dflash_trt.runtime.batched.policy_calibration import calibrate

            t = time.perf_counter()
            calibrate(self.runtime("dflash"), sorted(set(self.calibrate_levels)))
            self.calibration_s = time.perf_counter() - t

    def run(self, mode: str, requests: Sequence[BenchRequest], concurrency: int, on_done: OnDone) -> RunResult:
        from dflash_trt.runtime.batched.runtime import SequenceRequest

        rt = self.runtime(mode)
        # every run starts with an empty prefix cache: its figures never depend on the runs before it
        # (the same prompts come back at every level and repeat); within a run requests hit as a server's
        rt.reset_prefix_cache()
        pair = self.inputs.pair
        timer = timer_for(pair.target, pair.draft if mode == "dflash" else None,
                          rt.draft_head if mode == "dflash" else None)
        t0 = time.perf_counter()
        pending = deque(requests)
        # id(seq) -> (i, req, t_submit, progress: [(run clock, tokens so far)], [0] the first token)
        live: dict[int, tuple[int, BenchRequest, float, list[tuple[float, int]]]] = {}
        done: list[tuple[int, RequestRecord]] = []
        steps: list[StepTiming] = []

        def submit() -> None:
            i = len(requests) - len(pending)
            req = pending.popleft()
            progress: list[tuple[float, int]] = []  # after each step that committed tokens

            def on_step(new: list[int]) -> None:
                if new:
                    progress.append((time.perf_counter() - t0, (progress[-1][1] if progress else 0) + len(new)))

            seq = rt.add(SequenceRequest(self.inputs.encode(req.prompt),
                                         self.inputs.params(req.max_new_tokens, req.temperature, req.seed), on_step))
            live[id(seq)] = (i, req, time.perf_counter() - t0, progress)

        graphs_before = rt.graph_stats()
        decode_steps: list[float] = []  # steps without a prefill: the decoding pace the run saw
        prefill_s = 0.0  # steps that admitted a request: its prefill (and the drafter's first pass)
        reasons: dict[str, int] = {}  # the policy's choices at the full batch, by draft length and reason
        with timer if timer is not None else _null():
            while pending and len(live) < concurrency:
                submit()
            while live:
                rows, prefill = rt.num_running, bool(rt.waiting)
                if timer is not None:
                    timer.take()
                t = time.perf_counter()
                finished = rt.step()
                now = time.perf_counter()
                if rows and not prefill:
                    decode_steps.append(now - t)
                else:
                    prefill_s += now - t
                if mode == "dflash" and rows and rt.last_decision is not None:
                    d = rt.last_decision  # why each step drafted what it did, counted per run
                    why = f"k={d.k} ({d.reason})" if d.batch >= concurrency or d.k == 0 else f"k={d.k} at fewer rows"
                    reasons[why] = reasons.get(why, 0) + 1
                if timer is not None:
                    decision = rt.last_decision
                    passes, _ = timer.take()
                    steps.append(StepTiming(rows=rows, k=decision.k if decision is not None and rows else 0,
                                            step_s=now - t, passes=passes, prefill=prefill or not rows))
                for seq in finished:
                    i, req, t_submit, progress = live.pop(id(seq))
                    res = seq.result
                    t_end = now - t0
                    rec = record_of(self.name, mode, concurrency, req, res.stats, res.output_ids, t_submit,
                                    progress[0][0] if progress else t_end, t_end, seq.queue_s, progress)
                    done.append((i, rec))
                    on_done(rec)
                while pending and len(live) < concurrency:
                    submit()
        records = [rec for _, rec in sorted(done, key=lambda x: x[0])]
        info: dict[str, Any] = {"policy": self.policy, "startup": self._startup.get(mode),
                                "decode_step_s": summarize(decode_steps) if decode_steps else None,
                                "prefill_steps_s": round(prefill_s, 4)}
        if graphs_before is not None:
            info["graphs_in_run"] = graphs_in_run(graphs_before, rt.graph_stats())
        if rt.prefix_cache is not None:
            info["prefix_cache"] = rt.prefix_cache.stats()
        if steps:
            info["step_timing"] = summarize_steps(steps)
        if mode == "dflash":
            info["policy_choices"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
            info["runtime_stats"] = rt.stats()
            info["speculation"] = rt.speculation.to_dict() if rt.speculation is not None else None
            if self.calibration_s:
                info["calibration_s"] = self.calibration_s
        return RunResult(records, info)

    def close(self) -> None:
        self._runtimes.clear()
