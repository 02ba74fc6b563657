"""The engine's draft-length schedule: for each batch size, the draft length that maximises throughput.

For a batch-size bucket b and a draft length k (0 = plain decoding), tokens per second are

    b * E[tokens | k] / step_seconds(b, k)        (E from the acceptance profile, the step from
                                                    engine/step_cost.py on the engine's GPU)

and the bucket drafts the SMALLEST k within `TOLERANCE` of the best (near-ties go to less
drafting: cheaper, and less exposed to an optimistic profile); 0 wherever drafting loses to plain
decoding. A bigger batch never drafts more than a smaller one (the verify pass only gets dearer
per token as batches grow). Buckets are the powers of two up to max_batch_size, and
max_batch_size itself; each key is an inclusive upper bound, so the value chosen AT the key covers
the whole bucket below it (the costliest batch of the bucket decides).

Upstream's rules then shape it (dflash_trt/draft_len_schedule.py, TensorRT-LLM's validator): the
smallest key maps to max_draft_len, no value exceeds it. K (max_draft_len) is the engine's: the
memory plan, TensorRT-LLM's buffers and CUDA graphs, and every runtime are sized by it. So when the
best k at batch 1 (k1) is below the requested K:

- K left to its default (block_size - 1): the build LOWERS K to k1. Drafting more at batch 1
  would cost throughput the model says is there to keep, and nothing needs a K above the
  schedule's largest value; a lower K only shrinks what the plan reserved.
- K given explicitly (--max-draft-len): K is kept and the schedule starts at K, as upstream
  requires; the predicted cost of that at batch 1 is printed.

A derived schedule that drafts K at every batch size the engine serves ({max_batch_size: K}) is
what TensorRT-LLM does without one: it is recorded in the manifest but not written, so the engine's
minimum TensorRT-LLM release stays DFlash's own (draft_len_schedule is listed from 1.3.0rc27).

A schedule whose k1 is 0 (drafting loses even at batch 1) still drafts at batch 1 (upstream's
smallest key must map to max_draft_len >= 1): K goes to 1 (or stays at a given K) and the build
says drafting does not pay on this GPU.

Never a draft length of 0 for TensorRT-LLM (the floor). A one-model DFlash worker that drafts 0
stops refreshing its per-request context buffers, and acceptance collapses once drafting resumes
(TensorRT-LLM PR 16888, open; trtllm_fields.json behaviours.dflash_zero_draft_len_safe names no
release with the fix). Upstream drafts 0 at every batch above the schedule's largest key, so the
written schedule floors every bucket at 1 up to max_batch_size (`DraftLenSchedule.floored`), and
the manifest records the buckets the model would have switched off and what drafting 1 there
costs by the same cost model. The schedule before the floor stays on record as the peers' one:
vLLM 0.33 keeps DFlash's context at 0 drafts (launch/vllm.sh writes it; llm_api._vllm_command).
For a release recorded with the fix, the floor follows it (`floor_zero=False`).

A release without draft_len_schedule (before its first recorded one) gets none: the derived
schedule stays on record, every batch drafts max_draft_len there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_trt.draft_len_schedule import DraftLenSchedule
from dflash_trt.engine.acceptance_profile import DEFAULT_SOURCE, AcceptanceProfile
from dflash_trt.engine.hardware import GPUS
from dflash_trt.engine.step_cost import CostAssumptions, ModelDims, step_cost

TOLERANCE = 0.005  # a smaller k within 0.5% of the best throughput wins the bucket
FLOOR = 1  # the least draft length written for TensorRT-LLM (PR 16888's min_runtime_draft_len)
FLOOR_WHY = ("TensorRT-LLM drafts 0 above a schedule's largest key and at an explicit 0; a one-model DFlash worker "
             "at 0 drafts stops refreshing its per-request context buffers and acceptance collapses once drafting "
             "resumes (PR 16888, open: no release floors it itself)")


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


@dataclass(frozen=True)
class BucketChoice:
    """What the model predicts at one bucket's batch size."""

    batch: int
    k: int  # chosen draft length (before upstream's K rule)
    tokens_per_s: float  # at k, the whole engine
    plain_tokens_per_s: float  # at k = 0
    step_s: float
    plain_step_s: float
    bound: str  # what bounds the verify pass at k: memory | compute

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.plain_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "k": self.k, "tokens_per_s": round(self.tokens_per_s, 1),
                "plain_tokens_per_s": round(self.plain_tokens_per_s, 1), "step_s": self.step_s,
                "plain_step_s": self.plain_step_s, "speedup": round(self.speedup, 4), "bound": self.bound}


@dataclass(frozen=True)
class ScheduleDecision:
    """The schedule an engine writes (None: none) and the K it writes, with how they were decided."""

    schedule: DraftLenSchedule | None
    max_draft_len: int  # K the engine writes
    source: str  # derived | given | off | none
    requested_max_draft_len: int
    buckets: tuple[BucketChoice, ...] = ()
    profile: AcceptanceProfile | None = None
    inputs: dict[str, Any] = field(default_factory=dict)  # the cost model's inputs, for the manifest
    notes: tuple[str, ...] = ()
    # the schedule before TensorRT-LLM's floor (0 where drafting loses): vLLM's (it keeps DFlash's
    # context at 0 drafts); "same" = `schedule`
    peer_schedule: DraftLenSchedule | None | str = "same"
    floor: dict[str, Any] | None = None  # what the floor changed and its cost by the model (None: nothing)

    @property
    def peers(self) -> DraftLenSchedule | None:
        """The schedule the vLLM command writes (before TensorRT-LLM's floor)."""
        return self.schedule if isinstance(self.peer_schedule, str) else self.peer_schedule

    def to_record(self) -> dict[str, Any]:
        """The manifest's record (EngineManifest.speculation)."""
        out: dict[str, Any] = {"source": self.source, "max_draft_len": self.max_draft_len,
                               "requested_max_draft_len": self.requested_max_draft_len,
                               "draft_len_schedule": self.schedule.to_mapping() if self.schedule else None}
        if self.floor is not None:
            out["floor"] = self.floor
        if self.buckets:
            out["model"] = {**self.inputs, "acceptance": self.profile.to_dict() if self.profile else None,
                            "buckets": [b.to_dict() for b in self.buckets]}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def choose_k(gpu: str, target: ModelDims, draft: ModelDims, tp: int, ep: int, batch: int, max_k: int,
             profile: AcceptanceProfile, assumptions: CostAssumptions | None = None) -> BucketChoice:
    """The throughput-maximising draft length at `batch` rows, 0..max_k (see the module docstring)."""
    costs = [step_cost(gpu, target, tp, ep, batch, k, draft, assumptions) for k in range(max_k + 1)]
    rates = [batch * profile.expected_tokens(k) / c.seconds for k, c in enumerate(costs)]
    best = max(rates)
    k = next(k for k, r in enumerate(rates) if r >= best * (1 - TOLERANCE))
    return BucketChoice(batch, k, rates[k], rates[0], costs[k].seconds, costs[0].seconds, costs[k].bound)


def compress(keys: list[int], values: list[int]) -> DraftLenSchedule:
    """Inclusive-upper-bound keys with equal neighbours merged (the larger key kept) and a trailing
    run of 0 dropped (above the largest key the draft length is 0 anyway)."""
    steps: list[tuple[int, int]] = []
    for b, k in zip(keys, values):
        if steps and steps[-1][1] == k:
            steps[-1] = (b, k)
        else:
            steps.append((b, k))
    if len(steps) > 1 and steps[-1][1] == 0:
        steps.pop()
    return DraftLenSchedule(tuple(steps))


def derive(gpu: str, target: ModelDims, draft: ModelDims, tp: int, ep: int, max_batch_size: int,
           max_draft_len: int, k_given: bool, profile: AcceptanceProfile,
           assumptions: CostAssumptions | None = None, floor_zero: bool = True) -> ScheduleDecision:
    """The derived schedule and K for an engine (module docstring: buckets, tolerance, K rule, and
    the floor at 1 unless `floor_zero` is False: a release recorded with PR 16888's fix)."""
    a = assumptions or CostAssumptions()
    keys = bucket_sizes(max_batch_size)
    chosen: list[BucketChoice] = []
    for b in keys:
        c = choose_k(gpu, target, draft, tp, ep, b, max_draft_len, profile, a)
        if chosen and c.k > chosen[-1].k:  # a bigger batch never drafts more
            c = _at_k(gpu, target, draft, tp, ep, b, chosen[-1].k, profile, a)
        chosen.append(c)
    k1 = chosen[0].k
    notes: list[str] = []
    if k1 == 0:
        K = max_draft_len if k_given else 1
        notes.append(f"drafting loses to plain decoding at every batch size on {gpu} (predicted "
                     f"{_at_k(gpu, target, draft, tp, ep, 1, K, profile, a).speedup:.2f}x at batch 1 with {K} drafts); "
                     "upstream's rule still drafts max_draft_len at the smallest key: serve without DFlash, or "
                     f"measure the acceptance ({profile.source})")
    elif k_given or k1 == max_draft_len:
        K = max_draft_len
        if k1 < K:
            kept = _at_k(gpu, target, draft, tp, ep, 1, K, profile, a)
            notes.append(f"batch 1 drafts the given max_draft_len {K} (TensorRT-LLM: the smallest key maps to "
                         f"max_draft_len); {k1} drafts would be {chosen[0].tokens_per_s / kept.tokens_per_s - 1:+.1%} "
                         f"faster there (leave --max-draft-len unset to let the schedule lower K)")
    else:
        K = k1
        notes.append(f"max_draft_len {max_draft_len} -> {K}: the most a batch drafts by this schedule "
                     "(TensorRT-LLM: the smallest key maps to max_draft_len); pass --max-draft-len "
                     f"{max_draft_len} to keep it")
    values = [K] + [min(c.k, K) for c in chosen[1:]]
    best = compress(keys, values)  # the model's: 0 where drafting loses
    best.check_against(K)
    schedule, floor = best, None
    if floor_zero:
        schedule, floor, floor_notes = floor_for_trtllm(
            best, max_batch_size, lambda b: (_at_k(gpu, target, draft, tp, ep, b, FLOOR, profile, a).tokens_per_s,
                                             _at_k(gpu, target, draft, tp, ep, b, 0, profile, a).tokens_per_s))
        notes += floor_notes
    written, note = _unless_k_everywhere(schedule, max_batch_size, K)
    notes += note
    peers = _unless_k_everywhere(best, max_batch_size, K)[0]
    g = GPUS[gpu]
    inputs = {"gpu": {"name": gpu, "bandwidth_tb_s": g.bandwidth_tb_s, "peak_tflops": dict(g.peak_tflops),
                      "nvlink_gb_s": g.nvlink_gb_s},
              "tp": tp, "ep": ep, "target": _dims(target), "draft": _dims(draft), "assumptions": a.to_dict(),
              "tolerance": TOLERANCE}
    return ScheduleDecision(written, K, "derived", max_draft_len, tuple(chosen), profile, inputs, tuple(notes),
                            peer_schedule=peers, floor=floor)


def _unless_k_everywhere(schedule: DraftLenSchedule, max_batch_size: int, K: int
                         ) -> tuple[DraftLenSchedule | None, list[str]]:
    """None for {max_batch_size: K}: K at every batch the engine serves is what no schedule does, and
    releases before the field's first one serve it (the manifest's minimum stays DFlash's own)."""
    if schedule.steps != ((max_batch_size, K),):
        return schedule, []
    return None, [f"every batch size up to max_batch_size {max_batch_size} drafts max_draft_len {K}: no "
                  "draft_len_schedule is written (the same behaviour without one)"]


def floor_for_trtllm(schedule: DraftLenSchedule, max_batch_size: int,
                     rates: Callable[[int], tuple[float, float]] | None = None
                     ) -> tuple[DraftLenSchedule, dict[str, Any] | None, list[str]]:
    """`schedule` floored at FLOOR up to max_batch_size (module docstring), the manifest's record of
    what changed and the notes. `rates(batch)`: tokens/s at FLOOR drafts and at 0 by the cost model,
    taken at both ends of each zero range (its largest batch is the costliest, as a bucket's key
    is); None: no cost model (a CPU engine)."""
    zero = schedule.zero_ranges(max_batch_size)
    if not zero:
        return schedule, None, []
    floored = schedule.floored(max_batch_size, FLOOR)
    cost = []
    for lo, hi in zero:
        for batch in sorted({lo, hi}) if rates is not None else ():
            at_floor, plain = rates(batch)
            cost.append({"batch": batch, "range": [lo, hi], "drafts": FLOOR, "tokens_per_s": round(at_floor, 1),
                         "plain_tokens_per_s": round(plain, 1), "change": round(at_floor / plain - 1, 4)})
    ranges = ", ".join(f"{lo}-{hi}" if lo != hi else f"{lo}" for lo, hi in zero)
    # str keys: the same in memory as after the manifest's JSON round trip
    record = {"why": FLOOR_WHY, "floor": FLOOR, "before": {str(b): k for b, k in schedule.steps},
              "zero_batches": [list(r) for r in zero],
              "cost": cost or None}
    top = next((c for c in cost if c["batch"] == max_batch_size), cost[-1] if cost else None)
    priced = (f"; by the cost model {FLOOR} draft at batch {top['batch']} gives {top['tokens_per_s']:,.0f} tok/s "
              f"against {top['plain_tokens_per_s']:,.0f} without ({top['change']:+.1%})" if top else
              "; no cost model for this GPU")
    return floored, record, [f"batches {ranges} would draft 0 ({schedule.to_mapping()}): floored at {FLOOR} up to "
                             f"max_batch_size {max_batch_size} for TensorRT-LLM (PR 16888){priced}"]


def _at_k(gpu: str, target: ModelDims, draft: ModelDims, tp: int, ep: int, batch: int, k: int,
          profile: AcceptanceProfile, a: CostAssumptions) -> BucketChoice:
    cost, plain = step_cost(gpu, target, tp, ep, batch, k, draft, a), step_cost(gpu, target, tp, ep, batch, 0, draft, a)
    return BucketChoice(batch, k, batch * profile.expected_tokens(k) / cost.seconds, batch / plain.seconds,
                        cost.seconds, plain.seconds, cost.bound)


def _dims(d: ModelDims) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(d).items() if v not in (0, None, 0.0) or k in ("layers", "hidden")}


def render(decision: ScheduleDecision, console: Any) -> None:
    """The schedule and, when derived, the model's table (stderr, as the plan)."""
    if decision.buckets:
        from rich.table import Table

        gpu = decision.inputs.get("gpu", {}).get("name", "?")
        t = Table(title=f"Draft length by batch size on {gpu} x{decision.inputs.get('tp', 1)} (engine/step_cost.py; "
                        "tokens/s of the whole engine)")
        for col in ("batch", "k", "DFlash tok/s", "plain tok/s", "ratio", "step ms", "bound"):
            t.add_column(col, justify="right")
        for b in decision.buckets:
            t.add_row(str(b.batch), str(b.k), f"{b.tokens_per_s:,.0f}", f"{b.plain_tokens_per_s:,.0f}",
                      f"{b.speedup:.2f}x", f"{b.step_s * 1e3:.3f}", b.bound)
        console.print(t)
        if decision.profile is not None:
            shown = ", ".join(f"{p:.2f}" for p in decision.profile.survival[:8])
            console.print(f"  acceptance P(a>=1..): {shown}{' ...' if len(decision.profile.survival) > 8 else ''} "
                          f"({decision.profile.source})", markup=False, highlight=False)
    written = decision.schedule.to_mapping() if decision.schedule else "none"
    console.print(f"draft_len_schedule ({decision.source}): {written}  max_draft_len {decision.max_draft_len}",
                  markup=False, highlight=False)
    for n in decision.notes:
        console.print(f"  note: {n}", markup=False, highlight=False)


def decide(spec: Any, arch: Any, draft_shape: Any, block_size: int | None, max_draft_len: int,
           recipe: Any = None, expert_format: str | None = None,
           measured: AcceptanceProfile | None = None, release: str | None = None) -> ScheduleDecision:
    """The engine's schedule and K from the build spec (engine/spec.py), for TensorRT-LLM `release`
    (default: the spec's, trtllm_versions.engine_release):

    - ``draft_len_schedule: off`` -> none; a given schedule -> that one, K following its smallest
      key unless --max-draft-len fixes K (then upstream's rule must hold, one line if not);
    - ``auto`` -> derived on the spec's GPU from the profile: --acceptance-profile, else `measured`
      (the acceptance gate's), else the stated default; a CPU engine gets none (the model has
      GPU figures only; the reference runtime's adaptive policy measures its own step costs);
    - either way floored at 1 up to max_batch_size unless `release` is recorded with PR 16888's
      fix, and none written for a release without draft_len_schedule (module docstring)."""
    from dflash_trt.engine.trtllm_versions import accepts, behaves, engine_release
    from dflash_trt.errors import DFlashError

    release = release or engine_release(spec)
    floor_zero = not behaves(release, "dflash_zero_draft_len_safe")
    has_field = accepts(release, "speculative_config.draft_len_schedule")
    K, given_k = max_draft_len, spec.max_draft_len is not None
    choice = spec.draft_len_schedule
    if choice == "off":
        return ScheduleDecision(None, K, "off", K)
    if isinstance(choice, dict):
        schedule = DraftLenSchedule.from_mapping(choice)
        K = K if given_k else schedule.max_draft_len
        limit = (block_size - 1) if block_size else None
        if K < 1 or (limit is not None and K > limit):
            raise DFlashError(f"--draft-len-schedule {schedule.to_text()}: its smallest batch size drafts {K}, which "
                              f"is max_draft_len and must lie in 1..{limit or 'block_size - 1'}")
        schedule.check_against(K)
        if not has_field:
            raise DFlashError(f"--draft-len-schedule {schedule.to_text()}: TensorRT-LLM {release} has no "
                              f"draft_len_schedule (first: {_first_schedule_release()}); build for a later "
                              "--tensorrt-llm-release, or pass --draft-len-schedule off")
        written, floor, notes = schedule, None, []
        if floor_zero:
            rates = None
            if spec.gpu != "cpu":
                target, draft, profile = _model_inputs(spec, arch, draft_shape, block_size, K, recipe, expert_format,
                                                       measured)
                rates = lambda b: (_at_k(spec.gpu, target, draft, spec.tp, spec.ep, b, FLOOR, profile,  # noqa: E731
                                         CostAssumptions()).tokens_per_s,
                                   _at_k(spec.gpu, target, draft, spec.tp, spec.ep, b, 0, profile,
                                         CostAssumptions()).tokens_per_s)
            written, floor, notes = floor_for_trtllm(schedule, spec.max_batch_size, rates)
        return ScheduleDecision(written, K, "given", max_draft_len, notes=tuple(notes), peer_schedule=schedule,
                                floor=floor)
    if spec.gpu == "cpu":
        return ScheduleDecision(None, K, "none", K, notes=(
            "no draft_len_schedule for a CPU engine: the step-cost model has GPU figures only (serve's adaptive "
            "policy measures its own step costs)",))
    target, draft, profile = _model_inputs(spec, arch, draft_shape, block_size, K, recipe, expert_format, measured)
    decided = derive(spec.gpu, target, draft, spec.tp, spec.ep, spec.max_batch_size, K, given_k, profile,
                     floor_zero=floor_zero)
    if not has_field and decided.schedule is not None:
        decided = replace(decided, schedule=None, notes=decided.notes + (
            f"TensorRT-LLM {release} has no draft_len_schedule (first: {_first_schedule_release()}): none is "
            f"written, every batch drafts max_draft_len {decided.max_draft_len} there",))
    if profile.source == DEFAULT_SOURCE:  # say which schedule is final where a build prints two
        decided = replace(decided, notes=decided.notes + (
            "from the default acceptance profile: a build whose acceptance gate runs (--gate, on when quantizing) "
            "derives it again from the drafter's measured acceptance; or give --acceptance-profile",))
    return decided


def _first_schedule_release() -> str:
    from dflash_trt.engine.trtllm_versions import table

    return table()["fields"]["speculative_config.draft_len_schedule"]["first_version"]


def _model_inputs(spec: Any, arch: Any, draft_shape: Any, block_size: int | None, K: int, recipe: Any,
                  expert_format: str | None, measured: AcceptanceProfile | None
                  ) -> tuple[ModelDims, ModelDims, AcceptanceProfile]:
    """The cost model's target and drafter, and the acceptance profile (--acceptance-profile, else
    the gate's measurement, else the stated default)."""
    drafts = (block_size - 1) if block_size else K
    if spec.acceptance_profile is not None:
        profile = AcceptanceProfile.parse(spec.acceptance_profile, drafts)
    else:
        profile = measured or AcceptanceProfile.default(drafts)
    recipe_name = recipe.name if recipe is not None else None
    keep = tuple(recipe.keep_modules) if recipe is not None else ()
    target = ModelDims.from_arch(arch, spec.quant, recipe_name, spec.kv_cache_quant, keep, expert_format)
    draft = ModelDims.from_draft(draft_shape, arch.vocab_size, block_size or K + 1)
    return target, draft, profile
