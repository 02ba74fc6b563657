"""The OpenAI-compatible API, a front on Triton: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (and ``GET /health/ready``), as trtllm-serve, vLLM and SGLang serve
them, so the clients people have (the `openai` package, LangChain, AIPerf, `vllm bench serve`,
curl) reach the engine.

It sits on Triton the way Triton's own OpenAI frontend does: on a port of its own (`serve
--openai-port`, 9000 as Triton's frontend), a client of the server. Every request becomes one
Triton request to the model of that name, over tritonclient's asyncio gRPC stream (a decoupled
model, streamed as it decodes) or one unary call (a model that is not decoupled). Triton's status
codes come back as gRPC statuses (the ``triton_grpc_error`` header) and become OpenAI's HTTP
codes. The chat template is applied where the tokenizer lives, by the model: chat messages travel
as ``text_input_format`` = "messages"; a completion's prompt as raw text (OpenAI's and vLLM's
meaning, and upstream llmapi's). A client that leaves mid-stream cancels its Triton request,
which frees its row in the runtime.

- Sampling: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` (default 1, as
  OpenAI), ``top_p``, ``seed``, ``stop``; one SamplingParams, validated here too so a bad value is a
  400 naming its field before anything is sent (the model checks again: one validator, two
  callers). OpenAI's own limits: temperature <= 2, up to 4 stop sequences, its chat roles only.
  ``n`` must be 1. Features the engine does not have (logprobs, penalties, tools and tool results,
  logit_bias, echo, suffix, best_of > 1, non-text content) are refused with a 400 naming them;
  unknown fields are ignored, as vLLM does.
- ``stream: true``: server-sent events ending in ``data: [DONE]``; ``stream_options.include_usage``
  adds a final chunk with ``usage`` (and ``usage: null`` on the others).
- Every response carries ``usage`` and a ``dflash`` object, the request's speculative statistics
  (tau, acceptance_rate, total_draft_tokens, total_accepted_draft_tokens, num_steps, num_drafts,
  position_drafted, position_accepted, per_position_acceptance, ttft_s, queue_s, decode_s;
  streaming: on the chunk with the finish_reason and on the usage chunk). Beside it, where the
  backend saw the steps, ``metrics.speculative_decoding``: vLLM 0.32's own per-request object
  (tests/upstream/spec_decode_metrics.json). ``usage`` stays OpenAI's.
- Errors: OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}`` with 400
  (invalid request), 404 (unknown model), 429 (``--max-streams`` requests in flight), 503 (the
  model's queue is full, it is not ready, or the server is shutting down), 500 (the request
  failed while running; the others of its batch go on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_trt.errors import InvalidRequest
from dflash_trt.serving.limits import DEFAULT_MAX_STREAMS
MAX_BODY_BYTES = 64 << 20  # as tritonserver's default --http-max-input-size
# OpenAI's chat roles (openai 3.57.0, types/chat/chat_completion_role.py `ChatCompletionRole`); any
# other is a 400 there. "tool" and "function" answer tool calls, which this engine never makes.
OPENAI_ROLES = ("developer", "system", "user", "assistant", "tool", "function")
TOOL_ROLES = ("tool", "function")
# OpenAI's ranges (types/chat/completion_create_params.py): "temperature ... between 0 and 2",
# "stop: Up to 4 sequences"; SamplingParams checks the rest of each value
MAX_TEMPERATURE = 2.0
MAX_STOP_SEQUENCES = 4
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 501: "invalid_request_error", 503: "service_unavailable_error"}
# Triton's gRPC status -> HTTP, as Triton's HTTP frontend maps its error codes (http_server.cc
# HttpCodeFromError); a cancelled request is the server going away here (a client that left
# reads nothing)
HTTP_OF_GRPC = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "UNIMPLEMENTED": 501,
                "INTERNAL": 500, "CANCELLED": 503, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 408,
                "ALREADY_EXISTS": 400, "UNKNOWN": 500}
# with it, Triton answers a failed request of a stream as a gRPC status (and closes that stream),
# so its code is not lost in a stream message (Triton >= 24.07, docs: "gRPC status codes")
GRPC_ERROR_HEADER = {"triton_grpc_error": "true"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status)

    def body(self) -> dict[str, Any]:
        return {"message": str(self), "type": ERROR_TYPES.get(self.status, "server_error"), "param": self.param,
                "code": self.code}

    @classmethod
    def of(cls, e: BaseException) -> "OpenAIError":
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, InvalidRequest):
            m = re.match(r"(\w+)=", str(e))  # SamplingParams names the field first: "temperature=nan is ..."
            return cls(400, str(e), param=m.group(1) if m else None)
        code = _grpc_code(e)
        if code is not None:
            status = HTTP_OF_GRPC.get(code, 500)
            message = _grpc_details(e)
            if code == "UNAVAILABLE" and ("connect" in message.lower() or "socket" in message.lower()):
                message = f"Triton is not reachable ({message}); is the server up?"
            elif code == "CANCELLED":
                message = f"the request was cancelled: the server is shutting down ({message}); retry on another replica"
            m = re.match(r"(\w+)=", message)
            return cls(status, message, param=m.group(1) if status == 400 and m else None)
        return cls(500, f"{type(e).__name__}: {e}")


def _grpc_code(e: BaseException) -> str | None:
    """The gRPC status name of a grpc.aio error or a tritonclient exception, else None."""
    code = getattr(e, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # noqa: BLE001 - not a grpc call error after all
            return None
    status = getattr(e, "status", None)
    if callable(status) and status():
        return str(status()).removeprefix("StatusCode.")
    return None


def _grpc_details(e: BaseException) -> str:
    for attr in ("details", "message"):
        fn = getattr(e, attr, None)
        if callable(fn) and fn():
            return " ".join(str(fn()).split())
    return " ".join(str(e).split())


class _Request(BaseModel):
    """Fields of both endpoints. Sampling values stay untyped here: SamplingParams validates them
    (types included), the one validator."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Any = None
    temperature: Any = 1.0
    top_p: Any = 1.0
    seed: Any = None
    stop: Any = None
    n: Any = 1
    stream: StrictBool = False  # "yes" is a 400 at OpenAI, not a stream
    stream_options: dict[str, Any] | None = None
    presence_penalty: Any = 0
    frequency_penalty: Any = 0
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    user: StrictStr | None = None


class CompletionRequest(_Request):
    prompt: Any
    echo: Any = False
    suffix: Any = None
    best_of: Any = None


class ChatRequest(_Request):
    messages: Any
    max_completion_tokens: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None


def _refuse_unsupported(r: _Request) -> None:
    def no(param: str, why: str) -> OpenAIError:
        return OpenAIError(400, f"{param} is not supported by dflash-trt: {why}", param=param)

    if r.n != 1:
        raise no("n", f"n={r.n!r}; send n=1 (one choice per request)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name) not in (0, 0.0, None):
            raise no(name, "penalties are not applied; send 0 or leave it out")
    if r.logprobs not in (None, False, 0) or r.top_logprobs not in (None, 0):
        raise no("logprobs", "no log probabilities are computed; leave logprobs out")
    if r.logit_bias:
        raise no("logit_bias", "leave it out")
    if isinstance(r, CompletionRequest):
        if r.echo:
            raise no("echo", "the prompt is not echoed; send echo=false")
        if r.suffix:
            raise no("suffix", "leave it out")
        if r.best_of not in (None, 1):
            raise no("best_of", "send best_of=1 or leave it out")
    include_usage = (r.stream_options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIError(400, f"stream_options.include_usage={include_usage!r} must be true or false",
                          param="stream_options.include_usage")
    if isinstance(r, ChatRequest):
        for name in ("tools", "functions", "tool_choice"):
            if getattr(r, name):
                raise no(name, "no tool calling; leave it out")
        fmt = r.response_format
        if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise no("response_format", "only text; leave it out")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages with string content; text parts of list content are joined. Roles
    OpenAI does not know, and tool results (this engine calls no tools), are a 400 as there. The
    model checks the rest (the tokenizer contract: runtime/decoding/tokens.check_messages), a 400 too."""
    if not isinstance(messages, list):
        raise OpenAIError(400, "messages must be a list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in OPENAI_ROLES:
            raise OpenAIError(400, f"Invalid value: {role!r}. Supported values are: "
                                   f"{', '.join(repr(r) for r in OPENAI_ROLES)}", param=f"messages[{i}].role",
                              code="invalid_value")
        if role in TOOL_ROLES:
            raise OpenAIError(400, f"messages[{i}].role={role!r}: no tool calling in dflash-trt, so no tool result "
                                   "answers one; send it as a user message", param=f"messages[{i}].role")
        if isinstance(m, dict) and not isinstance(m.get("name", ""), str):
            raise OpenAIError(400, f"messages[{i}].name must be a string", param=f"messages[{i}].name")
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not content:
                raise OpenAIError(400, f"messages[{i}].content is an empty list of parts; send text",
                                  param=f"messages[{i}].content")
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported by this text-only "
                                       f"engine", param="messages")
            content = "".join(p["text"] for p in content)
        out.append({**m, "content": content} if isinstance(m, dict) else m)
    return out


def _check_openai_ranges(params: Any) -> None:
    """What OpenAI refuses beyond SamplingParams' own checks (other protocols allow it)."""
    if params.temperature > MAX_TEMPERATURE:
        raise OpenAIError(400, f"temperature={params.temperature} is above OpenAI's maximum of {MAX_TEMPERATURE:g}; "
                               "send 0..2 (0 = greedy)", param="temperature")
    if len(params.stop) > MAX_STOP_SEQUENCES:
        raise OpenAIError(400, f"stop has {len(params.stop)} sequences; OpenAI allows up to {MAX_STOP_SEQUENCES}",
                          param="stop")


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt must be one string (token-id prompts and batches of prompts are not "
                               "supported); send one request per prompt", param="prompt")
    if not prompt:
        raise OpenAIError(400, "prompt is empty; send non-empty text", param="prompt")
    return prompt


# -- the model's statistics outputs -> OpenAI's objects ------------------------------------------
def dflash_stats(s: dict[str, Any]) -> dict[str, Any]:
    """Our per-request object, from the final response's outputs (serving/client.read_result)."""
    drafted, accepted = list(s.get("position_drafted", [])), list(s.get("position_accepted", []))
    ttft = 0.0
    if s.get("first_token_time_ns") and s.get("arrival_time_ns"):
        ttft = (s["first_token_time_ns"] - s["arrival_time_ns"]) / 1e9
    return {"tau": s.get("tau", 0.0), "acceptance_rate": s.get("acceptance_rate", 0.0),
            "total_draft_tokens": s.get("total_draft_tokens", 0),
            "total_accepted_draft_tokens": s.get("total_accepted_draft_tokens", 0), "num_steps": s.get("num_steps", 0),
            "num_drafts": drafted[0] if drafted else 0, "position_drafted": drafted, "position_accepted": accepted,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
            "ttft_s": ttft, "queue_s": s.get("queue_time_ms", 0.0) / 1e3, "decode_s": s.get("decode_time_ms", 0.0) / 1e3}


def vllm_speculative_decoding(s: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's per-request ``metrics.speculative_decoding`` (SpeculativeDecodingMetrics) of a
    request: drafts only (a step that drafted nothing is no spec step there), the bonus token in
    the mean acceptance length, the histogram of accepted drafts per step."""
    hist = list(s.get("acceptance_histogram", []))
    steps = sum(hist)
    accepted = sum(j * n for j, n in enumerate(hist))
    drafted = s.get("total_draft_tokens", 0)
    return {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted, "num_spec_tokens": s.get("max_draft_len", 0)}


def speculation_fields(s: dict[str, Any]) -> dict[str, Any]:
    """What a final response carries beside usage: our ``dflash`` object and, where the backend
    saw the steps (the TensorRT-LLM backend reports totals only), vLLM's ``metrics`` object."""
    out: dict[str, Any] = {"dflash": dflash_stats(s)}
    if s.get("acceptance_histogram"):
        out["metrics"] = {"speculative_decoding": vllm_speculative_decoding(s)}
    return out


def usage(s: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: the prompt's tokens served from the
    prefix cache (OpenAI's and vLLM's field), where the model says (num_cached_tokens)."""
    prompt, completion = int(s.get("num_input_tokens", 0)), int(s.get("num_output_tokens", 0))
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if "num_cached_tokens" in s:
        out["prompt_tokens_details"] = {"cached_tokens": int(s["num_cached_tokens"])}
    return out


def sse(payload: Any) -> bytes:
    """One server-sent event carrying `payload` (JSON) or a literal string such as [DONE]."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _read_body(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The JSON body, refused (400) past `limit` bytes before it is all read, or when not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(400, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(400, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({e})")


class _Guarded:
    """An ASGI response that runs `on_close` once it has been sent, whether it completed, failed or
    the client left before its body started: a slot is always given back."""

    def __init__(self, response: Response, on_close: Callable[[], None]) -> None:
        self.response, self.on_close = response, on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.on_close()


class _Slots:
    """At most `limit` requests in flight through the front (429 past it)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def acquire(self) -> Callable[[], None]:
        if self.used >= self.limit:
            raise OpenAIError(429, f"{self.used} requests are in flight, the front's --max-streams={self.limit}; "
                                   "retry later", code="rate_limit_exceeded")
        self.used += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.used -= 1

        return release


class OpenAIFront:
    """The routes of this module over the Triton server at `triton_url` (host:grpc_port)."""

    def __init__(self, triton_url: str, max_streams: int = DEFAULT_MAX_STREAMS, timeout_s: float = 3600.0) -> None:
        self.triton_url = triton_url
        self.slots = _Slots(max_streams)
        self.timeout_s = timeout_s
        self.created = int(time.time())
        self._client: Any = None  # tritonclient.grpc.aio client, made on the serving loop
        self._decoupled: dict[str, bool] = {}

    def app(self) -> Starlette:
        async def not_found(request: Request, exc: Any) -> JSONResponse:
            return OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            if self._client is not None:  # its channel lives on this loop
                await self._client.close()

        return Starlette(routes=[Route("/v1/models", self.models), Route("/health/ready", self.ready),
                                 Route("/v1/completions", self.completions, methods=["POST"]),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])],
                         exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)

    def client(self) -> Any:
        if self._client is None:
            import tritonclient.grpc.aio as aioclient

            self._client = aioclient.InferenceServerClient(self.triton_url)
        return self._client

    async def _served(self) -> list[str]:
        """The models Triton has READY."""
        index = await self.client().get_model_repository_index(as_json=True)
        return sorted(m["name"] for m in index.get("models", []) if m.get("state") == "READY")

    async def _is_decoupled(self, model: str) -> bool:
        if model not in self._decoupled:
            config = await self.client().get_model_config(model, as_json=True)
            self._decoupled[model] = bool(config["config"].get("model_transaction_policy", {}).get("decoupled"))
        return self._decoupled[model]

    async def ready(self, request: Request) -> Response:
        try:
            ok = await self.client().is_server_ready()
        except Exception:  # noqa: BLE001 - not reachable: not ready
            ok = False
        return Response(status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        try:
            served = await self._served()
        except Exception as e:  # noqa: BLE001
            return OpenAIError.of(e).response()
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "dflash-trt"} for name in served]})

    async def completions(self, request: Request) -> Any:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Any:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Any:
        try:
            release = self.slots.acquire()
        except OpenAIError as e:
            return e.response()
        try:
            return await self._handle(request, chat, release)
        except BaseException as e:
            release()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            return OpenAIError.of(e).response()

    async def _handle(self, request: Request, chat: bool, release: Callable[[], None]) -> Any:
        from dflash_trt.sampling_params import SamplingParams
        from dflash_trt.serving.client import build_inputs

        doc = await _read_body(request)
        try:
            r = (ChatRequest if chat else CompletionRequest).model_validate(doc)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)
        served = await self._served()
        if r.model not in served:
            raise OpenAIError(404, f"The model `{r.model}` does not exist. Served: {served}", param="model",
                              code="model_not_found")
        _refuse_unsupported(r)
        max_tokens = r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if r.temperature is None else r.temperature,
                                top_p=1.0 if r.top_p is None else r.top_p, seed=r.seed,
                                stop=() if r.stop is None else r.stop)
        _check_openai_ranges(params)
        text = json.dumps(_messages(r.messages)) if chat else _prompt(r.prompt)
        decoupled = await self._is_decoupled(r.model)
        inputs = build_inputs(text, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                              seed=params.seed, stop=params.stop, stream=decoupled,
                              text_input_format="messages" if chat else None, perf_metrics=True)
        ids = (f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}", int(time.time()), r.model)
        responses = self._responses(r.model, inputs, decoupled, ids[0])
        if r.stream:
            include_usage = (r.stream_options or {}).get("include_usage", False)
            events = self._events(responses, chat, ids, include_usage)
            return _Guarded(StreamingResponse(events, media_type="text/event-stream"), release)
        try:
            text_out, final = "", {}
            async for text_out, final in responses:
                pass
        finally:
            await responses.aclose()
            release()
        return JSONResponse(self._completion(ids, chat, text_out, final))

    async def _responses(self, model: str, inputs: list[Any], decoupled: bool,
                         request_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(whole text so far, outputs of this response) for each Triton response; the last one
        holds the finish reason and the statistics. Leaving early cancels the Triton request."""
        from dflash_trt.serving.client import read_result

        client = self.client()
        if not decoupled:
            result = await client.infer(model, inputs, request_id=request_id, client_timeout=self.timeout_s)
            yield read_result(result)
            return

        async def request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": inputs, "request_id": request_id,
                   "enable_empty_final_response": True}

        stream = client.stream_infer(request(), stream_timeout=self.timeout_s, headers=GRPC_ERROR_HEADER)
        text, outputs, done = "", {}, False
        try:
            async for result, error in stream:
                if error is not None:
                    raise error
                got, extra = read_result(result)
                text = got if len(got) > len(text) else text  # each response holds the whole text so far
                outputs.update(extra)
                done = result.get_response().parameters["triton_final_response"].bool_param
                yield text, outputs
                if done:
                    return
        finally:
            if not done:  # the client left, or the stream failed: stop decoding for it
                stream.cancel()

    @staticmethod
    def _completion(ids: tuple[str, int, str], chat: bool, text: str, final: dict[str, Any]) -> dict[str, Any]:
        rid, created, model = ids
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": final.get("finish_reason")}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage(final), **speculation_fields(final)}

    async def _events(self, responses: AsyncIterator[tuple[str, dict[str, Any]]], chat: bool,
                      ids: tuple[str, int, str], include_usage: bool) -> AsyncIterator[bytes]:
        rid, created, model = ids
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return sse(body)

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        sent = 0
        try:
            if chat:
                yield chunk([choice(None, None, role=True)])
            async for text, outputs in responses:
                if len(text) > sent:
                    yield chunk([choice(text[sent:], None)])
                    sent = len(text)
                if "finish_reason" in outputs:
                    yield chunk([choice(None, outputs["finish_reason"])], **speculation_fields(outputs))
                    if include_usage:
                        yield chunk([], usage=usage(outputs), **speculation_fields(outputs))
        except Exception as e:  # noqa: BLE001 - after the 200 the error travels as an event
            yield sse({"error": OpenAIError.of(e).body()})
        finally:
            await responses.aclose()  # a client that left: its Triton request is cancelled
        yield sse("[DONE]")
