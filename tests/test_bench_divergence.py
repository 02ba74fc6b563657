"""Where an output departs from the reference, and the target's logit margin there (bench/divergence.py):
what bench reports beside its identical count, so bfloat16 rounding (near-ties) can be told from a
real loss."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.bench.divergence import departures, describe, first_divergence, logit_margins
from dflash_trt.bench.report import _identical_cell
from dflash_trt.runtime import autoregressive_generate
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.sampling_params import SamplingParams


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([5], [1, 2, 3]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # ended early (a stop token): departs where it ends
    assert first_divergence([1, 2, 3, 9], [1, 2, 3]) == 3


def _step_by_step_margins(target, prompt: list[int], out: list[int]) -> list[float]:
    """The margins as plain decoding sees them: one forward per output token over the growing cache."""
    adapter = TargetAdapter(target)
    cache = adapter.new_cache()
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]
    margins = []
    with torch.inference_mode():
        for tok in out:
            logits, _ = adapter.forward(ids, pos, cache, logits_to_keep=1)
            top = logits[0, -1].float().topk(2).values
            margins.append(float(top[0] - top[1]))
            ids, pos = torch.tensor([[tok]]), pos[:, -1:] + 1
    return margins


def test_margins_are_the_targets_top1_minus_top2_along_the_reference():
    target = tiny_target("qwen3", seed=3).double()
    prompt = [5, 9, 2, 7]
    ref = autoregressive_generate(target, prompt, SamplingParams(max_tokens=10)).output_ids
    got = logit_margins(target, prompt, ref)
    assert len(got) == len(ref) and all(m >= 0 for m in got)
    assert got == pytest.approx(_step_by_step_margins(target, prompt, ref), abs=1e-9)


def test_departures_name_the_position_and_the_margin_there():
    target = tiny_target("llama", seed=4).double()
    prompts = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
    ref = {pid: autoregressive_generate(target, p, SamplingParams(max_tokens=8)).output_ids for pid, p in prompts.items()}
    b_changed = list(ref["b"])
    b_changed[5] = (b_changed[5] + 1) % 100  # a run whose output departs at position 5
    outputs = [("a", ref["a"]), ("b", b_changed), ("c", ref["c"][:3])]
    deps = departures(outputs, ref, lambda pid: logit_margins(target, prompts[pid], ref[pid]))
    margins_b = _step_by_step_margins(target, prompts["b"], ref["b"])
    margins_c = _step_by_step_margins(target, prompts["c"], ref["c"])
    assert deps == [{"prompt_id": "c", "position": 3, "margin": pytest.approx(margins_c[3], abs=1e-4)},
                    {"prompt_id": "b", "position": 5, "margin": pytest.approx(margins_b[5], abs=1e-4)}]
    ident = {"checked": 3, "identical": 1, "departures": deps}
    worst = max(round(margins_b[5], 4), round(margins_c[3], 4))
    assert _identical_cell(ident) == f"1/3 (from 3, margin <= {worst:.2f})"
    assert _identical_cell({"checked": 3, "identical": 3, "departures": []}) == "3/3"
    assert describe([{"prompt_id": "x", "position": 2, "margin": None}]) == "from 2"  # an endpoint: no model
