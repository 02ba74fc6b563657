"""The acceptance gate on the batched runtime (engine/gate.py): every prompt of the sample decodes
together, and each prompt's tau (committed tokens and steps, drafted and accepted) is the
reference loop's, in float32. The gate's interval and decision read those per-prompt figures,
so equal figures mean the same decision. The embedded pair's check is in test_embedded_drafter.py;
scripts/bench_gate.py times both over the default sample."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.engine.gate import decide, measure_tau
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.tiny import random_draft, tiny_target

LENGTHS = (3, 7, 12, 5, 20, 9, 1, 15)


def _sample(arch: str, vocab: int, seed: int):
    target = tiny_target(arch, seed=seed, vocab_size=vocab)  # float32
    draft = random_draft(target.config, block_size=4, seed=seed, mask_token_id=vocab - 1)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    return target, draft, prompts


# small vocabularies: a random drafter is accepted often enough that tau differs from prompt to prompt
@pytest.mark.parametrize("arch,vocab,seed", [("qwen3", 8, 0), ("qwen3", 16, 2), ("qwen3", 16, 1)])
def test_each_prompt_gets_the_reference_loops_tau_in_float32(arch, vocab, seed):
    target, draft, prompts = _sample(arch, vocab, seed)
    ref = measure_tau(target, draft, prompts, 24, "reference", progress=False, batched=False)
    got = measure_tau(target, draft, prompts, 24, "batched", progress=False)  # the opener's choice
    # the two sides are two runtimes: the gate's default is the batched one (else this compares a loop with itself)
    assert got.runtime == got.summary()["runtime"] == "batched"
    assert ref.runtime == "reference loop (the reference loop was asked for)"
    assert (got.committed, got.steps) == (ref.committed, ref.steps)
    assert (got.drafted, got.accepted) == (ref.drafted, ref.accepted)
    assert len(set(ref.steps)) > 2  # tau differs between prompts: the comparison means something
    k2 = measure_tau(target, draft, prompts, 24, "batched k=2", progress=False, max_draft_len=2)
    k2_ref = measure_tau(target, draft, prompts, 24, "reference k=2", progress=False, max_draft_len=2, batched=False)
    assert (k2.runtime, k2_ref.runtime) == (got.runtime, ref.runtime)
    assert (k2.committed, k2.steps, k2.drafted) == (k2_ref.committed, k2_ref.steps, k2_ref.drafted)
    assert _figures(decide(ref, k2_ref, "k=2", 0.5, True, 1.0)) == _figures(decide(got, k2, "k=2", 0.5, True, 1.0))


def _figures(record: dict) -> dict:
    """The gate's record without the names of the runtimes that measured it."""
    return {**record, "before": {**record["before"], "runtime": None}, "after": {**record["after"], "runtime": None}}


def test_pairs_the_batched_runtime_cannot_run_keep_the_reference_loop():
    target = tiny_target("gpt_oss", seed=0)
    draft = random_draft(target.config, block_size=4, seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    auto = measure_tau(target, draft, prompts, 8, "gpt-oss", progress=False)
    ref = measure_tau(target, draft, prompts, 8, "gpt-oss", progress=False, batched=False)
    assert auto.runtime == "reference loop (gpt_oss (attention sinks, sliding window) runs on the reference loop)"
    assert (auto.committed, auto.steps) == (ref.committed, ref.steps)
    with pytest.raises(DFlashError, match="reference loop"):
        measure_tau(target, draft, prompts, 8, "gpt-oss", progress=False, batched=True)
