"""The acceptance gate's looks: which prompts each one decodes, with which model loaded, within
the budget.

Look 1 decodes the first `gate.num_prompts` prompts of the gate's source for `gate.max_new_tokens`
tokens each with the unquantized target (before quantizing it) and with the exported one. While
a look cannot decide (engine/sequential.py), the next one decodes a WAVE of as many prompts the
gate has not decoded yet, with both models, and the drop is judged on every prompt so far: new
prompts are new independent units (the interval narrows as 1/sqrt(prompts), and the looks have
the independent increments the group-sequential boundaries assume), each look costs what look 1
cost, and its caches are look 1's size. Longer answers are not an alternative: past ~100 tokens
most of the embedded pair's answers have ended (28 of the 39 held-out ones within 192 tokens)
and what follows the end of a turn is text no server decodes.

Order of passes. A build holds one model at a time (host memory: the target in the engine dtype
is what a build costs), so the sides alternate as A B | B A | A B ...: each look first decodes
with the model already loaded, then frees it and loads the other from its checkpoint (the source
for the unquantized side, the exported target/ for the quantized one): one load a look.

Budget. The looks are planned (gate.max_looks waves, fewer when the source runs out of prompts,
and fewer when the budget cannot pay for them): look 1's unquantized pass, the first thing the gate
decodes and before any drop is known, times half a look, so the design plans only the looks
`gate.budget_s` affords. A CPU that can afford one look gets one look at the 95% level, not the
first of four at 98.2% and a budget that stops it there. Before each later look its time is
predicted from the longest look so far, and a look that would end past the budget is not
started. A gate stopped undecided is inconclusive and says which setting buys more evidence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_trt.engine.gate import TauSample, gate_record, judge, measure_tau, settle, verdict_line
from dflash_trt.engine.sequential import Look, SequentialDesign

Side = Literal["before", "after"]
LABELS = {"before": "unquantized", "after": "quantized"}


@dataclass(frozen=True)
class GatePlan:
    """The gate's settings, as the build spec gives them (engine/spec.GateSpec)."""

    wave: int  # prompts a look decodes (gate.num_prompts)
    tokens: int  # tokens per prompt (gate.max_new_tokens)
    looks: int  # planned looks at most (gate.max_looks)
    budget_s: float  # the gate's decoding may not run past this many seconds (gate.budget_s)
    limit: float  # gate.max_tau_drop
    max_draft_len: int | None = None

    def design(self, pool: int, affordable: int | None = None) -> SequentialDesign:
        """The looks a source of `pool` prompts allows (and at most `affordable` of them: what the
        budget pays for), at their information fractions (each look's prompts over the planned
        total): fixed before any drop is known, from sizes and the unquantized pass's time alone."""
        looks = self.looks if affordable is None else max(1, min(self.looks, affordable))
        total = min(looks * self.wave, pool)
        counts = [min((k + 1) * self.wave, total) for k in range(math.ceil(total / self.wave))]
        return SequentialDesign(tuple(c / total for c in counts))


@dataclass
class LookRecord:
    look: Look
    prompts: int  # decoded so far, on each side
    seconds: float  # the look's own decoding and model load

    def to_dict(self) -> dict[str, Any]:
        v = self.look
        return {"look": v.look, "prompts": self.prompts, "relative_drop": v.estimate, "low": v.low, "high": v.high,
                "confidence": v.confidence, "decision": v.decision, "seconds": round(self.seconds, 3)}


@dataclass
class ModelSlot:
    """The one target model the gate holds, and which side it is. `load(side)` reads a side's model;
    `release()` hands freed memory back to the OS (engine/host_memory.py)."""

    side: Side
    model: Any
    load: Callable[[Side], Any]
    release: Callable[[], None] = lambda: None

    def swap(self) -> float:
        """Free this model, load the other side's; the seconds it took."""
        t = time.perf_counter()
        self.model = None
        self.release()
        self.side = "after" if self.side == "before" else "before"
        self.model = self.load(self.side)
        return time.perf_counter() - t


@dataclass
class GateLooks:
    """The gate's samples, look by look. `pool`: the prompts its planned looks can take (token ids),
    in the order they take them; `source_prompts`: how many its source has (default: the pool)."""

    plan: GatePlan
    pool: list[list[int]]
    draft: Any
    progress: bool = True
    say: Callable[[str], None] = lambda msg: None
    source_prompts: int = 0
    design: SequentialDesign = field(init=False)
    wanted: int = field(init=False)  # the looks the source allows (the design before the budget's say)
    before: TauSample = field(default_factory=TauSample)
    after: TauSample = field(default_factory=TauSample)
    looks: list[LookRecord] = field(default_factory=list)
    seconds: float = 0.0  # the gate's decoding and model loads so far
    stopped: str = ""  # why the gate stopped undecided: "budget" | "looks" | "prompts"
    next_look_s: float = 0.0  # when the budget stopped it: what the next look would have needed
    _done: set[str] = field(default_factory=set)  # sides decoded in the current look
    _look_s: float = 0.0

    def __post_init__(self) -> None:
        self.design = self.plan.design(len(self.pool))
        self.wanted = self.design.looks
        self.source_prompts = max(self.source_prompts, len(self.pool))

    @property
    def look(self) -> int:
        """The look under way (1-based), or the next one."""
        return len(self.looks) + 1

    def _wave(self) -> list[list[int]]:
        start = len(self.looks) * self.plan.wave
        return self.pool[start : start + self.plan.wave]

    def decode(self, side: Side, target: Any) -> None:
        """Decode the current look's wave for `side` with `target` (that side's model)."""
        if side in self._done:
            raise ValueError(f"look {self.look} already decoded the {side} side")
        t = time.perf_counter()
        got = measure_tau(target, self.draft, self._wave(), self.plan.tokens, f"tau ({LABELS[side]}, look {self.look})",
                          self.progress, self.plan.max_draft_len)
        getattr(self, side).append(got)
        dt = time.perf_counter() - t
        self.seconds += dt
        self._look_s += dt
        self._done.add(side)
        if self.look == 1 and side == "before" and self._done == {"before"}:
            self._plan_for_budget(dt)

    def _plan_for_budget(self, before_s: float) -> None:
        """Plan the looks the budget pays for, a look costing twice look 1's unquantized pass
        (`before_s`): known before any quantized tau, so the design does not depend on the drop."""
        affordable = int(self.plan.budget_s // (2 * before_s)) if before_s > 0 else self.wanted
        self.design = self.plan.design(len(self.pool), affordable)
        self.next_look_s = 2 * before_s

    def plan_line(self) -> str:
        """What the gate plans, in one line (said after look 1's unquantized pass)."""
        d, p = self.design, self.plan
        why = (f"{self.wanted} wanted, the {p.budget_s:.0f} s budget (gate.budget_s) pays for "
               f"{d.looks}: a look ~{self.next_look_s:.0f} s here" if d.looks < self.wanted else
               f"within the {p.budget_s:.0f} s budget")
        return (f"gate plan: up to {d.looks} look{'s' if d.looks > 1 else ''} of {p.wave} prompts ({why}), "
                f"look 1 at {d.confidence(1):.1%}")

    def decide(self) -> Look:
        """Close the current look (both sides decoded) and judge it."""
        if self._done != {"before", "after"}:
            raise ValueError(f"look {self.look} needs both sides decoded, has {sorted(self._done)}")
        verdict = judge(self.before, self.after, self.plan.limit, self.design, self.look)
        self.looks.append(LookRecord(verdict, self.before.n, self._look_s))
        self._done, self._look_s = set(), 0.0
        return verdict

    def go_on(self, slot: ModelSlot) -> Look:
        """Further looks until one decides, the planned looks are done, or the next look would
        overrun the budget; `slot` holds the model of the side decoded last. The last look's verdict."""
        verdict = self.looks[-1].look
        while verdict.decision == "continue":
            if self.look > self.design.looks:
                self.stopped = ("budget" if self.design.looks < self.wanted else
                                "prompts" if self.wanted < self.plan.looks else "looks")
                if self.stopped == "budget":
                    self.next_look_s = max(r.seconds for r in self.looks)
                break
            need = max(r.seconds for r in self.looks)  # a look decodes one wave on each side
            if self.seconds + need > self.plan.budget_s:
                self.stopped, self.next_look_s = "budget", need
                break
            self.decode(slot.side, slot.model)
            load_s = slot.swap()
            self.seconds += load_s
            self._look_s += load_s
            self.decode(slot.side, slot.model)
            verdict = self.decide()
            self.say(self.progress_line())
        return verdict

    def progress_line(self) -> str:
        r = self.looks[-1]
        v = r.look
        return (f"gate look {v.look} of {v.looks}: {r.prompts} prompts x {self.plan.tokens} tokens, drop "
                f"{v.estimate:+.1%} [{v.low:+.1%}, {v.high:+.1%}] ({v.confidence:.1%}), {v.decision} "
                f"({self.seconds:.0f} s of the {self.plan.budget_s:.0f} s budget)")

    def advice(self) -> str:
        """For an undecided gate: what stopped it and which setting buys more evidence."""
        p = self.plan
        if self.stopped == "budget":
            left = self.wanted - len(self.looks)
            need = self.seconds + self.next_look_s * left
            return (f"the time budget stopped it (gate.budget_s {p.budget_s:.0f} s: look {self.look} would need "
                    f"~{self.next_look_s:.0f} s more); buy more evidence with --gate-budget {_round_up(need)} "
                    f"(the {left} look{'s' if left > 1 else ''} left)")
        if self.stopped == "prompts":
            return (f"every one of the {self.source_prompts} gate prompts was decoded; buy more evidence with more "
                    "prompts in gate.prompts (a JSONL/JSON/TXT file in the build spec)")
        taken = f"all {p.looks} planned looks were" if p.looks > 1 else "the one planned look was"
        more = self.source_prompts - self.before.n
        suggest = min(2 * p.looks, p.looks + math.ceil(more / p.wave))
        return (f"{taken} taken; buy more evidence with --gate-looks {suggest} (gate.max_looks: "
                f"the {more} prompts left, {p.wave} a look) and a --gate-budget to match" if more > 0 else
                f"{taken} taken and every gate prompt decoded; buy more evidence with more prompts in gate.prompts")


def _round_up(seconds: float) -> int:
    """A budget to suggest: the next multiple of 60 s."""
    return int(-(-seconds // 60) * 60)


def verdict_record(looks: GateLooks, quant: str, min_tau: float, accept_drop: bool,
                   say: Callable[[str], None]) -> dict[str, Any]:
    """The gate's record after its last look (kept in the manifest), its one line said; DFlashError
    with that line when it failed or could not decide, unless `accept_drop`."""
    p, last = looks.plan, looks.looks[-1]
    record = gate_record(looks.before, looks.after, last.look, p.limit, min_tau, looks.design)
    record.update(tokens_per_prompt=p.tokens, seconds=round(looks.seconds, 3), budget_s=p.budget_s,
                  looks_wanted=looks.wanted,  # before the budget planned `planned_looks` of them
                  stopped=looks.stopped or "decided", looks=[r.to_dict() for r in looks.looks])
    more = looks.advice() if record["decision"] == "inconclusive" else ""
    record = settle(record, quant, accept_drop, more)
    say(verdict_line(record, quant, more))
    return record
