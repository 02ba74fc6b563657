"""The KServe v2 gRPC service (`inference.GRPCInferenceService`, Triton's) on grpc.aio.

Every RPC is a coroutine on the server's event loop: an open stream costs no thread, so health
checks and metadata answer however many streams are open. As tritonserver:

- ModelInfer (unary) refuses a decoupled model with UNIMPLEMENTED "ModelInfer RPC doesn't
  support models with decoupled transaction policy"; ModelStreamInfer serves both kinds;
- errors on a stream come back as that request's ``error_message`` (prefixed with its id), the
  stream stays usable; ``triton_enable_empty_final_response`` asks for an explicit final flag.

Beyond it: each stream and each unary call holds a stream slot (RESOURCE_EXHAUSTED past
``--max-streams``), a stream with nothing in flight is closed after ``--stream-idle-timeout``
seconds (UNAVAILABLE, so clients reconnect), and the RPCs this server does not offer answer
UNIMPLEMENTED with one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dflash_trt import __version__
from dflash_trt.serving.core import EXTENSIONS, SERVER_NAME, InferenceCore
from dflash_trt.serving.host import (
    DECOUPLED_GRPC_REFUSAL,
    Delivery,
    HostedModel,
    InferError,
    WireTensor,
    decode_bytes,
    encode_bytes,
)

log = logging.getLogger("dflash_trt.serving")

_WAKE = object()
_READER_DONE = object()
# proto field of each KServe datatype in InferTensorContents (requests without raw contents)
_CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                   "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                   "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                   "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def _error_text(request_id: str, message: str) -> str:
    return f"[request id: {request_id}] {message}" if request_id else message


def wire_tensors(request: Any) -> list[WireTensor]:
    """A ModelInferRequest's inputs (raw_input_contents or typed contents), decoded lazily."""
    from tritonclient.utils import triton_to_np_dtype

    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{len(request.inputs)} inputs but {len(raw)} raw_input_contents for model "
                         f"'{request.model_name}'")

    def decoder(idx: int, tin: Any):
        def decode() -> np.ndarray:
            dtype = tin.datatype
            if raw:
                if dtype == "BYTES":
                    return decode_bytes(raw[idx], tin.name)
                np_dtype = triton_to_np_dtype(dtype)
                if len(raw[idx]) % np.dtype(np_dtype).itemsize:
                    raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"input '{tin.name}': {len(raw[idx])} raw bytes are not a whole number of "
                                     f"{dtype} elements")
                return np.frombuffer(raw[idx], dtype=np_dtype)
            values = list(getattr(tin.contents, _CONTENTS_FIELD[dtype]))
            return np.array(values, dtype=np.object_ if dtype == "BYTES" else triton_to_np_dtype(dtype))
        return decode

    out = []
    for idx, tin in enumerate(request.inputs):
        if tin.datatype not in _CONTENTS_FIELD:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"input '{tin.name}' has unsupported datatype '{tin.datatype}'")
        out.append(WireTensor(tin.name, tin.datatype, [int(s) for s in tin.shape], decoder(idx, tin)))
    return out


def request_parameters(request: Any) -> dict[str, Any]:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.parameters.items()
            if v.WhichOneof("parameter_choice")}


def encode_response(model: HostedModel, response: Any, request_id: str, requested: list[str]) -> Any:
    """A model's pb_utils.InferenceResponse as a ModelInferResponse (data in raw_output_contents,
    like tritonserver), only the requested outputs when the request named some."""
    msg = service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    for t in response.output_tensors():
        if requested and t.name() not in requested:
            continue
        array = t.as_numpy()
        datatype = model.output_datatype(t.name(), array)
        msg.outputs.add(name=t.name(), datatype=datatype, shape=list(array.shape))
        msg.raw_output_contents.append(encode_bytes(array) if datatype == "BYTES"
                                       else np.ascontiguousarray(array).tobytes())
    return msg


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: InferenceCore, stream_idle_timeout_s: float | None = None) -> None:
        self.core = core
        self.idle_s = stream_idle_timeout_s or None
        self._streams: set[asyncio.Queue] = set()

    def wake_streams(self) -> None:
        """At shutdown: streams with nothing in flight end now instead of waiting for the grace."""
        for q in list(self._streams):
            q.put_nowait(_WAKE)

    async def _model(self, name: str, version: str, context: Any) -> HostedModel:
        try:
            return self.core.model(name, version)
        except InferError as e:
            await context.abort(e.code, str(e))
            raise  # unreachable: abort raises

    # -- health and metadata: no stream slot, answered however busy the server is -----------------
    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.core.ready)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    async def ModelMetadata(self, request, context):
        meta = (await self._model(request.name, request.version, context)).metadata()
        TM = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[TM(**t) for t in meta["inputs"]], outputs=[TM(**t) for t in meta["outputs"]])

    async def ModelConfig(self, request, context):
        m = await self._model(request.name, request.version, context)
        return service_pb2.ModelConfigResponse(config=m.config)

    async def ModelStatistics(self, request, context):
        from google.protobuf import json_format

        try:
            stats = self.core.statistics(request.name, request.version)
        except InferError as e:
            await context.abort(e.code, str(e))
        return json_format.ParseDict({"model_stats": stats}, service_pb2.ModelStatisticsResponse())

    async def RepositoryIndex(self, request, context):
        out = service_pb2.RepositoryIndexResponse()
        for name, m in sorted(self.core.models.items()):
            out.models.add(name=name, version=m.version, state="READY" if self.core.ready else "UNAVAILABLE")
        return out

    # -- inference ------------------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        release = None
        try:
            release = self.core.slots.acquire("ModelInfer")
            return await self._unary(request)
        except InferError as e:
            await context.abort(e.code, _error_text(request.id, str(e)))
        finally:
            if release is not None:
                release()

    async def _unary(self, request: Any) -> Any:
        from dflash_trt.serving.core import LoopDeliveries, collect_responses

        model = self.core.model(request.model_name, request.model_version)
        if model.decoupled:
            raise InferError(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_GRPC_REFUSAL)
        self.core.check_ready()
        timer = self.core.timer(model)
        requested = [o.name for o in request.outputs]
        try:
            inputs = model.check_inputs(wire_tensors(request))
            model.check_outputs(requested)
        except InferError as e:
            timer.finish(False, e.code, {})
            raise
        deliveries = LoopDeliveries(asyncio.get_running_loop())
        sender = await self.core.submit(model, timer, inputs, request.id, request_parameters(request), requested,
                                        deliveries)
        try:
            data = await collect_responses(deliveries)
        except asyncio.CancelledError:  # client gone or deadline: stop generating for it
            sender.cancel()
            raise
        if len(data) != 1:
            raise InferError(grpc.StatusCode.INTERNAL, f"model '{model.name}' sent {len(data)} responses to a "
                                                       f"unary request; a model that is not decoupled sends one")
        return encode_response(model, data[0], request.id, requested)

    async def ModelStreamInfer(self, request_iterator, context):
        try:
            release = self.core.slots.acquire("ModelStreamInfer")
        except InferError as e:
            await context.abort(e.code, str(e))
        try:
            async for message in self._stream(request_iterator, context):
                yield message
        finally:
            release()

    async def _stream(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Any] = asyncio.Queue()
        state = {"inflight": 0}
        senders: set[Any] = set()

        def error_message(request: Any, e: InferError) -> Any:
            return service_pb2.ModelStreamInferResponse(
                error_message=_error_text(request.id, str(e)),
                infer_response=service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id))

        def finished() -> None:
            state["inflight"] -= 1
            out.put_nowait(_WAKE)

        async def one(request: Any) -> None:
            enable_empty = request.parameters["triton_enable_empty_final_response"].bool_param \
                if "triton_enable_empty_final_response" in request.parameters else False
            requested = [o.name for o in request.outputs]
            timer = None
            try:
                model = self.core.model(request.model_name, request.model_version)
                self.core.check_ready()
                timer = self.core.timer(model)
                inputs = model.check_inputs(wire_tensors(request))
                model.check_outputs(requested)
            except InferError as e:
                if timer is not None:
                    timer.finish(False, e.code, {})
                out.put_nowait(error_message(request, e))
                return

            def deliver(d: Delivery) -> None:  # on the model's thread: encode there, hand over to the loop
                if d.error is not None:
                    msg = error_message(request, d.error)
                elif d.response is not None:
                    r = encode_response(model, d.response, request.id, requested)
                    if enable_empty:
                        r.parameters["triton_final_response"].bool_param = d.final
                    msg = service_pb2.ModelStreamInferResponse(infer_response=r)
                elif enable_empty:  # FINAL flag with no data: Triton's empty final response
                    r = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
                    r.parameters["triton_final_response"].bool_param = True
                    msg = service_pb2.ModelStreamInferResponse(infer_response=r)
                else:
                    msg = None
                try:
                    if msg is not None:
                        loop.call_soon_threadsafe(out.put_nowait, msg)
                    if d.final:
                        loop.call_soon_threadsafe(finished)
                except RuntimeError:  # loop closed: the server stopped
                    pass

            state["inflight"] += 1
            try:
                senders.add(await self.core.submit(model, timer, inputs, request.id, request_parameters(request),
                                                   requested, deliver))
            except InferError as e:
                timer.finish(False, e.code, {})
                state["inflight"] -= 1
                out.put_nowait(error_message(request, e))

        async def reader() -> None:
            try:
                async for request in request_iterator:
                    await one(request)
                    out.put_nowait(_WAKE)  # a request arrived: the stream is not idle
            except (grpc.RpcError, asyncio.CancelledError):
                pass  # the client went away; the handler's cleanup cancels what is in flight
            finally:
                out.put_nowait(_READER_DONE)

        self._streams.add(out)
        task = asyncio.create_task(reader())
        reader_done = False
        try:
            while True:
                idle = state["inflight"] == 0
                if idle and (reader_done or not self.core.ready) and out.empty():
                    return
                try:
                    item = await asyncio.wait_for(out.get(), self.idle_s if idle else None)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"stream idle for {self.idle_s:g} s with no request in flight: closed by the "
                                        f"server (--stream-idle-timeout); open a new stream")
                if item is _READER_DONE:
                    reader_done = True
                elif item is not _WAKE:
                    yield item
        finally:
            self._streams.discard(out)
            task.cancel()
            for s in senders:
                s.cancel()


def _unimplemented(name: str):
    async def refuse(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{name} is not supported by dflash-trt serve (models load at start with --load-model; "
                            f"no shared memory, tracing or log settings)")

    refuse.__name__ = name
    return refuse


# every RPC of the service that InferenceServicer does not implement: one line, no traceback
for _method in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
    if _method.name not in InferenceServicer.__dict__:
        setattr(InferenceServicer, _method.name, _unimplemented(_method.name))
