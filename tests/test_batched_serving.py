"""The server's reference runtime decodes concurrent requests in shared passes (the batched
runtime) and still answers each exactly as the reference loop alone would (greedy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

try:
    from tests.engine_fixtures import reference_answer, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import reference_answer, shared_tiny_engine

from dflash_trt.serving.engine_runtime import GenerateRequest, load_engine_runtime

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello world", "The capital of France is", "Speculative decoding", "abc", "Paris", "tokens"]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_engine_runtime(engine, backend="reference")
    yield engine, rt
    rt.shutdown()


def test_concurrent_requests_share_passes_and_get_their_own_answers(runtime):
    engine, rt = runtime
    assert rt.batched is not None and rt.batched.max_batch >= 4
    max_tokens = [24, 7, 30, 12, 24, 3]
    expected = [reference_answer(engine, p, m) for p, m in zip(PROMPTS, max_tokens)]
    steps_before = rt.batched.steps
    # submit everything first, then read: the scheduler admits them into one running batch
    gens = [rt.submit(GenerateRequest(p, max_tokens=m)) for p, m in zip(PROMPTS, max_tokens)]
    with ThreadPoolExecutor(len(gens)) as pool:
        answers = list(pool.map(lambda g: g.text(), gens, timeout=100))
    for (text, last), want, m in zip(answers, expected, max_tokens):
        assert text == want
        assert last.finished and last.stats.num_output_tokens <= m
    decisions = list(rt.batched.policy.decisions)
    assert max(d.batch for d in decisions) >= 2  # passes were shared
    assert rt.batched.steps - steps_before < sum(max_tokens)  # fewer passes than tokens
    assert "position_acceptance" in rt.runtime_stats()


def test_seeded_sample_is_the_same_under_load(runtime):
    engine, rt = runtime
    req = GenerateRequest(PROMPTS[1], max_tokens=20, temperature=1.0, seed=3)
    alone = rt.submit(req).text()[0]
    noise = [rt.submit(GenerateRequest(p, max_tokens=20)) for p in PROMPTS[2:5]]
    loaded = rt.submit(req)
    assert loaded.text()[0] == alone == reference_answer(engine, PROMPTS[1], 20, temperature=1.0, seed=3)
    for g in noise:
        g.text()


def test_cancelled_request_leaves_the_batch(runtime):
    _, rt = runtime
    long = rt.submit(GenerateRequest(PROMPTS[0], max_tokens=150))
    short = rt.submit(GenerateRequest(PROMPTS[2], max_tokens=10))
    next(iter(long))  # first chunk arrived: it is running
    long.cancel()
    text, last = short.text()
    assert last.finished and last.finish_reason in ("stop", "length")
    final = [c for c in long if c.finished]
    assert final and final[-1].finish_reason == "cancelled"


def test_full_speculation_setting_pins_the_draft_length(tmp_path_factory):
    """`speculation: full` (repository setting) makes the server draft block_size - 1 tokens every
    step, as the reference loop does; the default adaptive policy may choose fewer."""
    from dflash_trt.runtime.policy import FixedPolicy
    from dflash_trt.serving.engine_runtime import load_engine_runtime
    from tests.engine_fixtures import shared_tiny_engine

    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_engine_runtime(engine, backend="reference", speculation="full")
    try:
        assert isinstance(rt.batched.policy, FixedPolicy)
        assert rt.batched.policy.choose(1, 99).k == rt.draft.block_size - 1
    finally:
        rt.shutdown(cancel_pending=True)
    rt = load_engine_runtime(engine, backend="reference")
    try:
        assert not isinstance(rt.batched.policy, FixedPolicy)
    finally:
        rt.shutdown(cancel_pending=True)


def test_cuda_graphs_setting_serves_static_shapes_with_the_same_answers(tmp_path_factory):
    """`cuda_graphs: true` (repository setting) reaches the batched runtime: its passes run in static
    shapes (on CPU eagerly; graphs need a GPU) and concurrent answers stay the reference loop's."""
    engine = shared_tiny_engine(tmp_path_factory)
    rt = load_engine_runtime(engine, backend="reference", cuda_graphs=True)
    try:
        assert rt.batched.static_shapes and rt.batched.graphs is None  # CPU: no capture
        max_tokens = [9, 16, 5]
        gens = [rt.submit(GenerateRequest(p, max_tokens=m)) for p, m in zip(PROMPTS[:3], max_tokens)]
        with ThreadPoolExecutor(len(gens)) as pool:
            answers = [text for text, _ in pool.map(lambda g: g.text(), gens, timeout=100)]
        assert answers == [reference_answer(engine, p, m) for p, m in zip(PROMPTS[:3], max_tokens)]
    finally:
        rt.shutdown(cancel_pending=True)
