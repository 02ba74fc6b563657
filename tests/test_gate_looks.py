"""The gate's looks after the first (engine/gate_looks.py) on tiny pairs in float32: waves of new
prompts, then longer answers; the two sides alternate one model at a time; a continued answer is
the answer one longer decode gives; the budget stops the gate before a look that would overrun it,
and every undecided ending names the setting that buys more evidence, in one line.

A design with a vanishing error rate never decides, so these tests walk every planned look
whatever the tiny models' taus are; the decisions themselves are tests/test_gate_sequential.py's."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from dflash_trt.engine.gate import measure_tau
from dflash_trt.engine.gate_looks import GateLooks, GatePlan, ModelSlot, cache_batches, verdict_record
from dflash_trt.engine.sequential import SequentialDesign
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.tiny import random_draft, tiny_target

VOCAB = 16  # small: a random drafter is accepted often enough that tau differs between prompts
NEVER = 1e-12  # alpha of a design whose intervals never decide


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
    """Loads a side's model (a fresh copy, as a checkpoint read would give) and checks that the
    model it handed out before is gone: the gate holds one target at a time."""

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


def test_waves_of_new_prompts_then_longer_answers_alternating_one_model_at_a_time():
    target, draft, pool = _pair_and_pool(10)
    loader = _Loader(target, _perturbed(target))
    plan = GatePlan(wave=4, segment=8, design=SequentialDesign(5, alpha=NEVER), budget_s=1e9, limit=0.10)
    looks = GateLooks(plan, pool, draft, progress=False)
    slot = _start(looks, loader)
    verdict = looks.go_on(slot)
    assert verdict.decision == "continue" and looks.stopped == "looks"
    # look 2 and 3: waves (4 more prompts, then the last 2); then every answer 8 tokens longer, twice
    assert [(r.prompts, r.tokens) for r in looks.looks] == [(4, 8), (8, 8), (10, 8), (10, 16), (10, 24)]
    # A B | B A | A B | B A: the side already loaded decodes first, one load a look
    assert loader.loads == ["before", "after", "before", "after", "before", "after"]
    assert all(len(o) == 24 for o in looks.before.outputs + looks.after.outputs)
    assert looks.before.n == looks.after.n == 10


def test_a_continued_answer_is_the_answer_one_longer_decode_gives():
    """Extending an answer prefills prompt + answer so far and decodes on: the same tokens as one
    decode of the whole length (float32, greedy); each segment's first token comes from its
    prefill, so the steps commit all tokens but one a segment."""
    target, draft, pool = _pair_and_pool(6)
    loader = _Loader(target, _perturbed(target))
    plan = GatePlan(wave=6, segment=10, design=SequentialDesign(3, alpha=NEVER), budget_s=1e9, limit=0.10)
    looks = GateLooks(plan, pool, draft, progress=False)
    looks.go_on(_start(looks, loader))
    whole = measure_tau(target, draft, pool, 30, "whole", progress=False)
    assert looks.before.outputs == whole.outputs
    assert looks.before.committed == [30 - 3] * 6 and whole.committed == [30 - 1] * 6


def test_the_budget_stops_the_gate_before_a_look_that_would_overrun_it_and_names_the_flag():
    target, draft, pool = _pair_and_pool(6)
    loader = _Loader(target, _perturbed(target))
    plan = GatePlan(wave=6, segment=8, design=SequentialDesign(4, alpha=NEVER), budget_s=1e-3, limit=0.10)
    said: list[str] = []
    looks = GateLooks(plan, pool, draft, progress=False, say=said.append)
    verdict = looks.go_on(_start(looks, loader))
    assert verdict.look == 1 and looks.stopped == "budget" and loader.loads == ["before", "after"]
    with pytest.raises(DFlashError) as e:
        verdict_record(looks, "nvfp4", 1.0, False, said.append)
    line = str(e.value)
    assert "\n" not in line and line.startswith("acceptance gate inconclusive after look 1 of 4 (6 prompts x 8 tokens, ")
    assert "straddles the 10% limit; the time budget stopped it (gate.budget_s 0 s: look 2 would need ~" in line
    assert "buy more evidence with --gate-budget " in line and line.endswith(
        "or pass --accept-tau-drop to keep the engine")
    # kept by the flag: the record says so, and the same line is said
    record = verdict_record(looks, "nvfp4", 1.0, True, said.append)
    assert record["decision"] == "inconclusive" and record["accepted_by_flag"] and record["stopped"] == "budget"
    assert said[-1].endswith("; kept by --accept-tau-drop") and "--gate-budget" in said[-1]


def test_every_planned_look_taken_names_gate_looks_and_prompts():
    target, draft, pool = _pair_and_pool(4)
    loader = _Loader(target, _perturbed(target))
    plan = GatePlan(wave=4, segment=6, design=SequentialDesign(2, alpha=NEVER), budget_s=1e9, limit=0.10)
    looks = GateLooks(plan, pool, draft, progress=False)
    looks.go_on(_start(looks, loader))
    with pytest.raises(DFlashError, match=r"inconclusive after look 2 of 2 \(4 prompts x 12 tokens, .*all 2 planned "
                                          r"looks were taken; buy more evidence with --gate-looks 4 \(gate.max_looks; "
                                          r"each adds 6 tokens per prompt\)"):
        verdict_record(looks, "fp8", 1.0, False, lambda msg: None)


def test_a_pass_is_said_in_one_line_with_its_look_and_interval():
    target, draft, pool = _pair_and_pool(8)
    loader = _Loader(target, target)  # the same weights: no drop at all
    plan = GatePlan(wave=8, segment=8, design=SequentialDesign(4), budget_s=1e9, limit=0.10)
    said: list[str] = []
    looks = GateLooks(plan, pool, draft, progress=False)
    assert looks.go_on(_start(looks, loader)).decision == "pass"
    record = verdict_record(looks, "fp8", 1.0, False, said.append)
    assert record["looks"][0]["decision"] == "pass" and record["stopped"] == "decided"
    assert said == [said[0]] and said[0].startswith("acceptance gate passed at look 1 of 4 (8 prompts x 8 tokens, ")
    assert "drop +0.0% [+0.0%, +0.0%] (98.2% interval, 2.5% error each side over 4 looks) within the 10% limit" in said[0]


@pytest.mark.parametrize("lengths,tokens,cells", [([5, 9, 3, 40, 12, 7], 8, 6 * 48), ([5, 9, 3, 40, 12, 7], 24, 6 * 48),
                                                  ([100, 3], 10, 20), ([4] * 10, 4, 30)])
def test_cache_batches_cover_every_row_once_within_the_cells(lengths, tokens, cells):
    batches = cache_batches(lengths, tokens, cells)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + tokens) <= cells
    assert len(cache_batches(lengths, tokens, 10**9)) == 1
