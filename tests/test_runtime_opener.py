"""The one way to open a runtime (runtime/opener.py): the batched runtime, started, where it can run
the pair; the reference loop where it cannot, with the reason kept and said once in the log; and
start-up as a named step the opener runs (BatchedRuntime.start), never a side effect of building.

Tiny random pairs: a Llama target (the batched runtime runs it) and a gpt-oss one (sliding
window and attention sinks: it does not)."""

from __future__ import annotations

import logging

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
from dflash_trt.runtime.reference.generate import dflash_generate
from dflash_trt.runtime.opener import open_runtime
from dflash_trt.runtime.reference.serial import SerialRuntime
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]


def _llama():
    target = tiny_target("llama", seed=3)
    return target, random_draft(target.config, block_size=4, seed=3)


def _gpt_oss():
    target = tiny_target("gpt_oss", seed=0)
    return target, random_draft(target.config, block_size=4)


def _ours(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dflash_trt.runtime"]


def _decode(runtime, prompts, max_tokens=10):
    seqs = [runtime.add(SequenceRequest(p, SamplingParams(max_tokens=max_tokens))) for p in prompts]
    while runtime.has_work():
        runtime.step()
    return [s.result.output_ids for s in seqs]


def test_the_batched_runtime_where_it_can_run_started(caplog):
    target, draft = _llama()
    with caplog.at_level(logging.INFO, logger="dflash_trt.runtime"):
        rt = open_runtime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=True))
    assert isinstance(rt, BatchedRuntime) and rt.started and not _ours(caplog)
    assert rt.graphs.counters.captured > 0  # every static shape, at start-up (eagerly on a CPU)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=10)).output_ids for p in PROMPTS]
    assert _decode(rt, PROMPTS) == ref and rt.graphs.counters.misses == 0


def test_start_up_is_a_named_step_not_a_side_effect_of_building():
    target, draft = _llama()
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=True))
    assert not rt.started and rt.graphs.counters.captured == 0  # building allocates, captures nothing
    rt.add(SequenceRequest(PROMPTS[0], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match=r"start\(\) must run before the first step"):
        rt.step()
    assert rt.start() is rt and rt.start().graphs.counters.captured == rt.graphs.counters.captured  # idempotent
    eager = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64))
    assert eager.started  # eager passes, no compiled layers: nothing to start


def test_the_reference_loop_where_it_cannot_with_the_reason_said_once(caplog):
    target, draft = _gpt_oss()
    spec = SpeculationSettings.for_block(draft.block_size, policy="adaptive")
    with caplog.at_level(logging.INFO, logger="dflash_trt.runtime"):
        rt = open_runtime(target, draft, RuntimeOptions(max_seq_len=64, torch_compile=True), spec)
    assert isinstance(rt, SerialRuntime) and "gpt_oss" in rt.reason
    assert rt.speculation.policy == "fixed" and rt.max_batch == 1 and rt.max_seq_len == 64
    lines = [r.getMessage() for r in _ours(caplog)]
    assert len(lines) == 1 and _ours(caplog)[0].levelno == logging.WARNING
    assert rt.reason in lines[0] and "policy adaptive" in lines[0] and "torch_compile" in lines[0]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=10), spec.replace(policy="fixed")).output_ids
           for p in PROMPTS]
    assert _decode(rt, PROMPTS) == ref


def test_a_fallback_that_loses_nothing_is_said_at_info(caplog):
    target, draft = _gpt_oss()
    with caplog.at_level(logging.INFO, logger="dflash_trt.runtime"):
        open_runtime(target, draft, RuntimeOptions(max_seq_len=64))
    assert [r.levelno for r in _ours(caplog)] == [logging.INFO]
    assert "not applied" not in _ours(caplog)[0].getMessage()


def test_a_pinned_choice():
    target, draft = _gpt_oss()
    with pytest.raises(DFlashError, match="batched runtime: gpt_oss .*; use dflash_generate"):
        open_runtime(target, draft, RuntimeOptions(max_seq_len=64), choice="batched")
    with pytest.raises(DFlashError, match="batched runtime: gpt_oss"):  # no reference loop decodes without a drafter
        open_runtime(target, None, RuntimeOptions(max_seq_len=64))
    with pytest.raises(DFlashError, match="batched runtime: gpt_oss"):  # nor captures features
        open_runtime(target, draft, RuntimeOptions(max_seq_len=64), extras=RuntimeExtras(capture_layer_ids=(0,)))
    llama, llama_draft = _llama()
    rt = open_runtime(llama, llama_draft, RuntimeOptions(max_seq_len=64), choice="reference")
    assert isinstance(rt, SerialRuntime) and rt.reason == "the reference loop was asked for"


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_every_draft_method_opens_the_batched_runtime(method, caplog):
    """The batched runtime verifies sampled steps by the settings' draft method (rejection sampling
    for these two; tests/test_batched_dflash2.py checks the draws), so no method routes a pair to
    the reference loop any more."""
    target, draft = _llama()
    spec = SpeculationSettings.for_block(draft.block_size, draft_method=method)
    with caplog.at_level(logging.INFO, logger="dflash_trt.runtime"):
        rt = open_runtime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64), spec)
    assert isinstance(rt, BatchedRuntime) and rt.speculation.draft_method == method and not _ours(caplog)
