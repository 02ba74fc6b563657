"""The server's pytorch backend decodes concurrent requests in shared passes (the batched
runtime) and still answers each exactly as the reference loop alone would (greedy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

try:
    from tests.engine_fixtures import reference_answer, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import reference_answer, shared_tiny_engine

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.serving.backends import BackendSettings, load_backend
from dflash_trt.serving.protocol import GenerateRequest

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello world", "The capital of France is", "Speculative decoding", "abc", "Paris", "tokens"]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_backend(engine, BackendSettings(backend="pytorch"))
    yield engine, rt
    rt.shutdown()


def test_concurrent_requests_share_passes_and_get_their_own_answers(runtime):
    engine, rt = runtime
    assert rt.why_serial is None and rt.runtime.max_batch >= 4
    max_tokens = [24, 7, 30, 12, 24, 3]
    expected = [reference_answer(engine, p, m) for p, m in zip(PROMPTS, max_tokens)]
    steps_before = rt.runtime.steps
    # submit everything first, then read: the scheduler admits them into one running batch
    gens = [rt.submit(GenerateRequest(p, params=SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, max_tokens)]
    with ThreadPoolExecutor(len(gens)) as pool:
        answers = list(pool.map(lambda g: g.text(), gens, timeout=100))
    for (text, last), want, m in zip(answers, expected, max_tokens):
        assert text == want
        assert last.finished and last.stats.num_output_tokens <= m
    decisions = list(rt.runtime.policy.decisions)
    assert max(d.batch for d in decisions) >= 2  # passes were shared
    assert rt.runtime.steps - steps_before < sum(max_tokens)  # fewer passes than tokens
    assert "position_acceptance" in rt.runtime_stats()


def test_seeded_sample_is_the_same_under_load(runtime):
    engine, rt = runtime
    req = GenerateRequest(PROMPTS[1], params=SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    alone = rt.submit(req).text()[0]
    noise = [rt.submit(GenerateRequest(p, params=SamplingParams(max_tokens=20))) for p in PROMPTS[2:5]]
    loaded = rt.submit(req)
    assert loaded.text()[0] == alone == reference_answer(engine, PROMPTS[1], 20, temperature=1.0, seed=3)
    for g in noise:
        g.text()


def test_cancelled_request_leaves_the_batch(runtime):
    _, rt = runtime
    long = rt.submit(GenerateRequest(PROMPTS[0], params=SamplingParams(max_tokens=150)))
    short = rt.submit(GenerateRequest(PROMPTS[2], params=SamplingParams(max_tokens=10)))
    next(iter(long))  # first chunk arrived: it is running
    long.cancel()
    text, last = short.text()
    assert last.finished and last.finish_reason in ("stop", "length")
    final = [c for c in long if c.finished]
    assert final and final[-1].finish_reason == "cancelled"


def test_fixed_policy_setting_pins_the_draft_length(tmp_path_factory):
    """`policy: fixed` (repository setting) makes the server draft K = the manifest's max_draft_len
    tokens every step, as the reference loop does; the serving default, adaptive, may choose fewer."""
    from dflash_trt.runtime.batched.policy import AdaptivePolicy, FixedPolicy

    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_backend(engine, BackendSettings(backend="pytorch", policy="fixed"))
    try:
        assert isinstance(rt.runtime.policy, FixedPolicy)
        assert rt.runtime.policy.choose(1, 99).k == rt.draft.block_size - 1 == rt.speculation.max_draft_len
    finally:
        rt.shutdown(cancel_pending=True)
    rt = load_backend(engine, BackendSettings(backend="reference"))  # the old name of pytorch
    try:
        assert rt.backend == "pytorch" and isinstance(rt.runtime.policy, AdaptivePolicy)
    finally:
        rt.shutdown(cancel_pending=True)


@pytest.mark.parametrize("torch_compile", [False, True], ids=["eager", "compiled"])
def test_cuda_graphs_setting_serves_static_shapes_with_the_same_answers(tmp_path_factory, torch_compile):
    """`cuda_graphs: true` (repository setting) reaches the batched runtime: its passes run in static
    shapes (on CPU eagerly; graphs need a GPU) and concurrent answers stay the reference loop's; with
    `torch_compile: true` too, through the compiled layers (Inductor's CPU backend here)."""
    from dflash_trt.runtime.gpu.compiled_layers import compile_unavailable

    if torch_compile and compile_unavailable(torch.device("cpu")):
        pytest.skip(compile_unavailable(torch.device("cpu")))
    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_backend(engine, BackendSettings(backend="pytorch", cuda_graphs=True, torch_compile=torch_compile))
    try:
        graphs = rt.runtime.graph_stats()  # CPU: the static passes run eagerly, no CUDA graph
        assert rt.runtime.static_shapes and not graphs["cuda_graphs"] and graphs["captured"] > 0
        assert graphs["torch_compile"] is torch_compile
        max_tokens = [9, 16, 5]
        gens = [rt.submit(GenerateRequest(p, params=SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS[:3], max_tokens)]
        with ThreadPoolExecutor(len(gens)) as pool:
            answers = [text for text, _ in pool.map(lambda g: g.text(), gens, timeout=100)]
        assert answers == [reference_answer(engine, p, m) for p, m in zip(PROMPTS[:3], max_tokens)]
        assert rt.runtime.graph_stats()["misses"] == 0  # every shape was captured before serving
    finally:
        rt.shutdown(cancel_pending=True)


def test_pairs_the_batched_runtime_cannot_run_go_through_the_same_scheduler_one_at_a_time(tmp_path):
    """gpt-oss (sliding window, attention sinks): the pytorch backend falls back to the reference
    loop behind the batched runtime's interface (runtime/reference/serial.py), driven by the same scheduler:
    concurrent requests queue and each gets the reference answer; a request cancelled while queued
    never runs, one cancelled while running stops at its next step; both end `cancelled`."""
    from tests.engine_fixtures import make_tiny_engine

    engine = make_tiny_engine(tmp_path, arch="gpt_oss", block_size=4)
    rt = load_backend(engine, BackendSettings(backend="pytorch"))
    try:
        assert "gpt_oss" in rt.why_serial and "reference loop" in rt.describe()
        max_tokens = [6, 9, 4]
        gens = [rt.submit(GenerateRequest(p, params=SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, max_tokens)]
        with ThreadPoolExecutor(len(gens)) as pool:
            answers = list(pool.map(lambda g: g.text(), gens, timeout=100))
        for (text, last), p, m in zip(answers, PROMPTS, max_tokens):
            assert text == reference_answer(engine, p, m)
            assert last.finish_reason in ("stop", "length") and last.stats.num_output_tokens <= m
        assert max(last.stats.queue_s for _, last in answers) > 0  # one at a time: some request waited

        running = rt.submit(GenerateRequest(PROMPTS[0], params=SamplingParams(max_tokens=200)))
        queued = rt.submit(GenerateRequest(PROMPTS[1], params=SamplingParams(max_tokens=5)))
        it = iter(running)
        next(it)  # it is decoding
        queued.cancel()
        running.cancel()
        final = [c for c in it if c.finished][-1]
        assert final.finish_reason == "cancelled" and final.stats.num_output_tokens < 200
        text, last = queued.text()
        assert text == "" and last.finish_reason == "cancelled" and last.stats.num_output_tokens == 0
    finally:
        rt.shutdown()
