"""The project's prompt sets: enough prompts per category, and eval never leaks into training."""

from __future__ import annotations

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.prompts import CATEGORIES, interleave, load_prompts
from dflash_trt.prompts.build import build


def test_each_category_has_40_prompts_and_disjoint_splits():
    for cat in CATEGORIES:
        rows = load_prompts(categories=[cat])
        train = {p.prompt for p in rows if p.split == "train"}
        evals = {p.prompt for p in rows if p.split == "eval"}
        gate = {p.prompt for p in rows if p.split == "gate"}
        assert len(rows) >= 40 and len(train) >= 30 and len(evals) >= 10 and len(gate) >= 30, cat
        assert not train & evals, f"{cat}: eval prompts also in train"
        assert not gate & (train | evals), f"{cat}: gate prompts also in train or eval"
        assert len({p.id for p in rows}) == len(rows)
        assert all(p.category == cat and p.prompt.strip() for p in rows)


def test_committed_files_match_the_builder():
    """The jsonl files are what `python -m dflash_trt.prompts.build` writes (no hand edits)."""
    built = build()
    for cat in CATEGORIES:
        assert [(r["id"], r["split"], r["prompt"]) for r in built[cat]] == \
               [(p.id, p.split, p.prompt) for p in load_prompts(categories=[cat])]


def test_interleave_covers_every_category_early_and_loses_nothing():
    evals = load_prompts("eval")
    mixed = interleave(evals)
    assert {p.category for p in mixed[:3]} == set(CATEGORIES)
    assert sorted(p.id for p in mixed) == sorted(p.id for p in evals)


def test_bad_split_or_category_is_one_line_error():
    with pytest.raises(DFlashError, match="unknown prompt split"):
        load_prompts("test")
    with pytest.raises(DFlashError, match="unknown prompt category"):
        load_prompts(categories=["poetry"])


def test_the_gate_decodes_the_eval_prompts_first_then_the_gate_split():
    """Look 1 of the acceptance gate is the eval split, as before the gate split existed; the later
    looks' waves are the gate split, every category in each wave."""
    from dflash_trt.engine.calibration import load_calibration_prompts

    held_out = load_calibration_prompts(None, 10**6, split="held-out")
    evals = [p.prompt for p in interleave(load_prompts("eval"))]
    gate = interleave(load_prompts("gate"))
    assert held_out == evals + [p.prompt for p in gate] and len(held_out) == 156
    assert {p.category for p in gate[:39]} == set(CATEGORIES)
