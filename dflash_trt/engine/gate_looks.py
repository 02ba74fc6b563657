"""The acceptance gate's looks: what each one decodes, with which model loaded, within the budget.

Look 1 decodes the first `gate.num_prompts` prompts for `gate.max_new_tokens` tokens each, with the
unquantized target (before quantizing it) and with the exported one. When its interval straddles
the limit (engine/sequential.py decides), each further look decodes more, with both models, the
same prompts on both sides (the drop stays paired by prompt):

- a WAVE of prompts the gate has not decoded yet (the next `gate.num_prompts` of its source), as
  long as the source has some: new prompts are new independent units, and the batched runtime
  decodes a wave in one pass;
- once every prompt was decoded, every answer EXTENDED by `gate.max_new_tokens` tokens (each
  model continues its own answer: prompt + answer so far prefilled, then decoded further).

Order of passes. A build holds one model at a time (host memory: the target in the engine dtype
is what a build costs), so the sides alternate as A B | B A | A B ...: each look first decodes with
the model already loaded, then swaps it for the other (freed, then loaded from its checkpoint:
the source for the unquantized side, the exported target/ for the quantized one), one load per
look. Each pass's caches stay within look 1's (rows x positions): a look that extends long answers
decodes its prompts in as many batches as that takes, so a longer gate never holds more memory.

Budget. Before each look after the first, its time is predicted from the last look's (scaled by
the tokens it decodes); a look that would end past `gate.budget_s` is not started: the gate is
inconclusive and says which setting buys more evidence.
"""

from __future__ import annotations

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

    wave: int  # prompts of look 1 and of each later wave (gate.num_prompts)
    segment: int  # tokens per prompt of look 1; an extending look adds as many (gate.max_new_tokens)
    design: SequentialDesign  # planned looks (gate.max_looks) and the error rate each side
    budget_s: float  # the gate's decoding may not run past this many seconds (gate.budget_s)
    limit: float  # gate.max_tau_drop
    max_draft_len: int | None = None


def cache_batches(lengths: list[int], tokens: int, cells: int) -> list[list[int]]:
    """Rows (indices into `lengths`, the prompts' token counts) grouped into batches whose caches,
    rows x (longest prompt + `tokens`) positions, hold at most `cells` (a row longer than that alone
    gets a batch of its own). Shortest first, so each batch is as wide as its cache allows."""
    batches: list[list[int]] = [[]]
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        wider = max(longest, lengths[i])
        if batches[-1] and (len(batches[-1]) + 1) * (wider + tokens) > cells:
            batches.append([])
            wider = lengths[i]
        batches[-1].append(i)
        longest = wider
    return batches


@dataclass(frozen=True)
class LookWork:
    """What one look decodes: `prompts` (indices into the source) for `tokens` more tokens each,
    `new`: fresh prompts (a wave) or answers continued."""

    prompts: list[int]
    tokens: int
    new: bool


@dataclass
class LookRecord:
    look: Look
    prompts: int
    tokens: int  # per prompt, at this look
    seconds: float  # the look's own decoding and model loads

    def to_dict(self) -> dict[str, Any]:
        v = self.look
        return {"look": v.look, "prompts": self.prompts, "tokens_per_prompt": self.tokens,
                "relative_drop": v.estimate, "low": v.low, "high": v.high, "confidence": v.confidence,
                "decision": v.decision, "seconds": round(self.seconds, 3)}


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
    """The gate's samples, look by look. `pool`: every prompt the gate's source has (token ids)."""

    plan: GatePlan
    pool: list[list[int]]
    draft: Any
    progress: bool = True
    say: Callable[[str], None] = lambda msg: None
    before: TauSample = field(default_factory=TauSample)
    after: TauSample = field(default_factory=TauSample)
    looks: list[LookRecord] = field(default_factory=list)
    seconds: float = 0.0  # the gate's decoding and loads so far
    stopped: str = ""  # why the gate stopped before a decision ("budget" | "looks")
    next_look_s: float = 0.0  # when the budget stopped it: what the next look would have needed
    _used: int = 0  # prompts of the pool decoded so far
    _tokens: int = 0  # tokens per prompt so far
    _cells: int = 0  # look 1's caches: rows x positions, the most any later pass may hold
    _work: LookWork | None = None
    _done: set[str] = field(default_factory=set)  # sides decoded in the current look
    _look_s: float = 0.0

    # -- what a look decodes ---------------------------------------------------------------------
    def _next_work(self) -> LookWork:
        if not self.looks and not self._done:
            n = min(self.plan.wave, len(self.pool))
            return LookWork(list(range(n)), self.plan.segment, new=True)
        if self._used < len(self.pool):
            return LookWork(list(range(self._used, min(self._used + self.plan.wave, len(self.pool)))),
                            self._tokens, new=True)
        return LookWork(list(range(self._used)), self.plan.segment, new=False)

    @property
    def look(self) -> int:
        """The look under way (1-based), or the next one."""
        return len(self.looks) + 1

    def decode(self, side: Side, target: Any) -> None:
        """Decode the current look's work for `side` with `target` (that side's model)."""
        if self._work is None:
            self._work = self._next_work()
        if side in self._done:
            raise ValueError(f"look {self.look} already decoded the {side} side")
        work, sample = self._work, getattr(self, side)
        t = time.perf_counter()
        ids = [self.pool[i] + (sample.outputs[i] if not work.new else []) for i in work.prompts]
        desc = f"tau ({LABELS[side]}, look {self.look})"
        got = self._measure(target, ids, work.tokens, desc)
        if work.new:
            sample.append(got)
        else:
            sample.extend(got)
        dt = time.perf_counter() - t
        self.seconds += dt
        self._look_s += dt
        self._done.add(side)

    def _measure(self, target: Any, ids: list[list[int]], tokens: int, desc: str) -> TauSample:
        """`ids` decoded `tokens` further, in batches whose caches stay within look 1's; one entry
        per prompt, in the order of `ids`."""
        lengths = [len(p) for p in ids]
        if not self._cells:
            self._cells = len(ids) * (max(lengths) + tokens)
        rows: dict[int, tuple[int, int, list[int]]] = {}
        out = TauSample()
        for b in cache_batches(lengths, tokens, self._cells):
            got = measure_tau(target, self.draft, [ids[i] for i in b], tokens, desc, self.progress,
                              self.plan.max_draft_len)
            rows.update({i: (got.committed[j], got.steps[j], got.outputs[j]) for j, i in enumerate(b)})
            out.drafted += got.drafted
            out.accepted += got.accepted
        for i in range(len(ids)):
            c, s, o = rows[i]
            out.add(c, s, 0, 0, o)
        return out

    def decide(self) -> Look:
        """Close the current look (both sides decoded) and judge it."""
        if self._done != {"before", "after"}:
            raise ValueError(f"look {self.look} needs both sides decoded, has {sorted(self._done)}")
        work = self._work
        assert work is not None
        if work.new:
            self._used = max(self._used, work.prompts[-1] + 1)
            self._tokens = max(self._tokens, work.tokens)
        else:
            self._tokens += work.tokens
        verdict = judge(self.before, self.after, self.plan.limit, self.plan.design, self.look)
        self.looks.append(LookRecord(verdict, self.before.n, self._tokens, self._look_s))
        self._work, self._done, self._look_s = None, set(), 0.0
        return verdict

    # -- looks after the first -------------------------------------------------------------------
    def predicted_s(self) -> float:
        """The next look's time, from the last one's, scaled by the rows x tokens it decodes."""
        last, work = self.looks[-1], self._next_work()
        done = self._last_rows_tokens
        return last.seconds * (len(work.prompts) * work.tokens) / max(done, 1)

    @property
    def _last_rows_tokens(self) -> int:
        """Rows x tokens the last look decoded (one side)."""
        if len(self.looks) == 1:
            return self.looks[0].prompts * self.looks[0].tokens
        prev, last = self.looks[-2], self.looks[-1]
        if last.prompts > prev.prompts:
            return (last.prompts - prev.prompts) * last.tokens
        return last.prompts * (last.tokens - prev.tokens)

    def go_on(self, slot: ModelSlot) -> Look:
        """Further looks until one decides, the planned looks are done or the next look would
        overrun the budget; `slot` holds the model of the side decoded last. The last look's verdict."""
        verdict = self.looks[-1].look
        while verdict.decision == "continue":
            if self.look > self.plan.design.looks:
                self.stopped = "looks"
                break
            need = self.predicted_s()
            if self.seconds + need > self.plan.budget_s:
                self.stopped = "budget"
                self.next_look_s = need
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
        return (f"gate look {v.look} of {v.looks}: {r.prompts} prompts x {r.tokens} tokens, drop "
                f"{v.estimate:+.1%} [{v.low:+.1%}, {v.high:+.1%}] ({v.confidence:.1%}), {v.decision} "
                f"({self.seconds:.0f} s of the {self.plan.budget_s:.0f} s budget)")

    def advice(self) -> str:
        """For an undecided gate: what stopped it and which setting buys more evidence."""
        p = self.plan
        if self.stopped == "budget":
            left = p.design.looks - len(self.looks)
            need = self.seconds + self.next_look_s * left
            return (f"the time budget stopped it (gate.budget_s {p.budget_s:.0f} s: look {self.look} would need "
                    f"~{self.next_look_s:.0f} s more); buy more evidence with --gate-budget {_round_up(need)} "
                    f"(the {left} look{'s' if left > 1 else ''} left)")
        per = f"each adds {p.segment} tokens per prompt" if self._used >= len(self.pool) else \
            f"each adds up to {p.wave} prompts"
        taken = f"all {p.design.looks} planned looks were" if p.design.looks > 1 else "the one planned look was"
        return (f"{taken} taken; buy more evidence with --gate-looks "
                f"{2 * p.design.looks} (gate.max_looks; {per}) and a --gate-budget to match, or more prompts "
                "in gate.prompts (a JSONL/JSON/TXT file in the build spec)")


def _round_up(seconds: float) -> int:
    """A budget to suggest: the next multiple of 60 s."""
    return int(-(-seconds // 60) * 60)


def verdict_record(looks: GateLooks, quant: str, min_tau: float, accept_drop: bool,
                   say: Callable[[str], None]) -> dict[str, Any]:
    """The gate's record after its last look (kept in the manifest), its one line said; DFlashError
    with that line when it failed or could not decide, unless `accept_drop`."""
    p, last = looks.plan, looks.looks[-1]
    record = gate_record(looks.before, looks.after, last.look, p.limit, min_tau, p.design)
    record.update(tokens_per_prompt=last.tokens, seconds=round(looks.seconds, 3), budget_s=p.budget_s,
                  stopped=looks.stopped or "decided", looks=[r.to_dict() for r in looks.looks])
    more = looks.advice() if record["decision"] == "inconclusive" else ""
    record = settle(record, quant, accept_drop, more)
    say(verdict_line(record, quant, more))
    return record
