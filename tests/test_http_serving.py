"""`dflash-trt serve --http-port`: the OpenAI-compatible API (the real `openai` package, sync and
async, streaming and not), Triton's generate / generate_stream extension (httpx, SSE) and KServe v2
REST (the real `tritonclient.http`), all sharing the one runtime the gRPC side uses.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

try:
    from tests.engine_fixtures import reference_answer, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import reference_answer, shared_tiny_engine

from dflash_trt.serving.client import generate
from dflash_trt.serving.repository import TritonRepoSettings, generate_repository
from dflash_trt.serving.server import TritonGrpcServer

pytestmark = pytest.mark.timeout(120)
PROMPT = "The capital of France is"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return shared_tiny_engine(tmp_path_factory)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """Not decoupled (the default): unary gRPC and HTTP infer; OpenAI streams regardless."""
    repo = generate_repository(engine, tmp_path_factory.mktemp("http") / "repo")
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=None, http_port=0).start()
    yield srv
    srv.stop(grace=2.0)


@pytest.fixture
def base(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_models_and_completions_equal_the_reference(base, engine):
    client = _client(base)
    assert [m.id for m in client.models.list().data] == ["dflash"]
    r = client.completions.create(model="dflash", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)  # completions: no template
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1
    extra = r.model_extra["dflash"]  # our statistics object rides on every response
    assert 0 <= extra["total_accepted_draft_tokens"] <= extra["total_draft_tokens"] and extra["tau"] >= 1


def test_openai_streaming_chat_ends_with_usage_and_equals_unary(base):
    client = _client(base)
    messages = [{"role": "user", "content": "Name a colour."}]
    # OpenAI's default temperature is 1: greedy is asked for explicitly
    whole = client.chat.completions.create(model="dflash", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    pieces, usage = [], None
    stream = client.chat.completions.create(model="dflash", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                            temperature=0, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_openai_async_client_and_errors(base):
    async def run():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = await client.completions.create(model="dflash", prompt="Hello", max_tokens=8, seed=3, temperature=0.7)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="dflash", prompt="Hello", max_tokens=8, top_p=0.0)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="Hello", max_tokens=8)
        await client.close()
        return r, bad.value

    r, bad = asyncio.run(run())
    assert r.choices[0].text
    assert "top_p" in str(bad)


def test_nan_temperature_is_a_400_from_the_one_validator(base):
    """JSON has no NaN, but Python's and many clients' encoders write it: refused, not sampled."""
    body = '{"model": "dflash", "prompt": "Hello", "max_tokens": 8, "temperature": NaN}'
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "temperature" in err["message"] and "finite" in err["message"] and err["type"] == "invalid_request_error"


def test_triton_generate_and_generate_stream(base, engine):
    with httpx.Client(timeout=60) as http:
        body = {"text_input": PROMPT, "sampling_param_max_tokens": MAX_TOKENS}
        r = http.post(f"{base}/v2/models/dflash/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == reference_answer(engine, PROMPT, MAX_TOKENS)
        with http.stream("POST", f"{base}/v2/models/dflash/generate_stream", json=body) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
        assert events and all("error" not in e for e in events)


def test_kserve_rest_with_tritonclient_http(server, base, engine):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert c.is_server_live() and c.is_model_ready("dflash")
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    max_tokens = httpclient.InferInput("sampling_param_max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([MAX_TOKENS], dtype=np.int32))
    r = c.infer("dflash", [text, max_tokens])
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == reference_answer(engine, PROMPT, MAX_TOKENS)
    c.close()


def test_grpc_and_http_share_one_runtime(server, base, engine):
    """The same server answers gRPC and HTTP with the same text."""
    grpc_text = generate(f"127.0.0.1:{server.grpc_port}", PROMPT, max_tokens=MAX_TOKENS, timeout_s=60).text
    http_text = _client(base).chat.completions.create(  # gRPC's text_input is one user turn, as chat is
        model="dflash", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        temperature=0).choices[0].message.content
    assert grpc_text == http_text == reference_answer(engine, PROMPT, MAX_TOKENS)


def test_decoupled_model_refuses_http_infer_as_triton_does(engine, tmp_path):
    repo = generate_repository(engine, tmp_path / "repo", TritonRepoSettings(decoupled=True))
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=None, http_port=0).start()
    try:
        body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
        r = httpx.post(f"http://127.0.0.1:{srv.http_port}/v2/models/dflash/infer", json=body, timeout=30)
        assert r.status_code == 501
        assert "HTTP end point doesn't support models with decoupled transaction policy" in r.json()["error"]
    finally:
        srv.stop(grace=2.0)


def test_idle_streams_past_the_limit_are_refused_and_health_still_answers(engine, tmp_path):
    """70 idle gRPC streams against --max-streams 64: the 6 past it are refused with
    RESOURCE_EXHAUSTED, an OpenAI request gets 429, and health and metadata answer within a second
    while every slot is held; once the streams close, requests are served again."""
    import queue
    import time

    import tritonclient.grpc as grpcclient

    repo = generate_repository(engine, tmp_path / "repo", TritonRepoSettings(decoupled=True))
    srv = TritonGrpcServer(repo, grpc_port=0, metrics_port=None, http_port=0, max_streams=64).start()
    url, base = f"127.0.0.1:{srv.grpc_port}", f"http://127.0.0.1:{srv.http_port}"
    errors: queue.Queue = queue.Queue()
    clients = []
    try:
        for _ in range(70):
            c = grpcclient.InferenceServerClient(url)
            c.start_stream(callback=lambda result, error: errors.put(error) if error is not None else None)
            clients.append(c)
        refused = []
        deadline = time.time() + 30
        while len(refused) < 6 and time.time() < deadline:
            try:
                refused.append(errors.get(timeout=1))
            except queue.Empty:
                pass
        assert len(refused) == 6 and all("RESOURCE_EXHAUSTED" in str(e.status()) for e in refused)
        with grpcclient.InferenceServerClient(url) as c:
            t0 = time.perf_counter()
            assert c.is_server_live() and c.is_model_ready("dflash") and c.get_model_metadata("dflash").name
            assert time.perf_counter() - t0 < 1.0
        r = httpx.post(f"{base}/v1/completions", json={"model": "dflash", "prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for c in clients:
            c.stop_stream(cancel_requests=True)
            c.close()
    try:
        deadline = time.time() + 30
        while True:  # the slots come back as the server sees the streams end
            r = httpx.post(f"{base}/v1/completions", json={"model": "dflash", "prompt": "hi", "max_tokens": 4},
                           timeout=30)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
    finally:
        srv.stop(grace=2.0)


def test_dflash_trt_client_speaks_openai_to_an_http_url(base, engine):
    """`dflash-trt client http://...` goes through the openai package: one user turn, greedy, and
    the statistics from the `dflash` object; streamed and not give the same text."""
    from click.testing import CliRunner

    from dflash_trt.cli import main

    outs = []
    for flag in ("--no-stream", "--stream"):
        r = CliRunner().invoke(main, ["client", PROMPT, "--url", base, "--max-tokens", str(MAX_TOKENS), flag, "--json"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout))
    assert outs[0]["text"] == outs[1]["text"] == reference_answer(engine, PROMPT, MAX_TOKENS)
    assert all(o["tau"] >= 1 and o["total_accepted_draft_tokens"] <= o["total_draft_tokens"] for o in outs)
    r = CliRunner().invoke(main, ["client", "hi", "--url", "http://127.0.0.1:9", "--timeout", "5"])
    assert r.exit_code != 0 and "cannot reach an OpenAI-compatible server" in r.output and "Traceback" not in r.output


def test_openai_chat_roles_and_limits_are_openais(base):
    """What OpenAI answers 400 is a 400 here too (issue 36: role "wizard" got a 200). The roles
    are the `openai` package's own (ChatCompletionRole, openai 3.57.0); tool results are refused
    since this engine makes no tool calls; temperature <= 2 and up to 4 stop sequences are
    OpenAI's documented ranges (completion_create_params.py)."""
    from typing import get_args

    from openai.types.chat import ChatCompletionRole

    hi = {"role": "user", "content": "hi"}

    def post(**body) -> httpx.Response:
        doc = {"model": "dflash", "max_tokens": 2, "messages": [hi], **body}
        return httpx.post(f"{base}/v1/chat/completions", json=doc, timeout=60)

    for role in get_args(ChatCompletionRole):
        r = post(messages=[{"role": role, "content": "be brief"}, hi])
        if role in ("tool", "function"):
            assert r.status_code == 400 and "no tool calling" in r.json()["error"]["message"], r.text
        else:
            assert r.status_code == 200, (role, r.text)
    for role in ("wizard", "User"):
        err = post(messages=[{"role": role, "content": "hi"}]).json()["error"]
        assert (err["param"], err["code"], err["type"]) == ("messages[0].role", "invalid_value", "invalid_request_error")
        assert err["message"].startswith(f"Invalid value: '{role}'. Supported values are: 'developer', 'system'")
    cases = {
        "temperature": {"temperature": 3},
        "stop": {"stop": ["a", "b", "c", "d", "e"]},
        "stream": {"stream": "yes"},
        "stream_options.include_usage": {"stream": True, "stream_options": {"include_usage": "yes"}},
        "user": {"user": {"id": 1}},
        "messages[0].name": {"messages": [{**hi, "name": 5}]},
        "messages[0].content": {"messages": [{"role": "user", "content": []}]},
        "tool_choice": {"tool_choice": "auto"},
    }
    for param, body in cases.items():
        r = post(**body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
