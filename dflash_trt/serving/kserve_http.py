"""Triton's HTTP endpoints on Starlette: KServe v2 REST and the generate extension.

- health and metadata: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2``,
  ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../config``, ``.../stats``,
  ``POST /v2/repository/index`` (no stream slot: answered however busy the server is);
- ``POST /v2/models/{m}/infer``: KServe v2 JSON tensors, with Triton's binary tensor data
  extension (``Inference-Header-Content-Length``, ``binary_data_size``, ``binary_data``,
  ``binary_data_output``) as tritonclient.http sends by default; a decoupled model is refused as
  tritonserver does (501 "HTTP end point doesn't support models with decoupled transaction
  policy");
- ``POST /v2/models/{m}/generate`` and ``/generate_stream`` (server-sent events): JSON keys, top
  level or inside ``parameters``, that name an input become tensors, the others request
  parameters; each response is ``{model_name, model_version, [id,] <outputs>}``.

Errors are ``{"error": "<one line>"}`` with Triton's status codes (400 invalid, 404 unknown model,
501 unsupported, 503 shutting down) and 429 past ``--max-streams``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_trt import __version__
from dflash_trt.serving.core import EXTENSIONS, SERVER_NAME, InferenceCore, LoopDeliveries, collect_responses
from dflash_trt.serving.host import (
    DECOUPLED_HTTP_REFUSAL,
    HostedModel,
    InferError,
    WireTensor,
    decode_bytes,
    encode_bytes,
)
from dflash_trt.serving.http_common import Guarded, parse_json, read_body, sse

HEADER_LENGTH = "Inference-Header-Content-Length"
NON_STREAM_MANY = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                   "generates various number of responses")


def error_response(e: InferError) -> JSONResponse:
    return JSONResponse({"error": str(e)}, status_code=e.http_status)


def _json_values(array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


def _from_json(name: str, datatype: str, data: Any) -> np.ndarray:
    """A tensor's JSON `data` (nested or flat) as an array of `datatype`."""
    from tritonclient.utils import triton_to_np_dtype

    values = np.array(data, dtype=np.object_).reshape(-1) if not isinstance(data, (str, bytes)) else \
        np.array([data], dtype=np.object_)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"input '{name}': BYTES data must be JSON strings")
        return np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    np_dtype = triton_to_np_dtype(datatype)
    if np_dtype is None:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"input '{name}' has unsupported datatype '{datatype}'")
    want_bool, want_int = datatype == "BOOL", datatype.startswith(("INT", "UINT"))
    for v in values:
        ok = isinstance(v, bool) if want_bool else (
            isinstance(v, int) and not isinstance(v, bool) if want_int else
            isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"input '{name}': {json.dumps(v)} is not a {datatype} value")
    try:
        return np.array(values.tolist(), dtype=np_dtype)
    except OverflowError:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"input '{name}': a value is out of range for {datatype}")


class KServeHTTP:
    """The routes of this module over one InferenceCore."""

    def __init__(self, core: InferenceCore) -> None:
        self.core = core

    def routes(self) -> list[Route]:
        m = "/v2/models/{model}"
        mv = "/v2/models/{model}/versions/{version}"
        routes = [
            Route("/v2/health/live", self.live), Route("/v2/health/ready", self.ready), Route("/v2", self.server_metadata),
            Route("/v2/models/stats", self.stats), Route("/v2/repository/index", self.index, methods=["POST"]),
            Route("/v2/repository/models/{model}/load", self.unsupported, methods=["POST"]),
            Route("/v2/repository/models/{model}/unload", self.unsupported, methods=["POST"]),
        ]
        for base in (mv, m):
            routes += [
                Route(base, self.model_metadata), Route(base + "/ready", self.model_ready),
                Route(base + "/config", self.model_config), Route(base + "/stats", self.stats),
                Route(base + "/infer", self.infer, methods=["POST"]),
                Route(base + "/generate", self.generate, methods=["POST"]),
                Route(base + "/generate_stream", self.generate_stream, methods=["POST"]),
            ]
        return routes

    def _model(self, request: Request) -> HostedModel:
        return self.core.model(request.path_params["model"], request.path_params.get("version", ""))

    # -- health and metadata ----------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.core.ready else 400)

    async def model_ready(self, request: Request) -> Response:
        ok = self.core.model_ready(request.path_params["model"], request.path_params.get("version", ""))
        return Response(status_code=200 if ok else 400)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    async def model_metadata(self, request: Request) -> Response:
        try:
            return JSONResponse(self._model(request).metadata())
        except InferError as e:
            return error_response(e)

    async def model_config(self, request: Request) -> Response:
        try:
            return JSONResponse(self._model(request).config_json())
        except InferError as e:
            return error_response(e)

    async def stats(self, request: Request) -> Response:
        try:
            return JSONResponse({"model_stats": self.core.statistics(request.path_params.get("model", ""),
                                                                     request.path_params.get("version", ""))})
        except InferError as e:
            return error_response(e)

    async def index(self, request: Request) -> Response:
        state = "READY" if self.core.ready else "UNAVAILABLE"
        return JSONResponse([{"name": n, "version": m.version, "state": state}
                             for n, m in sorted(self.core.models.items())])

    async def unsupported(self, request: Request) -> Response:
        return error_response(InferError(grpc.StatusCode.UNIMPLEMENTED,
                                         "model load/unload is not supported by dflash-trt serve: models load at "
                                         "start (--load-model)"))

    # -- shared by infer and generate ---------------------------------------------------------------
    async def _start(self, model: HostedModel, wire: list[WireTensor], request_id: str, parameters: dict[str, Any],
                     requested: list[str]):
        """Check and submit a request; returns (deliveries, sender). The caller holds a slot."""
        self.core.check_ready()
        timer = self.core.timer(model)
        try:
            inputs = model.check_inputs(wire)
            model.check_outputs(requested)
        except InferError as e:
            timer.finish(False, e.code, {})
            raise
        deliveries = LoopDeliveries(asyncio.get_running_loop())
        sender = await self.core.submit(model, timer, inputs, request_id, parameters, requested, deliveries)
        return deliveries, sender

    async def _guarded(self, what: str, handler) -> Any:
        """Run `handler(release)` holding a stream slot until the response it returns is sent."""
        try:
            release = self.core.slots.acquire(what)
        except InferError as e:
            return error_response(e)
        try:
            return await handler(release)
        except InferError as e:
            release()
            return error_response(e)
        except BaseException:
            release()
            raise

    # -- KServe v2 infer ----------------------------------------------------------------------------
    async def infer(self, request: Request) -> Any:
        async def handle(release):
            model = self._model(request)
            if model.decoupled:
                raise InferError(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_HTTP_REFUSAL)
            body = await read_body(request)
            header = request.headers.get(HEADER_LENGTH)
            if header is not None:
                if not header.isdigit() or int(header) > len(body):
                    raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"{HEADER_LENGTH} {header!r} does not fit the {len(body)}-byte body")
                doc, binary = parse_json(body[:int(header)]), body[int(header):]
            else:
                doc, binary = parse_json(body), b""
            wire, requested, binary_out = self._kserve_request(doc, binary)
            request_id = str(doc.get("id", ""))
            deliveries, sender = await self._start(model, wire, request_id, doc.get("parameters") or {},
                                                   [name for name, _ in requested])
            response = await _only_response(deliveries, sender, f"model '{model.name}' sent more than one response "
                                                                "to one request")
            return Guarded(self._kserve_response(model, response, request_id, dict(requested), binary_out), release)

        return await self._guarded("infer", handle)

    @staticmethod
    def _kserve_request(doc: Any, binary: bytes) -> tuple[list[WireTensor], list[tuple[str, bool | None]], bool]:
        from tritonclient.utils import triton_to_np_dtype

        if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT, "the request needs an \"inputs\" list")
        wire, offset = [], 0
        for t in doc["inputs"]:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("datatype"), str) \
                    or not isinstance(t.get("shape"), list) or not all(isinstance(d, int) for d in t["shape"]):
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "each input needs \"name\", \"datatype\" and an integer \"shape\"")
            name, datatype = t["name"], t["datatype"]
            size = (t.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                    raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"input '{name}': binary_data_size {size} does not fit the binary data")
                chunk = binary[offset:offset + size]
                offset += size

                def decode(chunk=chunk, name=name, datatype=datatype):
                    if datatype == "BYTES":
                        return decode_bytes(chunk, name)
                    np_dtype = triton_to_np_dtype(datatype)
                    if np_dtype is None or len(chunk) % np.dtype(np_dtype).itemsize:
                        raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"input '{name}': {len(chunk)} bytes are not whole {datatype} elements")
                    return np.frombuffer(chunk, dtype=np_dtype)
            elif "data" in t:
                def decode(data=t["data"], name=name, datatype=datatype):
                    return _from_json(name, datatype, data)
            else:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"input '{name}' has neither data nor "
                                                                   f"binary_data_size")
            wire.append(WireTensor(name, datatype, list(t["shape"]), decode))
        params = doc.get("parameters") or {}
        binary_all = bool(params.get("binary_data_output", False))
        requested = []
        for o in doc.get("outputs") or []:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT, "each requested output needs a \"name\"")
            requested.append((o["name"], (o.get("parameters") or {}).get("binary_data")))
        return wire, requested, binary_all

    @staticmethod
    def _kserve_response(model: HostedModel, response: Any, request_id: str, requested: dict[str, bool | None],
                         binary_all: bool) -> Response:
        outputs, blobs = [], []
        for t in response.output_tensors():
            if requested and t.name() not in requested:
                continue
            array = t.as_numpy()
            datatype = model.output_datatype(t.name(), array)
            entry: dict[str, Any] = {"name": t.name(), "datatype": datatype, "shape": list(array.shape)}
            binary = requested.get(t.name())
            if binary if binary is not None else binary_all:
                blob = encode_bytes(array) if datatype == "BYTES" else np.ascontiguousarray(array).tobytes()
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = _json_values(array, datatype)
            outputs.append(entry)
        doc = {"model_name": model.name, "model_version": model.version, "outputs": outputs}
        if request_id:
            doc["id"] = request_id
        header = json.dumps(doc).encode()
        if not blobs:
            return Response(header, media_type="application/json")
        return Response(header + b"".join(blobs), media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(header))})

    # -- the generate extension ---------------------------------------------------------------------
    async def generate(self, request: Request) -> Any:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: Request) -> Any:
        return await self._generate(request, stream=True)

    async def _generate(self, request: Request, stream: bool) -> Any:
        async def handle(release):
            model = self._model(request)
            doc = parse_json(await read_body(request))
            if not isinstance(doc, dict):
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT, "the generate request must be a JSON object")
            request_id = str(doc.get("id", "")) if "id" in doc and "id" not in model.inputs else ""
            wire, parameters = self._generate_request(model, doc)
            deliveries, sender = await self._start(model, wire, request_id, parameters, [])
            if not stream:
                response = await _only_response(deliveries, sender, NON_STREAM_MANY)
                return Guarded(JSONResponse(self._generate_response(model, response, request_id)), release)
            first = await deliveries.queue.get()  # its outcome sets the status code, as in Triton
            status = first.error.http_status if first.error is not None else 200

            async def events():
                d = first
                while True:
                    if d.error is not None:
                        yield sse({"error": str(d.error)})
                    elif d.response is not None:
                        yield sse(self._generate_response(model, d.response, request_id))
                    if d.final:
                        return
                    d = await deliveries.queue.get()

            return Guarded(StreamingResponse(events(), status_code=status, media_type="text/event-stream; charset=utf-8"),
                           sender.cancel, release)

        return await self._guarded("generate_stream" if stream else "generate", handle)

    @staticmethod
    def _generate_request(model: HostedModel, doc: dict[str, Any]) -> tuple[list[WireTensor], dict[str, Any]]:
        wire: list[WireTensor] = []
        parameters: dict[str, Any] = {}

        def take(obj: dict[str, Any], nested: bool) -> None:
            for key, value in obj.items():
                if key == "parameters" and not nested and key not in model.inputs:
                    if not isinstance(value, dict):
                        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, "Expected JSON object for keyword: "
                                                                           "'parameters'")
                    take(value, nested=True)
                elif key in model.inputs:
                    wire.append(_generate_tensor(model, key, value))
                elif key == "id" and not nested:
                    continue
                elif isinstance(value, (str, int, float, bool)):
                    parameters[key] = value
                else:
                    raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"parameter '{key}' must be a string, number or boolean (it names no input of "
                                     f"model '{model.name}', whose inputs are {sorted(model.inputs)})")

        take(doc, nested=False)
        return wire, parameters

    @staticmethod
    def _generate_response(model: HostedModel, response: Any, request_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
        if request_id:
            doc["id"] = request_id
        for t in response.output_tensors():
            array = t.as_numpy()
            values = _json_values(array, model.output_datatype(t.name(), array))
            doc[t.name()] = values[0] if len(values) == 1 else values
        return doc


def _generate_tensor(model: HostedModel, name: str, value: Any) -> WireTensor:
    """A generate-request value (a scalar or a 1-D array) shaped to the input's dims as Triton does:
    fixed dims take their share, the innermost variable dim the rest, other variable dims 1."""
    if isinstance(value, list) and any(isinstance(v, (list, dict)) for v in value) or isinstance(value, dict):
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"input '{name}' must be a value or a 1-D array")
    count = len(value) if isinstance(value, list) else 1
    dims = [int(d) for d in model.inputs[name].dims]
    shape, rest = list(dims), count
    for i in reversed(range(len(dims))):
        if dims[i] != -1:
            if rest % dims[i]:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"The schema can not convert input '{name}' to tensor with proper shape")
            rest //= dims[i]
    variable = [i for i, d in enumerate(dims) if d == -1]
    for i in variable:
        shape[i] = 1
    if variable:
        shape[variable[-1]] = rest
    elif rest != 1:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"The schema can not convert input '{name}' to tensor with proper shape")
    datatype = model.input_datatype(name)
    return WireTensor(name, datatype, shape, lambda: _from_json(name, datatype, value))


async def _only_response(deliveries: LoopDeliveries, sender: Any, too_many: str) -> Any:
    """The one response of a non-streamed request (the sender is cancelled if waiting fails);
    INTERNAL with `too_many` when the model sent several."""
    try:
        responses = await collect_responses(deliveries)
    except BaseException:
        sender.cancel()
        raise
    if len(responses) != 1:
        raise InferError(grpc.StatusCode.INTERNAL, too_many)
    return responses[0]
