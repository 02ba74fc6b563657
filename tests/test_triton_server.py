"""The repository `deploy triton` writes, served by the REAL tritonserver (2.51, Python backend),
reached with the real tritonclient (sync, streaming, aio) over loopback gRPC.

Answers are compared with the reference runtime called directly (greedy: token for token).
The two servers most tests use are shared by the session (tests/conftest.py: `triton_streaming`
is decoupled with policy fixed, `triton_unary` is not decoupled); tests that stop, overload or
configure a server start their own (tests/triton_servers.py). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from dflash_trt.engine.manifest import load_manifest
from dflash_trt.serving.client import build_inputs, generate, read_result
from dflash_trt.serving.repository import TritonRepoSettings
from dflash_trt.serving.triton_install import SERVER_VERSION
from tests.engine_fixtures import reference_answer, shared_tiny_engine
from tests.triton_servers import serve_engine

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello world", "The capital of France is", "Speculative decoding", "abc", "Paris",
           "how are you today?", "tokens", "Verify the block"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return shared_tiny_engine(tmp_path_factory)


@pytest.fixture
def url(triton_streaming) -> str:
    return triton_streaming.grpc_url


@pytest.fixture
def unary_url(triton_unary) -> str:
    return triton_unary.grpc_url


def _infer(url: str, **kw):
    with grpcclient.InferenceServerClient(url) as c:
        return c.infer("dflash", build_inputs(**kw), client_timeout=60)


def _stream(url: str, inputs, timeout: float = 60.0, cancel_after_first: bool = False, request_id: str = "r1"):
    """All (result, error) pairs of one streamed request, up to its final response."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    out = []
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer("dflash", inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout)
            out.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                break
            if cancel_after_first:
                break
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    return out


# -- the server is Triton ------------------------------------------------------------------------
def test_health_metadata_config_and_index_come_from_triton(url, unary_url, engine):
    with grpcclient.InferenceServerClient(unary_url) as c:
        assert not c.get_model_config("dflash").config.model_transaction_policy.decoupled
    with grpcclient.InferenceServerClient(url) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("dflash")
        assert not c.is_model_ready("nope")
        meta = c.get_server_metadata()
        assert (meta.name, meta.version) == ("triton", SERVER_VERSION) and "statistics" in meta.extensions
        mm = c.get_model_metadata("dflash")
        assert mm.platform == "python"
        assert {t.name: t.datatype for t in mm.inputs}["text_input"] == "BYTES"
        assert {t.name for t in mm.outputs} >= {"text_output", "tau", "acceptance_rate", "total_draft_tokens",
                                                "total_accepted_draft_tokens", "num_input_tokens"}
        cfg = c.get_model_config("dflash").config
        assert cfg.model_transaction_policy.decoupled and cfg.parameters["engine_dir"].string_value == str(engine.resolve())
        index = c.get_model_repository_index()
        assert [(m.name, m.state) for m in index.models] == [("dflash", "READY")]


# -- answers -------------------------------------------------------------------------------------
def test_unary_answer_equals_reference_with_consistent_stats(unary_url, engine):
    t0 = time.perf_counter()
    r = _infer(unary_url, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
    latency_ms = (time.perf_counter() - t0) * 1e3
    text, extra = read_result(r)
    assert 0 <= extra["queue_time_ms"] and 0 < extra["decode_time_ms"]
    assert extra["queue_time_ms"] + extra["decode_time_ms"] <= latency_ms
    assert text == reference_answer(engine, PROMPTS[1], MAX_TOKENS)
    assert extra["finish_reason"] in ("stop", "length")
    assert 1 <= extra["num_output_tokens"] <= MAX_TOKENS and extra["num_input_tokens"] > len(PROMPTS[1]) // 4
    assert 0 <= extra["total_accepted_draft_tokens"] <= extra["total_draft_tokens"]
    if extra["total_draft_tokens"]:
        assert extra["acceptance_rate"] == pytest.approx(extra["total_accepted_draft_tokens"] / extra["total_draft_tokens"])
    # tau = tokens per verification step (bonus included); the first token comes from prefill
    assert extra["num_steps"] >= 1
    assert extra["tau"] == pytest.approx((extra["num_output_tokens"] - 1) / extra["num_steps"], rel=1e-5)


def test_text_input_is_raw_text_as_upstream_and_formats_are_ours(unary_url, engine):
    """Upstream's llmapi model hands text_input to the engine as raw text: a client that sends no
    text_input_format gets the raw prompt's answer. "user" is one chat turn (what `dflash-trt
    generate` encodes), "messages" a JSON conversation through the same template."""
    raw = read_result(_infer(unary_url, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, text_input_format=None))[0]
    user = read_result(_infer(unary_url, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, text_input_format="user"))[0]
    messages = json.dumps([{"role": "user", "content": PROMPTS[0]}])
    conv = read_result(_infer(unary_url, prompt=messages, max_tokens=MAX_TOKENS, text_input_format="messages"))[0]
    assert raw == reference_answer(engine, PROMPTS[0], MAX_TOKENS, raw=True)
    assert user == conv == reference_answer(engine, PROMPTS[0], MAX_TOKENS)
    assert raw != user  # the template changes the answer, so the two ways cannot be confused


def test_streaming_is_incremental_and_equals_unary(url, unary_url):
    unary, _ = read_result(_infer(unary_url, prompt=PROMPTS[2], max_tokens=MAX_TOKENS))
    events = _stream(url, build_inputs(PROMPTS[2], max_tokens=MAX_TOKENS, stream=True))
    assert all(e is None for _, e in events)
    texts = [t for t in (read_result(r)[0] for r, _ in events) if t]
    assert len(set(texts)) > 1  # several pieces, not one blob
    # llmapi: each response holds the whole text so far (upstream's CompletionOutput.text)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == unary
    final = read_result(events[-1][0])[1]
    assert "finish_reason" in final and "tau" in final
    assert all("finish_reason" not in read_result(r)[1] for r, _ in events[:-1])


def test_client_helper_and_stop_strings(url, engine):
    full = reference_answer(engine, PROMPTS[0], MAX_TOKENS)
    streamed = generate(url, PROMPTS[0], stream=True, max_tokens=MAX_TOKENS, timeout_s=60)
    assert streamed.text == full and streamed.chunks >= 1
    stop = full[3:5]  # a stop string that really occurs in the answer
    cut = generate(url, PROMPTS[0], stream=True, max_tokens=MAX_TOKENS, stop=[stop], timeout_s=60)
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_aio_client(url, unary_url, engine):
    import tritonclient.grpc.aio as aioclient

    async def run():
        async with aioclient.InferenceServerClient(unary_url) as c:
            assert await c.is_server_ready()
            r = await c.infer("dflash", build_inputs(PROMPTS[3], max_tokens=MAX_TOKENS), client_timeout=60)
        async with aioclient.InferenceServerClient(url) as c:

            async def requests():
                yield {"model_name": "dflash", "inputs": build_inputs(PROMPTS[4], max_tokens=MAX_TOKENS, stream=True),
                       "request_id": "aio", "enable_empty_final_response": True}

            parts = []
            async for result, error in c.stream_infer(requests(), stream_timeout=60):
                assert error is None
                parts.append(read_result(result)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            return read_result(r)[0], max(parts, key=len)  # each response: the whole text so far

    unary, streamed = asyncio.run(asyncio.wait_for(run(), 90))
    assert unary == reference_answer(engine, PROMPTS[3], MAX_TOKENS)
    assert streamed == reference_answer(engine, PROMPTS[4], MAX_TOKENS)


def test_eight_concurrent_clients_get_their_own_answers(url, unary_url, engine):
    expected = {p: reference_answer(engine, p, MAX_TOKENS) for p in PROMPTS}
    assert len(set(expected.values())) >= 4, "prompts must give distinct answers for crosstalk to show"

    def one(i: int):
        p = PROMPTS[i]
        if i % 2:  # half stream on the decoupled server, half unary on the other
            return p, generate(url, p, stream=True, max_tokens=MAX_TOKENS, timeout_s=90, request_id=str(i)).text
        return p, generate(unary_url, p, stream=False, max_tokens=MAX_TOKENS, timeout_s=90, request_id=str(i)).text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8), timeout=100))
    for p, text in results:
        assert text == expected[p], p


def test_seeded_sampling_is_reproducible_and_matches_reference(url, engine):
    a = generate(url, PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7, timeout_s=60).text
    b = generate(url, PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7, timeout_s=60).text
    assert a == b == reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7)


def test_health_answers_while_sixteen_streams_run_and_each_gets_its_own_answer(url, engine):
    """16 streams decode long answers; meanwhile health, readiness and metadata answer within a
    second each, every time; then every stream's answer is the reference's."""
    budget = 120
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    expected = {p: reference_answer(engine, p, budget) for p in set(prompts)}
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(generate, url, p, stream=True, max_tokens=budget, timeout_s=150, request_id=f"h{i}")
                   for i, p in enumerate(prompts)]
        probes = []
        with grpcclient.InferenceServerClient(url) as c:
            while not all(f.done() for f in futures) or not probes:
                t0 = time.perf_counter()
                assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("dflash")
                assert c.get_model_metadata("dflash").name == "dflash"
                probes.append(time.perf_counter() - t0)
                time.sleep(0.1)
        texts = [f.result(timeout=150).text for f in futures]
    assert max(probes) < 1.0, probes
    assert texts == [expected[p] for p in prompts]


# -- bad requests ----------------------------------------------------------------------------------
def _raw_input(name: str, datatype: str, array: np.ndarray):
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def _text(values: list[bytes]):
    return _raw_input("text_input", "BYTES", np.array(values, dtype=np.object_))


def _bad_cases(engine):
    limit = load_manifest(engine).limits.max_seq_len
    ok = _text([b"hi"])
    fmt = _raw_input("text_input_format", "BYTES", np.array([b"messages"], dtype=np.object_))
    return [
        # Triton core's own checks (its words)
        ("missing text_input", "dflash", [_raw_input("sampling_param_max_tokens", "INT32", np.array([4], dtype=np.int32))],
         "INVALID_ARGUMENT", "text_input"),
        ("wrong datatype", "dflash", [ok, _raw_input("sampling_param_max_tokens", "FP32", np.array([4.0], dtype=np.float32))],
         "INVALID_ARGUMENT", "INT32"),
        ("unknown model", "nope", [ok], "", "nope"),
        # the model's (the project's one line each)
        ("two prompts", "dflash", [_text([b"a", b"b"])], "INVALID_ARGUMENT", "one prompt per request"),
        ("max_tokens 0", "dflash", [ok, _raw_input("sampling_param_max_tokens", "INT32", np.array([0], dtype=np.int32))],
         "INVALID_ARGUMENT", "max_tokens=0"),
        ("max_tokens too big", "dflash",
         [ok, _raw_input("sampling_param_max_tokens", "INT32", np.array([limit + 1], dtype=np.int32))],
         "INVALID_ARGUMENT", f"max_seq_len={limit}"),
        ("prompt too long", "dflash", [_text([("word " * limit).encode()])], "INVALID_ARGUMENT", "shorten the prompt"),
        ("temperature NaN", "dflash", [ok, _raw_input("sampling_param_temperature", "FP32", np.array([np.nan], dtype=np.float32))],
         "INVALID_ARGUMENT", "temperature=nan is not a finite number"),
        ("top_p 0", "dflash", [ok, _raw_input("sampling_param_top_p", "FP32", np.array([0.0], dtype=np.float32))],
         "INVALID_ARGUMENT", "top_p=0.0 must be in (0, 1]"),
        ("invalid utf-8", "dflash", [_text([b"caf\xff\xfe"])], "INVALID_ARGUMENT", "not valid UTF-8"),
        ("messages not JSON", "dflash", [ok, fmt], "INVALID_ARGUMENT", "not a JSON array of chat messages"),
        ("unknown format", "dflash",
         [ok, _raw_input("text_input_format", "BYTES", np.array([b"chat"], dtype=np.object_))],
         "INVALID_ARGUMENT", "text_input_format='chat'"),
    ]


def test_bad_unary_requests_get_clear_errors_and_server_keeps_serving(unary_url, engine):
    with grpcclient.InferenceServerClient(unary_url) as c:
        for what, model, inputs, status, fragment in _bad_cases(engine):
            with pytest.raises(InferenceServerException) as exc:
                c.infer(model, inputs, client_timeout=30)
            assert status in str(exc.value.status()), what
            assert fragment in exc.value.message(), (what, exc.value.message())
            assert "\n" not in exc.value.message() and "Traceback" not in exc.value.message()
        ok = c.infer("dflash", build_inputs("hi", max_tokens=4), client_timeout=30)
        assert read_result(ok)[1]["num_output_tokens"] >= 1


def test_bad_stream_requests_error_on_the_stream_which_stays_usable(url, engine):
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    cases = [case for case in _bad_cases(engine) if case[1] == "dflash"]
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        for i, (_, model, inputs, _, _) in enumerate(cases):
            c.async_stream_infer(model, inputs, request_id=f"bad{i}")
        c.async_stream_infer("dflash", build_inputs("hi", max_tokens=4), request_id="good",
                             enable_empty_final_response=True)
        errors, good = [], None
        while good is None or len(errors) < len(cases):
            result, error = got.get(timeout=60)
            if error is not None:
                errors.append(error.message())
            elif result.get_response().id == "good" and \
                    result.get_response().parameters["triton_final_response"].bool_param:
                good = result
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    for what, _, _, _, fragment in cases:
        assert sum(fragment in m for m in errors) >= 1, (what, errors)
    assert read_result(good)[1]["finish_reason"] in ("stop", "length")


def test_a_row_without_a_distribution_fails_alone_and_the_others_finish(url, engine):
    """temperature=1e-40 (a float32 subnormal: Triton's input is FP32) passes validation yet its
    tempered logits overflow: that request fails (one line naming the value) while the requests
    decoding beside it finish intact."""
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(generate, url, p, stream=True, max_tokens=MAX_TOKENS, timeout_s=60) for p in PROMPTS[:3]]
        bad = pool.submit(generate, url, PROMPTS[3], stream=True, max_tokens=MAX_TOKENS, temperature=1e-40,
                          timeout_s=60)
        with pytest.raises(Exception) as exc:
            bad.result(timeout=90)
        texts = [f.result(timeout=90).text for f in good]
    assert "temperature=" in str(exc.value) and "e-41" in str(exc.value) and "\n" not in str(exc.value)
    assert texts == [reference_answer(engine, p, MAX_TOKENS) for p in PROMPTS[:3]]


def test_a_dropped_client_frees_its_row_and_the_others_finish_identical(triton_streaming, url, engine):
    """Four streams; one client leaves after its first piece (stop_stream cancels its request).
    The model sees it (its cancelled counter moves, and its log says after how many tokens: far
    fewer than the long budget it asked for), and the other three answers are the reference's."""
    served = triton_streaming
    before = served.cancellations()
    budget = load_manifest(engine).limits.max_seq_len - 40
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(generate, url, p, stream=True, max_tokens=MAX_TOKENS, timeout_s=60) for p in PROMPTS[4:7]]
        events = _stream(url, build_inputs(PROMPTS[0], max_tokens=budget, stream=True), cancel_after_first=True,
                         request_id="leaver")
        texts = [f.result(timeout=90).text for f in others]
    assert events and events[0][1] is None
    assert texts == [reference_answer(engine, p, MAX_TOKENS) for p in PROMPTS[4:7]]
    produced = served.tokens_before_cancel("leaver", before)
    assert produced and produced[-1] < budget // 2, produced
    assert generate(url, "hi", max_tokens=4, timeout_s=30).stats["num_output_tokens"] >= 1


def test_unary_call_with_stream_true_is_refused_not_hung(unary_url):
    """Upstream's llmapi model.py: streaming on a model that is not decoupled is an error."""
    with grpcclient.InferenceServerClient(unary_url) as c, pytest.raises(InferenceServerException) as exc:
        c.infer("dflash", build_inputs(PROMPTS[0], max_tokens=MAX_TOKENS, stream=True), client_timeout=60)
    assert "Streaming is only supported in decoupled mode." in exc.value.message()


def test_unary_infer_on_a_decoupled_model_is_refused_by_triton(url):
    with grpcclient.InferenceServerClient(url) as c, pytest.raises(InferenceServerException) as exc:
        c.infer("dflash", build_inputs(PROMPTS[0], max_tokens=MAX_TOKENS), client_timeout=60)
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in exc.value.message()


# -- servers of their own ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_small_queue(engine, tmp_path_factory):
    """A decoupled repository with max_queue=1 and draft_method greedy (not the default), for the
    two tests that need those settings."""
    served = serve_engine(engine, tmp_path_factory.mktemp("greedy-small-queue"),
                          TritonRepoSettings(decoupled=True, max_queue=1, draft_method="greedy"), http=False,
                          metrics=False, openai=False)
    yield served
    served.stop()


def test_a_full_queue_answers_unavailable_and_the_admitted_finish(greedy_small_queue, engine):
    """max_queue=1: of a burst of 16 requests on one stream, those that find the runtime's queue
    full get UNAVAILABLE (the model's one line naming the limit); every other is answered in full."""
    served = greedy_small_queue
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        for i in range(16):
            c.async_stream_infer("dflash", build_inputs(PROMPTS[i % 8], max_tokens=MAX_TOKENS), request_id=f"q{i}",
                                 enable_empty_final_response=True)
        finals, errors = {}, []
        while len(finals) + len(errors) < 16:
            result, error = got.get(timeout=90)
            if error is not None:
                errors.append(error.message())
            elif result.get_response().parameters["triton_final_response"].bool_param:
                finals[result.get_response().id] = read_result(result)[0]
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    assert errors and all("requests already queued (max 1)" in e for e in errors), errors
    assert finals and all(text == reference_answer(engine, PROMPTS[int(rid[1:]) % 8], MAX_TOKENS)
                          for rid, text in finals.items())


def test_the_repositorys_draft_method_reaches_the_served_runtime(greedy_small_queue, engine):
    """model.py hands the repository's draft_method to the backend: a seeded sampled answer is the
    reference loop's under that method (greedy, not the default, so that dropping it shows)."""
    text = generate(greedy_small_queue.grpc_url, PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                    timeout_s=60).text
    assert text == reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7, draft_method="greedy")
    assert text != reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7)  # the default's


def test_stop_finishes_in_flight_requests_then_everything_is_gone(engine, tmp_path):
    """Graceful shutdown: a request in flight when the server is stopped still gets its full answer
    (Triton's exit timeout); then the ports answer nothing and no stub of the server is alive."""
    import psutil

    served = serve_engine(engine, tmp_path, TritonRepoSettings(decoupled=True), http=False, metrics=False,
                          openai=False, exit_timeout_s=30)
    u = served.grpc_url
    group = [p for p in psutil.Process(served.server.process.pid).children(recursive=True)]
    assert any("triton_python_backend_stub" in " ".join(p.cmdline()) for p in group), "no stub seen"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=generate(u, PROMPTS[1], stream=True, max_tokens=120,
                                                               timeout_s=60)))
    t.start()
    time.sleep(0.3)
    served.stop()
    t.join(60)
    assert box["r"].text == reference_answer(engine, PROMPTS[1], 120)
    with pytest.raises(InferenceServerException):
        with grpcclient.InferenceServerClient(u) as c:
            c.is_server_live(client_timeout=2)
    assert not [p for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
