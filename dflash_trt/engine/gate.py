"""The acceptance gate: tau before vs after quantization, decided by a sequential test.

Quantization keeps DFlash lossless (the target verifies) but can silently cost acceptance: the
drafter was trained on the float target's hidden states and outputs. The gate decodes the same
prompts greedily with the unquantized and with the exported (quantized) target and compares
tau = committed tokens / steps (the bonus token included, dflash_trt.metrics' convention).

Statistics. Greedy decoding is deterministic, so the uncertainty is over prompts: tau is a ratio
estimator (sum of committed tokens over sum of steps), and prompts are the independent units.
Its standard error comes from the linearization z_i = (c_i - tau * s_i) / mean(s) (the delta
method for a ratio, clustered by prompt); the drop compares the two runs PROMPT BY PROMPT (paired:
the same prompts before and after, so prompt-to-prompt variation largely cancels). The drop's
interval is symmetric on the log scale, -ln(tau_after / tau_before), where the ratio's sampling
law is nearly symmetric, with Student's t at n - 1 degrees of freedom.

Decisions on the interval, never on a point estimate:
- fit: the pair is refused when the unquantized tau's upper bound (95%) is below `min_tau` -- a
  drafter whose tokens this target never accepts ("does not fit this target").
- drop: judged look by look (engine/gate_looks.py decodes each look, engine/sequential.py holds
  the design and its error rates): a look passes when its interval's upper end is <= `max_tau_drop`,
  fails when its lower end exceeds it, and otherwise the gate looks again with a wave of new
  prompts; undecided after its planned looks, its prompts or its time budget it is "inconclusive" and
  says which setting buys more evidence. A failed or inconclusive gate refuses the build unless
  the drop is accepted by flag.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.engine.sequential import Look, SequentialDesign, decide_look, t_quantile
from dflash_trt.errors import DFlashError

CONFIDENCE = 0.95


@dataclass
class TauSample:
    """Per-prompt greedy DFlash results: committed tokens (tau numerators) and steps, and per draft
    slot how many steps drafted / accepted it (pooled over prompts: the per-position acceptance the
    draft-length schedule is derived from, engine/acceptance_profile.py)."""

    committed: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    runtime: str = ""  # what decoded it: "batched", or "reference loop (why)" (kept in the gate's record)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def add(self, committed: int, steps: int, drafted: int, accepted: int,
            position_drafted: Sequence[int] = (), position_accepted: Sequence[int] = ()) -> None:
        self.committed.append(committed)
        self.steps.append(steps)
        self.drafted += drafted
        self.accepted += accepted
        self._add_positions(position_drafted, position_accepted)

    def _add_positions(self, position_drafted: Sequence[int], position_accepted: Sequence[int]) -> None:
        for j, (d, a) in enumerate(zip(position_drafted, position_accepted)):
            if j == len(self.position_drafted):
                self.position_drafted.append(0)
                self.position_accepted.append(0)
            self.position_drafted[j] += d
            self.position_accepted[j] += a

    @property
    def per_position_acceptance(self) -> list[float]:
        """Slot j+1 accepted / drafted, pooled over prompts (with K drafts every step: P(a >= j+1))."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def append(self, more: TauSample) -> None:
        """`more`'s prompts (a later look's wave) join this sample."""
        self.committed += more.committed
        self.steps += more.steps
        self.drafted += more.drafted
        self.accepted += more.accepted
        self._add_positions(more.position_drafted, more.position_accepted)  # the schedule reads every wave

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        return sum(self.committed) / sum(self.steps) if sum(self.steps) else 0.0

    def _linearized(self) -> list[float]:
        mean_s = sum(self.steps) / self.n
        return [(c - self.tau * s) / mean_s for c, s in zip(self.committed, self.steps)]

    def interval(self) -> tuple[float, float]:
        """95% interval of tau (ratio estimator, prompts as clusters)."""
        if self.n < 2:
            return (self.tau, self.tau) if self.n else (0.0, 0.0)
        half = t_quantile(0.5 + CONFIDENCE / 2, self.n - 1) * statistics.stdev(self._linearized()) / math.sqrt(self.n)
        return self.tau - half, self.tau + half

    def summary(self) -> dict[str, Any]:
        lo, hi = self.interval()
        return {"tau": self.tau, "tau_low": lo, "tau_high": hi, "prompts": self.n, "steps": sum(self.steps),
                "tokens": sum(self.committed),
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "per_position_acceptance": [round(p, 6) for p in self.per_position_acceptance],
                "position_drafted": list(self.position_drafted), "position_accepted": list(self.position_accepted),
                "runtime": self.runtime}


def drop_estimate(before: TauSample, after: TauSample) -> tuple[float, float, int]:
    """(relative drop 1 - tau_after / tau_before, its standard error, degrees of freedom), paired
    by prompt: the delta method on each prompt's influence on tau_after / tau_before."""
    if before.n != after.n or before.n == 0:
        raise ValueError("the gate compares the same prompts before and after")
    rb, ra = before.tau, after.tau
    q = ra / rb if rb else 0.0
    if before.n < 2 or not rb or not ra:
        return 1 - q, 0.0, max(before.n - 1, 0)
    u, v = after._linearized(), before._linearized()
    w = [q * (ui / ra - vi / rb) for ui, vi in zip(u, v)]  # influence of each prompt on tau_a / tau_b
    return 1 - q, statistics.stdev(w) / math.sqrt(before.n), before.n - 1


def _log_scale(drop: float, se: float) -> tuple[float, float]:
    """The drop as -ln(tau_after / tau_before) and its standard error (delta method): on this scale
    the ratio's sampling distribution is nearly symmetric, so the interval's two ends each hold
    their error (simulated at the gate's noise: 2.5% beyond each end of a 95% interval, against
    2.0% / 2.9% for an interval symmetric in the drop itself)."""
    q = 1 - drop
    return -math.log(q), se / q


def _from_log(x: float) -> float:
    return 1 - math.exp(min(-x, 700.0))  # an interval of 2 prompts at a tiny level may reach past float range


def drop_interval(before: TauSample, after: TauSample, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(relative drop 1 - tau_after / tau_before, low, high) at `confidence`, paired by prompt; the
    interval is symmetric on the log scale (_log_scale)."""
    drop, se, df = drop_estimate(before, after)
    x, se_x = _log_scale(drop, se)
    half = t_quantile(0.5 + confidence / 2, df) * se_x if se_x > 0 else 0.0
    return drop, _from_log(x - half), _from_log(x + half)


def measure_tau(target: Any, draft: Any, prompt_ids: list[list[int]], max_new_tokens: int, desc: str,
                progress: bool = True, max_draft_len: int | None = None, batched: bool | None = None) -> TauSample:
    """Greedy DFlash on each prompt, K = max_draft_len drafts every step (the engine's); one
    TauSample entry per prompt, in prompt order.

    The runtime is runtime/opener.open_runtime's: where it can run the pair, all prompts decode
    together on the batched runtime, each taking exactly the reference loop's steps (the fixed
    policy, K drafts a step, over the whole vocabulary as the reference loop drafts; in float32 on
    a CPU its per-prompt tau equals the reference loop's: tests/test_gate_batched.py), at a
    fraction of the time (one pass over the weights for every prompt of a step). Otherwise
    (gpt-oss, a target spread over GPUs: see runtime.batched.runtime.unsupported_reason) the reference loop
    decodes one prompt at a time. `batched` pins one (None: the opener's choice); the sample names
    the one that ran (TauSample.runtime, kept in the gate's record)."""
    import torch
    from tqdm import tqdm

    from dflash_trt.checkpoints.placement import home_device
    from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.opener import open_runtime
    from dflash_trt.runtime.batched.policy import FixedPolicy
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import SpeculationSettings

    params = SamplingParams(max_tokens=max_new_tokens)
    speculation = SpeculationSettings.for_block(draft.block_size, max_draft_len)
    # Eager passes: capturing CUDA graphs for one pass over the sample would cost more than it saves
    chunk = CPU_VERIFY_CHUNK if home_device(target).type == "cpu" else None
    options = RuntimeOptions(max_batch=len(prompt_ids), max_seq_len=max(len(p) for p in prompt_ids) + max_new_tokens,
                             cuda_graphs=False, verify_chunk=chunk)
    extras = RuntimeExtras(policy=FixedPolicy(speculation.max_draft_len), use_draft_vocab=False)
    runtime = open_runtime(target, draft, options, speculation, extras,
                           choice="auto" if batched is None else "batched" if batched else "reference")
    with tqdm(total=len(prompt_ids), desc=desc, unit="prompt", disable=not progress, file=sys.stderr) as bar, \
            torch.inference_mode():
        seqs = [runtime.add(SequenceRequest(list(p), params)) for p in prompt_ids]
        while runtime.has_work():
            for _ in runtime.step():
                bar.update(1)
    failed = next((s.error for s in seqs if s.error), None)
    if failed:
        raise DFlashError(f"acceptance gate: decoding a prompt failed ({failed})")
    sample = TauSample(runtime="batched" if isinstance(runtime, BatchedRuntime) else f"reference loop ({runtime.reason})")
    for s in (seq.result.stats for seq in seqs):
        sample.add(sum(s.acceptance_lengths), s.num_steps, s.total_draft_tokens, s.total_accepted_draft_tokens,
                   s.position_drafted, s.position_accepted)
    return sample


# On a CPU the gate verifies its K drafts in chunks of this many positions, a prompt stopping at
# its first rejection (runtime/batched/target_passes.TargetPasses.verify_chunked): a CPU step is bound by
# arithmetic, and at K = 15 one pass computes 16 positions a prompt where ~2 decide anything.
CPU_VERIFY_CHUNK = 4


def _fmt(s: TauSample) -> str:
    lo, hi = s.interval()
    return f"{s.tau:.3f} [{lo:.3f}, {hi:.3f}]"


def check_fit(before: TauSample, min_tau: float) -> dict[str, Any]:
    """Refuse a drafter that does not fit the target (unquantized tau near 1)."""
    lo, hi = before.interval()
    record = {"min_tau": min_tau, "fits": hi >= min_tau, "confident": lo >= min_tau}
    if hi < min_tau:
        raise DFlashError(
            f"this drafter does not fit this target: unquantized tau {_fmt(before)} (95% interval, "
            f"{before.n} prompts, {sum(before.steps)} steps) is below {min_tau} -- almost none of its drafts are "
            "accepted; use a drafter trained for this target (or pass --no-gate to build anyway)")
    return record


def judge(before: TauSample, after: TauSample, max_drop: float, design: SequentialDesign, look: int) -> Look:
    """Look `look` of `design` on the paired samples: pass, fail or continue against `max_drop`."""
    return judge_drop(*drop_estimate(before, after), max_drop, design, look)


def judge_drop(drop: float, se: float, df: int, max_drop: float, design: SequentialDesign, look: int) -> Look:
    """Look `look` of `design` on a drop estimate (drop_estimate's): its interval at the look's level,
    symmetric on the log scale, against `max_drop`."""
    x, se_x = _log_scale(drop, se)
    v = decide_look(design, look, x, se_x, df, _log_scale(max_drop, 0.0)[0])  # monotone: the same decision
    return dataclasses.replace(v, estimate=drop, low=_from_log(v.low), high=_from_log(v.high))


def gate_record(before: TauSample, after: TauSample, verdict: Look, max_drop: float, min_tau: float,
                design: SequentialDesign) -> dict[str, Any]:
    """The gate's record (kept in the manifest): both samples, the last look's drop and interval and
    the decision ("inconclusive" where the last look could not decide)."""
    return {"before": before.summary(), "after": after.summary(), "relative_drop": verdict.estimate,
            "relative_drop_low": verdict.low, "relative_drop_high": verdict.high,
            "confidence": verdict.confidence, "max_tau_drop": max_drop, "min_tau": min_tau,
            "decision": "inconclusive" if verdict.decision == "continue" else verdict.decision,
            "accepted_by_flag": False, "look": verdict.look, "planned_looks": design.looks,
            "alpha_each_side": design.alpha,
            "method": f"paired by prompt, ratio estimator, delta method, log scale, Student t; {design.describe()}"}


FAIL_FIX = "choose a milder recipe (recipe mlp-only, keep_layers), --quant fp8, or pass --accept-tau-drop to keep the engine"


def verdict_line(record: dict[str, Any], quant: str, extra: str = "") -> str:
    """The gate's decision and why, in one line: the look, the sample, both taus, the drop's
    interval at the look's level against the limit. `extra`: what stopped an undecided gate and
    how to buy more evidence."""
    b, a, d = record["before"], record["after"], record["decision"]
    limit = record["max_tau_drop"]
    where = {"pass": f"within the {limit:.0%} limit", "fail": f"past the {limit:.0%} limit",
             "inconclusive": f"straddles the {limit:.0%} limit"}[d]
    sample = f"{b['prompts']} prompts" + (f" x {record['tokens_per_prompt']} tokens" if record.get("tokens_per_prompt")
                                          else "")
    if record.get("seconds") is not None:
        sample += f", {record['seconds']:.0f} s"
    verb = {"pass": "passed at", "fail": "failed at", "inconclusive": "inconclusive after"}[d]
    return (f"acceptance gate {verb} look {record['look']} of {record['planned_looks']} "
            f"({sample}): tau {b['tau']:.3f} [{b['tau_low']:.3f}, {b['tau_high']:.3f}] unquantized -> {a['tau']:.3f} "
            f"[{a['tau_low']:.3f}, {a['tau_high']:.3f}] {quant}, drop {record['relative_drop']:+.1%} "
            f"[{record['relative_drop_low']:+.1%}, {record['relative_drop_high']:+.1%}] "
            f"({record['confidence']:.1%} interval, {record['alpha_each_side']:.1%} error each side over "
            f"{record['planned_looks']} look{'s' if record['planned_looks'] > 1 else ''}) {where}"
            + (f"; {extra}" if extra else "")
            + ("; kept by --accept-tau-drop" if record["accepted_by_flag"] else ""))


def settle(record: dict[str, Any], quant: str, accept_drop: bool, more: str) -> dict[str, Any]:
    """A record that did not pass: DFlashError with its one line (`more`: how to buy more evidence,
    for an inconclusive one), unless `accept_drop` keeps the engine."""
    if record["decision"] == "pass":
        return record
    if not accept_drop:
        fix = FAIL_FIX if record["decision"] == "fail" else f"{more}, or pass --accept-tau-drop to keep the engine"
        raise DFlashError(verdict_line(record, quant, fix))
    record["accepted_by_flag"] = True
    return record


def decide(before: TauSample, after: TauSample, quant: str, max_drop: float, accept_drop: bool,
           min_tau: float, prompts_left: bool = True) -> dict[str, Any]:
    """The gate's decision on one look at 95% (a design of one look): its record; DFlashError when the
    drop is not shown to be within `max_drop`, unless `accept_drop`. `prompts_left`: the prompt
    source has prompts this sample left out (what an inconclusive verdict advises)."""
    design = SequentialDesign.equal(1)
    record = gate_record(before, after, judge(before, after, max_drop, design, 1), max_drop, min_tau, design)
    more = ("decode more prompts (--gate-prompts) or longer answers (--gate-tokens) to narrow the interval"
            if prompts_left else
            "every gate prompt was decoded: decode longer answers (--gate-tokens) or give more prompts "
            "(gate.prompts in the build spec: a JSONL/JSON/TXT file) to narrow the interval")
    return settle(record, quant, accept_drop, more)


def describe(record: dict[str, Any], quant: str) -> str:
    return verdict_line(record, quant)
