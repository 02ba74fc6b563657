"""`dflash-trt serve` with the REAL tritonclient (sync, streaming, aio) over loopback gRPC.

The server hosts the repository `deploy triton` writes and runs its model.py through the
Python-backend interface, so these tests exercise the file tritonserver would run. Answers are
compared with the reference runtime called directly (greedy: token for token). Every server is
on ephemeral ports and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

try:
    from tests.engine_fixtures import reference_answer, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import reference_answer, shared_tiny_engine

from dflash_trt.engine.manifest import load_manifest
from dflash_trt.serving.client import build_inputs, generate, read_result
from dflash_trt.serving.repository import TritonRepoSettings, generate_repository
from dflash_trt.serving.server import TritonGrpcServer

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello world", "The capital of France is", "Speculative decoding", "abc", "Paris",
           "how are you today?", "tokens", "Verify the block"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return shared_tiny_engine(tmp_path_factory)


DECOUPLED = TritonRepoSettings(decoupled=True)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """A DECOUPLED repository (`deploy triton --decoupled`): the only kind that streams."""
    repo = generate_repository(engine, tmp_path_factory.mktemp("serve") / "repo", DECOUPLED)
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=0).start()
    yield srv
    srv.stop(grace=2.0)


@pytest.fixture(scope="module")
def unary_server(engine, tmp_path_factory):
    """The default repository: not decoupled, as upstream's model.yaml; answers unary ModelInfer."""
    repo = generate_repository(engine, tmp_path_factory.mktemp("serve-unary") / "repo")
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=0).start()
    yield srv
    srv.stop(grace=2.0)


@pytest.fixture
def url(server) -> str:
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture
def unary_url(unary_server) -> str:
    return f"127.0.0.1:{unary_server.grpc_port}"


def _final_text(events) -> str:
    """The answer of a streamed request: each llmapi response holds the whole text so far."""
    texts = [read_result(r)[0] for r, _ in events]
    return max(texts, key=len)


def _infer(url: str, **kw):
    with grpcclient.InferenceServerClient(url) as c:
        return c.infer("dflash", build_inputs(**kw), client_timeout=60)


def _stream(url: str, inputs, timeout: float = 60.0, cancel_after_first: bool = False):
    """All (result, error) pairs of one streamed request, up to its final response."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    out = []
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer("dflash", inputs, request_id="r1", enable_empty_final_response=True)
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


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# -- protocol ----------------------------------------------------------------------------------
def test_health_metadata_config_and_index(url, unary_url, engine):
    with grpcclient.InferenceServerClient(unary_url) as c:
        assert not c.get_model_config("dflash").config.model_transaction_policy.decoupled
    with grpcclient.InferenceServerClient(url) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("dflash")
        assert not c.is_model_ready("nope")
        meta = c.get_server_metadata()
        assert meta.name == "dflash-trt" and "statistics" in meta.extensions
        mm = c.get_model_metadata("dflash")
        assert {t.name: t.datatype for t in mm.inputs}["text_input"] == "BYTES"
        assert {t.name for t in mm.outputs} >= {"text_output", "tau", "acceptance_rate", "total_draft_tokens",
                                                     "total_accepted_draft_tokens"}
        cfg = c.get_model_config("dflash").config
        assert cfg.model_transaction_policy.decoupled and cfg.parameters["engine_dir"].string_value == str(engine.resolve())
        index = c.get_model_repository_index()
        assert [(m.name, m.state) for m in index.models] == [("dflash", "READY")]


def test_unary_answer_equals_reference_with_consistent_stats(unary_url, engine):
    t0 = time.perf_counter()
    r = _infer(unary_url, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
    latency_ms = (time.perf_counter() - t0) * 1e3
    text, extra = read_result(r)
    assert 0 <= extra["queue_time_ms"] and 0 < extra["decode_time_ms"]
    assert extra["queue_time_ms"] + extra["decode_time_ms"] <= latency_ms
    assert text == reference_answer(engine, PROMPTS[1], MAX_TOKENS)
    assert extra["finish_reason"] in ("stop", "length")
    assert 1 <= extra["num_output_tokens"] <= MAX_TOKENS
    assert 0 <= extra["total_accepted_draft_tokens"] <= extra["total_draft_tokens"]
    assert extra["acceptance_rate"] == pytest.approx(extra["total_accepted_draft_tokens"] / extra["total_draft_tokens"])
    # tau = tokens per verification step (bonus included); the first token comes from prefill
    steps = extra["num_output_tokens"] - 1 - extra["total_accepted_draft_tokens"]
    if steps > 0 and extra["finish_reason"] == "length":
        assert extra["tau"] == pytest.approx(1 + extra["total_accepted_draft_tokens"] / steps, rel=1e-5)


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
        if i % 2:  # half stream, half unary: both paths share the runtime queue
            return p, generate(url, p, stream=True, max_tokens=MAX_TOKENS, timeout_s=90, request_id=str(i)).text
        return p, generate(url, p, stream=False, max_tokens=MAX_TOKENS, timeout_s=90, request_id=str(i)).text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8), timeout=100))
    for p, text in results:
        assert text == expected[p], p


def test_seeded_sampling_is_reproducible_and_matches_reference(url, engine):
    a = generate(url, PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7, timeout_s=60).text
    b = generate(url, PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7, timeout_s=60).text
    assert a == b == reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7)


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
    return [
        ("missing text_input", "dflash", [_raw_input("sampling_param_max_tokens", "INT32", np.array([4], dtype=np.int32))],
         "INVALID_ARGUMENT", "text_input"),
        ("wrong datatype", "dflash", [ok, _raw_input("sampling_param_max_tokens", "FP32", np.array([4.0], dtype=np.float32))],
         "INVALID_ARGUMENT", "expects 'INT32'"),
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
        ("unknown model", "nope", [ok], "NOT_FOUND", "unknown model"),
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
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        cases = _bad_cases(engine)
        for i, (_, model, inputs, _, _) in enumerate(cases):
            c.async_stream_infer(model, inputs, request_id=f"bad{i}")
        c.async_stream_infer("dflash", build_inputs("hi", max_tokens=4), request_id="good",
                             enable_empty_final_response=True)
        errors, good = [], None
        while good is None or len(errors) < len(cases):
            result, error = got.get(timeout=60)
            if error is not None:
                errors.append(error.message())
            elif result.get_response().id == "good":
                good = result
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    for i, (what, _, _, _, fragment) in enumerate(cases):
        mine = [m for m in errors if m.startswith(f"[request id: bad{i}]")]
        assert len(mine) == 1 and fragment in mine[0], (what, errors)
    assert read_result(good)[1]["finish_reason"] in ("stop", "length")


def test_cancelled_stream_frees_the_runtime(server, url, engine):
    before = _metrics(server)
    canceled_key = 'nv_inference_request_failure{model="dflash",reason="CANCELED",version="1"}'
    limit = load_manifest(engine).limits.max_seq_len
    t0 = time.perf_counter()
    events = _stream(url, build_inputs(PROMPTS[0], max_tokens=limit - 40, stream=True), cancel_after_first=True)
    assert events and events[0][1] is None
    deadline = time.time() + 30
    while _metrics(server).get(canceled_key, 0) <= before.get(canceled_key, 0):
        assert time.time() < deadline, "the server never saw the cancellation"
        time.sleep(0.05)
    # the runtime is free again: a new request is answered, and the long one did not run to the end
    r = generate(url, "hi", max_tokens=4, timeout_s=30).stats
    assert r["num_output_tokens"] >= 1
    assert time.perf_counter() - t0 < 30


def test_unary_call_with_stream_true_is_refused_not_hung(unary_url):
    """Upstream's llmapi model.py: streaming on a model that is not decoupled is an error."""
    with grpcclient.InferenceServerClient(unary_url) as c, pytest.raises(InferenceServerException) as exc:
        c.infer("dflash", build_inputs(PROMPTS[0], max_tokens=MAX_TOKENS, stream=True), client_timeout=60)
    assert "Streaming is only supported in decoupled mode." in exc.value.message()


def test_unary_infer_on_a_decoupled_model_is_refused_as_triton_does(url):
    """tritonserver's grpc frontend refuses ModelInfer for a decoupled model with this text."""
    with grpcclient.InferenceServerClient(url) as c, pytest.raises(InferenceServerException) as exc:
        c.infer("dflash", build_inputs(PROMPTS[0], max_tokens=MAX_TOKENS), client_timeout=60)
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in exc.value.message()


# -- metrics and statistics ----------------------------------------------------------------------
@pytest.fixture
def fresh_server(engine, tmp_path):
    """A server of its own: on the shared one, a request cancelled by an earlier test may still be
    counted (cancellation is noticed between decoding steps), which would blur exact deltas."""
    srv = TritonGrpcServer(generate_repository(engine, tmp_path / "repo"), grpc_port=0, metrics_port=0).start()
    yield srv
    srv.stop(grace=2.0)


def test_metrics_and_statistics_count_what_was_sent(fresh_server):
    server, url = fresh_server, f"127.0.0.1:{fresh_server.grpc_port}"
    key = '{model="dflash",version="1"}'
    before = _metrics(server)
    stats_before = None
    with grpcclient.InferenceServerClient(url) as c:
        stats_before = c.get_inference_statistics("dflash").model_stats[0]
    finals = [read_result(_infer(url, prompt=p, max_tokens=8))[1] for p in PROMPTS[:3]]
    with pytest.raises(InferenceServerException):
        _infer(url, prompt="hi", max_tokens=0)
    after = _metrics(server)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"nv_inference_request_success{key}") == 3
    assert delta(f"nv_inference_count{key}") == 3
    assert delta('nv_inference_request_failure{model="dflash",reason="REJECTED",version="1"}') == 1
    assert delta(f"dflash_output_tokens_total{key}") == sum(f["num_output_tokens"] for f in finals)
    assert delta(f"dflash_draft_tokens_total{key}") == sum(f["total_draft_tokens"] for f in finals)
    assert delta(f"dflash_accepted_draft_tokens_total{key}") == sum(f["total_accepted_draft_tokens"] for f in finals)
    assert delta(f"dflash_acceptance_length_count{key}") == 3
    assert delta(f"dflash_request_latency_seconds_count{key}") == 3
    assert after[f"nv_inference_pending_request_count{key}"] == 0
    with grpcclient.InferenceServerClient(url) as c:
        st = c.get_inference_statistics("dflash").model_stats[0]
    assert st.inference_stats.success.count - stats_before.inference_stats.success.count == 3
    assert st.inference_stats.fail.count - stats_before.inference_stats.fail.count == 1
    assert st.inference_stats.success.ns > stats_before.inference_stats.success.ns


def test_the_repositorys_draft_method_reaches_the_served_runtime(engine, tmp_path):
    """model.py hands the repository's draft_method to the backend: a seeded sampled answer is the
    reference loop's under that method (greedy, not the default, so that dropping it shows)."""
    repo = generate_repository(engine, tmp_path / "repo", TritonRepoSettings(draft_method="greedy"))
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=None).start()
    try:
        text = generate(f"127.0.0.1:{srv.grpc_port}", PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                        timeout_s=60).text
    finally:
        srv.stop(grace=2.0)
    assert text == reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7, draft_method="greedy")
    assert text != reference_answer(engine, PROMPTS[5], MAX_TOKENS, temperature=1.0, seed=7)  # the default's


def test_stop_finishes_in_flight_requests_then_refuses(engine, tmp_path):
    """Graceful shutdown: a request in flight when stop() starts still gets its full answer."""
    repo = generate_repository(engine, tmp_path / "repo")
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=None).start()
    u = f"127.0.0.1:{srv.grpc_port}"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=generate(u, PROMPTS[1], stream=True, max_tokens=120,
                                                               timeout_s=60)))
    t.start()
    time.sleep(0.2)
    srv.stop(grace=30)
    t.join(60)
    assert box["r"].text == reference_answer(engine, PROMPTS[1], 120)
    with pytest.raises(InferenceServerException):
        with grpcclient.InferenceServerClient(u) as c:
            c.is_server_live(client_timeout=2)
