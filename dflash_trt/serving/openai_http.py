"""The OpenAI-compatible API on Starlette: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, as trtllm-serve, vLLM and SGLang serve it, so the clients people
have (the `openai` package, LangChain, AIPerf, `vllm bench serve`, curl) reach the engine.

Requests go to the serving Backend the repository's model exposes, the same runtime and batches
as the Triton endpoints. The model is the Triton model's name (``/v1/models`` lists them).

- ``/v1/completions``: ``prompt`` is raw text (no chat template, as OpenAI and vLLM);
  ``/v1/chat/completions``: ``messages`` through the target's chat template, assistant turn open.
- Sampling: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` (default 1, as
  OpenAI), ``top_p``, ``seed``, ``stop``; one SamplingParams, validated once (a NaN or an
  out-of-range value is a 400 naming the field; so are OpenAI's own limits: temperature <= 2, up to 4
  stop sequences, its chat roles only). ``n`` must be 1. Features the engine does not have
  (logprobs, penalties, tools and tool results, logit_bias, echo, suffix, best_of > 1, non-text
  content) are refused with a 400 naming them; unknown fields are ignored, as vLLM does.
- ``stream: true``: server-sent events ending in ``data: [DONE]``; ``stream_options.include_usage``
  adds a final chunk with ``usage`` (and ``usage: null`` on the others).
- Every response carries ``usage`` and a ``dflash`` object, the request's speculative statistics:
  tau, acceptance_rate, total_draft_tokens, total_accepted_draft_tokens, num_steps, num_drafts,
  the per-position counts and acceptance (position_drafted, position_accepted,
  per_position_acceptance; index j = draft position j, 0-based), ttft_s, queue_s, decode_s
  (streaming: on the chunk with the finish_reason and on the usage chunk). Beside it, where the
  backend saw the steps, ``metrics.speculative_decoding``: the same request in vLLM 0.32's own
  per-request object (its field names and meanings, tests/upstream/spec_decode_metrics.json), so a
  client written for `vllm serve --per-request-spec-decode-metrics` reads it unchanged. Neither
  vLLM nor SGLang (``sglext.spec_tokens_details``) put speculation in ``usage``, whose fields
  are OpenAI's (its ``completion_tokens_details.accepted_prediction_tokens`` counts Predicted
  Outputs, not drafts), so ``usage`` stays as OpenAI defines it.
- Errors: OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}`` with 400
  (invalid request), 404 (unknown model), 429 (``--max-streams`` reached), 503 (queue full or
  shutting down), 500 (the request failed while running; the others of its batch go on).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_trt.errors import InvalidRequest
from dflash_trt.serving.core import InferenceCore
from dflash_trt.serving.host import InferError
from dflash_trt.serving.http_common import Guarded, parse_json, read_body, sse
from dflash_trt.serving.protocol import ChunkStats, GenerateRequest, GenerationFailed, ServerBusy

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
        if isinstance(e, ServerBusy):
            return cls(503, str(e))
        if isinstance(e, InferError):
            return cls(e.http_status, str(e), code="rate_limit_exceeded" if e.http_status == 429 else None)
        if isinstance(e, GenerationFailed):
            return cls(500, str(e))
        return cls(500, f"{type(e).__name__}: {e}")


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


def _messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages with string content; text parts of list content are joined. Roles
    OpenAI does not know, and tool results (this engine calls no tools), are a 400 as there."""
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
    return out  # GenerateRequest checks roles and contents (InvalidRequest -> 400)


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
    return prompt


def dflash_stats(s: ChunkStats) -> dict[str, Any]:
    return {"tau": s.tau, "acceptance_rate": s.acceptance_rate, "total_draft_tokens": s.total_draft_tokens,
            "total_accepted_draft_tokens": s.total_accepted_draft_tokens, "num_steps": s.num_steps,
            "num_drafts": s.num_drafts, "position_drafted": s.position_drafted,
            "position_accepted": s.position_accepted, "per_position_acceptance": s.per_position_acceptance,
            "ttft_s": s.ttft_s, "queue_s": s.queue_s, "decode_s": s.decode_s}


def vllm_speculative_decoding(s: ChunkStats) -> dict[str, Any]:
    """vLLM 0.32's per-request ``metrics.speculative_decoding`` (SpeculativeDecodingMetrics) of a
    request: drafts only (a step that drafted nothing is no spec step there), the bonus token in
    the mean acceptance length, the histogram of accepted drafts per step."""
    steps = sum(s.acceptance_histogram)
    accepted = sum(j * n for j, n in enumerate(s.acceptance_histogram))
    return {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / s.total_draft_tokens if s.total_draft_tokens else 0.0,
            "acceptance_histogram": list(s.acceptance_histogram), "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted, "num_draft_tokens": s.total_draft_tokens,
            "num_spec_tokens": s.max_draft_len}


def speculation_fields(s: ChunkStats) -> dict[str, Any]:
    """What a final response carries beside usage: our ``dflash`` object and, where the backend
    saw the steps (the TensorRT-LLM backend reports totals only), vLLM's ``metrics`` object."""
    out: dict[str, Any] = {"dflash": dflash_stats(s)}
    if s.acceptance_histogram:
        out["metrics"] = {"speculative_decoding": vllm_speculative_decoding(s)}
    return out


def usage(s: ChunkStats) -> dict[str, int]:
    return {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_output_tokens}


class OpenAIHTTP:
    """The routes of this module over one InferenceCore."""

    def __init__(self, core: InferenceCore) -> None:
        self.core = core
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models), Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"])]

    def _served(self) -> dict[str, Any]:
        return {name: m for name, m in sorted(self.core.models.items()) if m.backend is not None}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "dflash-trt"}
            for name in self._served()]})

    async def completions(self, request: Request) -> Any:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Any:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Any:
        try:
            release = self.core.slots.acquire("chat completion" if chat else "completion")
        except InferError as e:
            return OpenAIError.of(e).response()
        try:
            return await self._handle(request, chat, release)
        except BaseException as e:
            release()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            return OpenAIError.of(e).response()

    async def _handle(self, request: Request, chat: bool, release) -> Any:
        doc = parse_json(await read_body(request))
        try:
            r = (ChatRequest if chat else CompletionRequest).model_validate(doc)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)
        served = self._served()
        if r.model not in served:
            raise OpenAIError(404, f"The model `{r.model}` does not exist. Served: {sorted(served)}", param="model",
                              code="model_not_found")
        self.core.check_ready()
        _refuse_unsupported(r)
        from dflash_trt.sampling_params import SamplingParams

        max_tokens = r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if r.temperature is None else r.temperature,
                                top_p=1.0 if r.top_p is None else r.top_p, seed=r.seed,
                                stop=() if r.stop is None else r.stop)
        _check_openai_ranges(params)
        gen_request = (GenerateRequest(messages=_messages(r.messages), params=params) if chat else
                       GenerateRequest(prompt=_prompt(r.prompt), params=params, raw=True))
        model = served[r.model]
        timer = self.core.timer(model)
        try:
            generation = await asyncio.get_running_loop().run_in_executor(self.core.executor, model.backend.submit,
                                                                          gen_request)
        except (InvalidRequest, ServerBusy) as e:
            timer.finish(False, grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, InvalidRequest)
                         else grpc.StatusCode.UNAVAILABLE, {})
            raise
        timer.executing()
        ids = (f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}", int(time.time()), r.model)
        if r.stream:
            include_usage = (r.stream_options or {}).get("include_usage", False)
            return Guarded(StreamingResponse(self._events(generation, timer, chat, ids, include_usage),
                                             media_type="text/event-stream"), generation.cancel, release)
        text, final = [], None
        try:
            async for chunk in generation:
                timer.first()
                text.append(chunk.text)
                if chunk.finished:
                    final = chunk
        except BaseException as e:
            timer.finish(False, grpc.StatusCode.INTERNAL, {})
            raise e
        if final is None or final.finish_reason == "cancelled":
            timer.finish(False, grpc.StatusCode.CANCELLED, {})
            raise OpenAIError(503, "the request was cancelled: the server is shutting down; retry on another replica")
        timer.finish(True, None, _values(final.stats))
        release()
        return JSONResponse(self._completion(ids, chat, "".join(text), final))

    @staticmethod
    def _completion(ids: tuple[str, int, str], chat: bool, text: str, final: Any) -> dict[str, Any]:
        rid, created, model = ids
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": final.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage(final.stats), **speculation_fields(final.stats)}

    async def _events(self, generation: Any, timer: Any, chat: bool, ids: tuple[str, int, str], include_usage: bool):
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

        code = grpc.StatusCode.CANCELLED  # unless it ends or fails: the client left
        try:
            if chat:
                yield chunk([choice(None, None, role=True)])
            async for c in generation:
                timer.first()
                if c.finished:
                    if c.finish_reason == "cancelled":
                        raise OpenAIError(503, "the request was cancelled: the server is shutting down")
                    if c.text:
                        yield chunk([choice(c.text, None)])
                    yield chunk([choice(None, c.finish_reason)], **speculation_fields(c.stats))
                    if include_usage:
                        yield chunk([], usage=usage(c.stats), **speculation_fields(c.stats))
                    timer.finish(True, None, _values(c.stats))
                elif c.text:
                    yield chunk([choice(c.text, None)])
        except Exception as e:  # noqa: BLE001 - after the 200 the error travels as an event
            code = grpc.StatusCode.INTERNAL
            yield sse({"error": OpenAIError.of(e).body()})
        finally:
            timer.finish(False, code, {})  # no-op when it already finished
        yield sse("[DONE]")


def _values(s: ChunkStats) -> dict[str, Any]:
    """The statistics the Prometheus metrics count, under the Triton output names."""
    return {"num_output_tokens": s.num_output_tokens, "total_draft_tokens": s.total_draft_tokens,
            "total_accepted_draft_tokens": s.total_accepted_draft_tokens, "tau": s.tau,
            "position_drafted": s.position_drafted, "position_accepted": s.position_accepted}
