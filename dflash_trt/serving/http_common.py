"""What the HTTP frontends (kserve_http.py, openai_http.py) share on Starlette: reading a bounded
body, server-sent events, and responses that always give their stream slot back."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response

from dflash_trt.serving.host import InferError

MAX_BODY_BYTES = 64 << 20  # as tritonserver's default --http-max-input-size


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (INVALID_ARGUMENT) past `limit` bytes before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, what: str = "request body") -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is not valid JSON ({e})")


def sse(payload: Any) -> bytes:
    """One server-sent event carrying `payload` (JSON) or a literal string such as [DONE]."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Guarded:
    """An ASGI response that runs `on_close` callbacks once it has been sent, whether it completed,
    failed or the client left before its body started: a stream slot is always given back and the
    generation of a client that left is cancelled."""

    def __init__(self, response: Response, *on_close: Callable[[], None]) -> None:
        self.response = response
        self.on_close = list(on_close)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            for fn in self.on_close:
                fn()
