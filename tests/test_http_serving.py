"""HTTP beside the real tritonserver: the OpenAI-compatible front (`serve --openai-port`, a
tritonclient gRPC client of Triton; the real `openai` package, sync and async, streaming and not),
and Triton's own HTTP endpoints, the generate / generate_stream extension (httpx, SSE) and KServe
v2 REST (the real `tritonclient.http`), all reaching the one runtime the gRPC side uses.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from dflash_trt.serving.client import generate
from tests.engine_fixtures import reference_answer, shared_tiny_engine

pytestmark = pytest.mark.timeout(180)
PROMPT = "The capital of France is"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return shared_tiny_engine(tmp_path_factory)


@pytest.fixture
def base(triton_unary) -> str:
    """The OpenAI front over the model that is not decoupled (it answers with one unary call)."""
    return triton_unary.openai_base


@pytest.fixture
def streaming_base(triton_streaming) -> str:
    """The OpenAI front over the decoupled model (it streams as the model decodes)."""
    return triton_streaming.openai_base


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


@pytest.mark.parametrize("which", ["unary", "streaming"])
def test_openai_streaming_chat_ends_with_usage_and_equals_unary(base, streaming_base, which, engine):
    """Both kinds of model behind the front: the streamed chat is the unary chat, piece by piece,
    and both are the reference loop's answer to the same one-turn conversation."""
    client = _client(base if which == "unary" else streaming_base)
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
    assert whole.choices[0].message.content == reference_answer(engine, "Name a colour.", MAX_TOKENS)
    assert "".join(pieces) == whole.choices[0].message.content
    if which == "streaming":
        assert len(pieces) > 1  # it streamed as the model decoded, not one blob at the end
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0


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


def test_triton_generate_and_generate_stream(triton_unary, triton_streaming, engine):
    """Triton's own generate extension: text_input raw, as upstream's llmapi clients send it, or
    one chat turn with text_input_format; generate_stream (SSE) on the decoupled model."""
    with httpx.Client(timeout=60) as http:
        body = {"text_input": PROMPT, "sampling_param_max_tokens": MAX_TOKENS}
        r = http.post(f"{triton_unary.http_base}/v2/models/dflash/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
        r = http.post(f"{triton_unary.http_base}/v2/models/dflash/generate", json={**body, "text_input_format": "user"})
        assert r.json()["text_output"] == reference_answer(engine, PROMPT, MAX_TOKENS)
        with http.stream("POST", f"{triton_streaming.http_base}/v2/models/dflash/generate_stream",
                         json={**body, "streaming": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
        assert len(events) > 1 and all("error" not in e for e in events)
        assert events[-1]["text_output"] == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
        assert events[-1]["tau"] >= 1


def test_kserve_rest_with_tritonclient_http(triton_unary, engine):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{triton_unary.http_port}")
    assert c.is_server_live() and c.is_model_ready("dflash")
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    max_tokens = httpclient.InferInput("sampling_param_max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([MAX_TOKENS], dtype=np.int32))
    r = c.infer("dflash", [text, max_tokens])
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
    c.close()


def test_grpc_and_the_openai_front_reach_one_model(triton_unary, base, engine):
    """`dflash-trt client`'s gRPC turn (text_input_format user) and the front's one-message chat
    are the same request to the same model: the same text."""
    grpc_text = generate(triton_unary.grpc_url, PROMPT, max_tokens=MAX_TOKENS, timeout_s=60).text
    http_text = _client(base).chat.completions.create(
        model="dflash", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        temperature=0).choices[0].message.content
    assert grpc_text == http_text == reference_answer(engine, PROMPT, MAX_TOKENS)


def test_decoupled_model_refuses_http_infer_as_triton_does(triton_streaming):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    r = httpx.post(f"{triton_streaming.http_base}/v2/models/dflash/infer", json=body, timeout=30)
    assert r.status_code >= 400
    assert "doesn't support models with decoupled transaction policy" in r.json()["error"]


def test_requests_past_the_fronts_limit_get_429_and_are_served_again_after(triton_streaming):
    """--max-streams 2 on a front: while two chats are in flight a third request gets 429
    (OpenAI's rate_limit_error) at once, without reaching Triton; once they end, requests are
    served again. Triton (the session's server, a front of 2 slots of its own on it) is paused
    (SIGSTOP) so that the two stay in flight as long as the test needs, whatever the machine's
    speed."""
    import os
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from dflash_trt.serving.openai_front import OpenAIFront
    from dflash_trt.serving.serve import OpenAIThread

    front = OpenAIThread(OpenAIFront(triton_streaming.grpc_url, max_streams=2), "127.0.0.1", 0).start()
    base, slots, pid = f"http://127.0.0.1:{front.port}", front.front.slots, triton_streaming.server.process.pid
    chat = {"model": "dflash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    probe = {"model": "dflash", "prompt": "hi", "max_tokens": 2}
    try:
        assert httpx.post(f"{base}/v1/completions", json=probe, timeout=30).status_code == 200  # model info cached
        os.killpg(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(2) as pool:
                held = [pool.submit(httpx.post, f"{base}/v1/chat/completions", json=chat, timeout=60) for _ in range(2)]
                deadline = time.time() + 30
                while slots.used < 2:
                    assert time.time() < deadline, "the two chats never reached the front"
                    time.sleep(0.01)
                t0 = time.perf_counter()
                r = httpx.post(f"{base}/v1/completions", json=probe, timeout=30)
                assert time.perf_counter() - t0 < 1.0  # refused by the front, Triton (paused) never asked
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
                os.killpg(pid, signal.SIGCONT)
                assert [f.result(timeout=60).status_code for f in held] == [200, 200]
        finally:
            os.killpg(pid, signal.SIGCONT)
        assert slots.used == 0
        assert httpx.post(f"{base}/v1/completions", json=probe, timeout=30).status_code == 200
    finally:
        front.stop(grace_s=1.0)


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
    r = CliRunner().invoke(main, ["client", PROMPT, "--url", base, "--max-tokens", str(MAX_TOKENS), "--raw", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["text"] == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
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


def test_an_openai_client_that_leaves_mid_stream_cancels_its_triton_request(triton_streaming, engine):
    """The front cancels the gRPC stream of a client that closed its connection: the model sees
    the cancellation (its counter moves, its log names the request), long before the budget.

    The client leaves after the first chunk with content (the role chunk comes before the front
    asks Triton: a client leaving then has nothing to cancel). Triton is paused (SIGSTOP) from that
    chunk until the front has let the request go, so the tiny model cannot finish its budget while
    the client's leaving travels, whatever the machine's load."""
    import os
    import signal
    import time

    served = triton_streaming
    before, slots, pid = served.cancellations(), served.front.front.slots, served.server.process.pid
    budget = 200
    body = {"model": "dflash", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": budget,
            "temperature": 0, "stream": True}
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{served.openai_base}/v1/chat/completions",
                                                           json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    os.killpg(pid, signal.SIGSTOP)  # a token came: the request is Triton's
                    break
            rid = event["id"]
        deadline = time.time() + 30
        while slots.used:  # the front saw the client leave and cancelled its stream
            assert time.time() < deadline, "the front never let the request go"
            time.sleep(0.01)
    finally:
        os.killpg(pid, signal.SIGCONT)
    produced = served.tokens_before_cancel(rid, before)
    assert produced and produced[-1] < budget, produced
