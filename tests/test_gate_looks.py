"""The gate's looks after the first (engine/gate_looks.py) on tiny pairs in float32: waves of new
prompts, the same on both sides; the two sides alternate one model at a time; the looks a source
allows; the budget stops the gate before a look that would overrun it, and every undecided ending
names the setting that buys more evidence, in one line.

A design with a vanishing error rate never decides, so these tests walk every planned look
whatever the tiny models' taus are; the decisions themselves are tests/test_gate_sequential.py's."""

from __future__ import annotations

import copy
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from dflash_trt.engine import gate_looks
from dflash_trt.engine.gate import measure_tau
from dflash_trt.engine.gate_looks import GateLooks, GatePlan, ModelSlot, verdict_record
from dflash_trt.engine.sequential import SequentialDesign
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.tiny import random_draft, tiny_target

VOCAB = 16  # small: a random drafter is accepted often enough that tau differs between prompts


@pytest.fixture
def never_decides(monkeypatch):
    """The gate's designs with a vanishing alpha: intervals so wide that no look decides."""
    real = GatePlan.design

    def design(self, pool, affordable=None):
        return SequentialDesign(real(self, pool, affordable).fractions, alpha=1e-12)

    monkeypatch.setattr(GatePlan, "design", design)


def _pair_and_pool(n: int, seed: int = 2):
    target = tiny_target("qwen3", seed=seed, vocab_size=VOCAB)
    draft = random_draft(target.config, block_size=4, seed=seed, mask_token_id=VOCAB - 1)
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(2, 20, (n,), generator=g)]
    return target, draft, pool


def _perturbed(model, scale: float = 0.3, seed: int = 0):
    """A copy with noise on every weight: the "quantized" side."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return other


class _Loader:
    """Loads a side's model (a fresh copy, as a checkpoint read gives) and checks that the model it
    handed out before is gone: the gate holds one target at a time."""

    def __init__(self, before, after):
        self.sources = {"before": before, "after": after}
        self.loads: list[str] = []
        self.last: weakref.ref | None = None

    def __call__(self, side: str):
        gc.collect()
        assert self.last is None or self.last() is None, "a second target was loaded while the first was held"
        self.loads.append(side)
        model = copy.deepcopy(self.sources[side])
        self.last = weakref.ref(model)
        return model


def _start(looks: GateLooks, loader: _Loader) -> ModelSlot:
    """Look 1 as the build runs it: the unquantized side, then the exported one, judged."""
    first = loader("before")
    looks.decode("before", first)
    first = None
    slot = ModelSlot("after", loader("after"), loader)
    looks.decode("after", slot.model)
    looks.decide()
    return slot


def test_waves_of_new_prompts_alternating_one_model_at_a_time(never_decides):
    target, draft, pool = _pair_and_pool(10)
    loader = _Loader(target, _perturbed(target))
    looks = GateLooks(GatePlan(wave=4, tokens=8, looks=5, budget_s=1e9, limit=0.10), pool, draft, progress=False)
    assert looks.design.fractions == (0.4, 0.8, 1.0)  # 10 prompts: waves of 4, 4 and 2
    verdict = looks.go_on(_start(looks, loader))
    assert verdict.decision == "continue" and looks.stopped == "prompts"
    assert [r.prompts for r in looks.looks] == [4, 8, 10]
    # A B | B A | A B: the side already loaded decodes first, one load a look
    assert loader.loads == ["before", "after", "before", "after"]
    # each side holds every prompt once, in pool order: what one pass over all of them measures
    for side, model in (("before", target), ("after", loader.sources["after"])):
        whole = measure_tau(model, draft, pool, 8, side, progress=False)
        got = getattr(looks, side)
        assert (got.committed, got.steps, got.drafted) == (whole.committed, whole.steps, whole.drafted)


def test_the_design_is_the_looks_the_source_allows():
    plan = GatePlan(wave=39, tokens=96, looks=4, budget_s=240, limit=0.10)
    assert plan.design(156).fractions == (0.25, 0.5, 0.75, 1.0)
    assert plan.design(1000).fractions == (0.25, 0.5, 0.75, 1.0)
    assert plan.design(39).fractions == (1.0,)
    assert plan.design(50).fractions == (39 / 50, 1.0)
    # what the budget pays for: fewer looks (one at least), the fractions over what they decode
    assert plan.design(156, 2).fractions == (0.5, 1.0)
    assert plan.design(156, 0).fractions == plan.design(156, 1).fractions == (1.0,)
    assert plan.design(156, 9).fractions == (0.25, 0.5, 0.75, 1.0)


def test_the_budget_stops_the_gate_before_a_look_that_would_overrun_it_and_names_the_flag(never_decides):
    target, draft, pool = _pair_and_pool(12)
    loader = _Loader(target, _perturbed(target))
    said: list[str] = []
    looks = GateLooks(GatePlan(wave=6, tokens=8, looks=2, budget_s=1e-3, limit=0.10), pool, draft, progress=False,
                      say=said.append)
    verdict = looks.go_on(_start(looks, loader))
    assert verdict.look == 1 and looks.stopped == "budget" and loader.loads == ["before", "after"]
    with pytest.raises(DFlashError) as e:
        verdict_record(looks, "nvfp4", 1.0, False, said.append)
    line = str(e.value)
    # the budget pays for no second look: the design plans one (look 1 of 1), still naming the flag
    assert "\n" not in line and line.startswith("acceptance gate inconclusive after look 1 of 1 (6 prompts x 8 tokens, ")
    assert "straddles the 10% limit; the time budget stopped it (gate.budget_s 0 s: look 2 would need ~" in line
    assert "buy more evidence with --gate-budget 60 (the 1 look left)" in line
    assert line.endswith("or pass --accept-tau-drop to keep the engine")
    # kept by the flag: the record says so, and the same line is said
    record = verdict_record(looks, "nvfp4", 1.0, True, said.append)
    assert record["decision"] == "inconclusive" and record["accepted_by_flag"] and record["stopped"] == "budget"
    assert said[-1].endswith("; kept by --accept-tau-drop") and "--gate-budget" in said[-1]


def test_every_planned_look_taken_names_gate_looks(never_decides):
    target, draft, pool = _pair_and_pool(10)
    loader = _Loader(target, _perturbed(target))
    looks = GateLooks(GatePlan(wave=4, tokens=6, looks=2, budget_s=1e9, limit=0.10), pool, draft, progress=False)
    looks.go_on(_start(looks, loader))
    assert looks.stopped == "looks"
    with pytest.raises(DFlashError, match=r"inconclusive after look 2 of 2 \(8 prompts x 6 tokens, .*all 2 planned "
                                          r"looks were taken; buy more evidence with --gate-looks 3 \(gate.max_looks: "
                                          r"the 2 prompts left, 4 a look\)"):
        verdict_record(looks, "fp8", 1.0, False, lambda msg: None)


def test_every_prompt_decoded_names_gate_prompts(never_decides):
    target, draft, pool = _pair_and_pool(6)
    loader = _Loader(target, _perturbed(target))
    looks = GateLooks(GatePlan(wave=4, tokens=6, looks=4, budget_s=1e9, limit=0.10), pool, draft, progress=False)
    looks.go_on(_start(looks, loader))
    with pytest.raises(DFlashError, match=r"after look 2 of 2 \(6 prompts x 6 tokens, .*every one of the 6 gate "
                                          r"prompts was decoded; buy more evidence with more prompts in gate.prompts"):
        verdict_record(looks, "fp8", 1.0, False, lambda msg: None)


def test_a_pass_is_said_in_one_line_with_its_look_and_interval():
    target, draft, pool = _pair_and_pool(8)
    loader = _Loader(target, target)  # the same weights: no drop at all
    said: list[str] = []
    looks = GateLooks(GatePlan(wave=8, tokens=8, looks=4, budget_s=1e9, limit=0.10), pool, draft, progress=False)
    assert looks.go_on(_start(looks, loader)).decision == "pass" and loader.loads == ["before", "after"]
    record = verdict_record(looks, "fp8", 1.0, False, said.append)
    assert record["looks"][0]["decision"] == "pass" and record["stopped"] == "decided"
    assert len(said) == 1 and said[0].startswith("acceptance gate passed at look 1 of 1 (8 prompts x 8 tokens, ")
    assert "drop +0.0% [+0.0%, +0.0%] (95.0% interval, 2.5% error each side over 1 look) within the 10% limit" in said[0]


def test_a_look_predicted_past_the_budget_is_not_started(never_decides, monkeypatch):
    """The looks are planned on look 1's unquantized pass (15 s: a look ~30 s): 50 s of budget
    plans one look (a single look's level: 95% at the gate's alpha) and names the budget; 90 s plans both looks at the design's
    level. The prediction before a later look is the longest look so far: a look 1 slower than
    planned (its quantized pass 45 s) stops a gate planned for 2 looks before look 2."""
    target, draft, pool = _pair_and_pool(8)

    def gate(budget_s: float, steps: list[int]) -> GateLooks:
        ticks = iter([t for dt in steps for t in (0.0, float(dt))])  # each decode's start and end
        monkeypatch.setattr(gate_looks, "time", SimpleNamespace(perf_counter=lambda: next(ticks, 0.0)))
        looks = GateLooks(GatePlan(wave=4, tokens=6, looks=2, budget_s=budget_s, limit=0.10), pool, draft,
                          progress=False)
        looks.go_on(_start(looks, _Loader(target, _perturbed(target))))
        return looks

    looks = gate(50, [15, 15])
    assert looks.design.fractions == (1.0,) and looks.wanted == 2  # one look: a single look's level
    record = verdict_record(looks, "fp8", 1.0, True, lambda msg: None)
    assert (record["planned_looks"], record["looks_wanted"], record["stopped"]) == (1, 2, "budget")
    assert looks.seconds == 30 and looks.stopped == "budget" and looks.next_look_s == 30
    assert "~30 s more); buy more evidence with --gate-budget 60 (the 1 look left)" in looks.advice()
    assert looks.plan_line().startswith("gate plan: up to 1 look of 4 prompts (2 wanted, the 50 s budget "
                                        "(gate.budget_s) pays for 1: a look ~30 s here), look 1 at ")
    looks = gate(90, [15, 15, 15, 0, 15])  # look 2: a pass, the swap, a pass
    assert looks.design.looks == 2 and looks.stopped == "looks" and len(looks.looks) == 2
    looks = gate(90, [15, 45])
    assert looks.design.looks == 2 and looks.stopped == "budget" and len(looks.looks) == 1 and looks.next_look_s == 60


def test_looks_taken_with_prompts_left_in_the_source_name_how_many_looks_more(never_decides):
    """The build hands the gate the prompts its planned looks can take, and how many the source has."""
    target, draft, pool = _pair_and_pool(8)
    loader = _Loader(target, _perturbed(target))
    looks = GateLooks(GatePlan(wave=4, tokens=6, looks=2, budget_s=1e9, limit=0.10), pool, draft, progress=False,
                      source_prompts=156)
    looks.go_on(_start(looks, loader))
    assert looks.stopped == "looks"
    with pytest.raises(DFlashError, match=r"all 2 planned looks were taken; buy more evidence with --gate-looks 4 "
                                          r"\(gate.max_looks: the 148 prompts left, 4 a look\)"):
        verdict_record(looks, "fp8", 1.0, False, lambda msg: None)


def test_a_later_waves_per_position_counts_join_the_sample():
    """The draft-length schedule is derived from the gate's pooled per-position acceptance
    (builder._final_schedule): a wave appended by a later look must add its slot counts, not only
    its tau numerators, or the schedule would read the first look's prompts alone."""
    from dflash_trt.engine.gate import TauSample

    first, wave = TauSample(), TauSample()
    first.add(10, 5, 10, 5, position_drafted=[5, 5], position_accepted=[4, 1])
    wave.add(12, 4, 12, 8, position_drafted=[4, 4, 4], position_accepted=[4, 3, 1])
    first.append(wave)
    assert first.n == 2 and first.committed == [10, 12]
    assert first.position_drafted == [9, 9, 4] and first.position_accepted == [8, 4, 1]
