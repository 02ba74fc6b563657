"""Host a Triton Python-backend model: load its model.py through `triton_python_backend_utils`
(our pb_utils, installed in sys.modules) and do what Triton core does around it, whatever the
transport (gRPC, KServe REST, the generate extension):

- at load: parse config.pbtxt, let the model complete it (``auto_complete_config``: model.yaml's
  ``triton_config`` sets ``decoupled`` and ``max_batch_size``, as in tensorrtllm_backend's llmapi
  model), then ``initialize`` it;
- per request: check the decoded input tensors against the config (names, datatypes, shapes,
  required inputs; Triton's messages), hand the model a ``pb_utils.InferenceRequest`` whose
  response sender reports each response as a :class:`Delivery` to the transport.

Transports decode their wire format into :class:`WireTensor` s and encode the model's
``pb_utils.InferenceResponse`` s themselves; request failures are :class:`InferError` (a gRPC
status code and one line; :data:`HTTP_STATUS` maps the code for HTTP).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from dflash_trt.errors import DFlashError
from dflash_trt.serving import pb_utils

# TritonError codes -> gRPC status codes
GRPC_CODES = {
    pb_utils.TritonError.UNKNOWN: grpc.StatusCode.UNKNOWN,
    pb_utils.TritonError.INTERNAL: grpc.StatusCode.INTERNAL,
    pb_utils.TritonError.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    pb_utils.TritonError.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    pb_utils.TritonError.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    pb_utils.TritonError.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    pb_utils.TritonError.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    pb_utils.TritonError.CANCELLED: grpc.StatusCode.CANCELLED,
}
# gRPC status -> HTTP status, as Triton's HTTP frontend maps its error codes (http_server.cc
# HttpCodeFromError), plus 429 for the server's own stream limit
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.CANCELLED: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.UNKNOWN: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 408,
}
FAILURE_REASONS = {grpc.StatusCode.INVALID_ARGUMENT: "REJECTED", grpc.StatusCode.CANCELLED: "CANCELED",
                   grpc.StatusCode.UNAVAILABLE: "REJECTED", grpc.StatusCode.RESOURCE_EXHAUSTED: "REJECTED"}
# Triton's refusals of a decoupled model on a unary endpoint (src/grpc/infer_handler.cc and
# src/http_server.cc of triton-inference-server/server; recorded in tests/upstream/)
DECOUPLED_GRPC_REFUSAL = "ModelInfer RPC doesn't support models with decoupled transaction policy"
DECOUPLED_HTTP_REFUSAL = "HTTP end point doesn't support models with decoupled transaction policy"


class InferError(Exception):
    """A request-level failure: gRPC status + one-line message (Triton prefixes the request id)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
        self.code = code

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


def wire_datatype(config_type: str) -> str:
    """config.pbtxt TYPE_* -> the KServe v2 datatype name on the wire (TYPE_STRING -> BYTES)."""
    name = config_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def model_config_type_name(value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(value)


def decode_bytes(buffer: bytes, name: str) -> np.ndarray:
    """A BYTES tensor's serialized elements (each a 4-byte little-endian length, then the bytes)
    as an object array; a malformed buffer is the client's error (INVALID_ARGUMENT), not ours."""
    out, offset, n = [], 0, len(buffer)
    while offset < n:
        if offset + 4 > n:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"input '{name}': malformed BYTES data: {n - offset} trailing byte(s) where a 4-byte "
                             f"length prefix was expected; send each element as a 4-byte little-endian length "
                             f"followed by its bytes")
        (size,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if offset + size > n:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"input '{name}': malformed BYTES data: element {len(out)} declares {size} bytes but "
                             f"{n - offset} remain; send each element as a 4-byte little-endian length followed "
                             f"by its bytes")
        out.append(bytes(buffer[offset:offset + size]))
        offset += size
    return np.array(out, dtype=np.object_)


def encode_bytes(array: np.ndarray) -> bytes:
    """The inverse of :func:`decode_bytes` (str elements are UTF-8 encoded)."""
    parts = []
    for item in np.asarray(array, dtype=np.object_).reshape(-1):
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


@dataclass
class WireTensor:
    """One input as a transport read it: name, KServe datatype, shape, and its values, or a
    function that decodes them (called once name, datatype and shape passed the model's checks,
    so a request with a wrong datatype gets that message, not a decoding error)."""

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray | Callable[[], np.ndarray]

    def values(self) -> np.ndarray:
        return self.array() if callable(self.array) else self.array


def _install_pb_utils() -> None:
    # A real Triton Python backend provides this module; never replace one that is there.
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)


@dataclass
class ModelStats:
    """Counters behind ModelStatistics (nanoseconds, as Triton reports them)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0


def _config_json(config: Any) -> dict[str, Any]:
    """A ModelConfig as the Python backend hands it to the model (field names as in config.pbtxt)."""
    from google.protobuf import json_format

    out = json_format.MessageToDict(config, preserving_proto_field_name=True)
    for tensors in (out.get("input", []), out.get("output", [])):
        for t in tensors:  # MessageToDict renders int64 as strings; Triton gives numbers
            t["dims"] = [int(d) for d in t.get("dims", [])]
    if "max_batch_size" in out:
        out["max_batch_size"] = int(out["max_batch_size"])
    return out


class HostedModel:
    """One model of the repository, loaded and initialized."""

    def __init__(self, model_dir: Path, version: str = "1") -> None:
        from dflash_trt.serving.repository import read_model_config

        self.dir = model_dir
        self.config = read_model_config(model_dir)  # model_config_pb2.ModelConfig
        self.name = self.config.name or model_dir.name
        if self.name != model_dir.name:
            raise DFlashError(f"{model_dir}/config.pbtxt names the model {self.name!r} but its folder is "
                              f"{model_dir.name!r}; Triton requires them to match")
        if self.config.backend != "python":
            raise DFlashError(f"{model_dir}: backend {self.config.backend!r} is not supported here (python only)")
        self.version = version
        self.stats = ModelStats()
        self._execute_lock = threading.Lock()  # Triton calls execute() of an instance one batch at a time
        model_py = model_dir / version / "model.py"
        if not model_py.is_file():
            raise DFlashError(f"{model_py} missing; regenerate the repository with `dflash-trt deploy triton`")
        _install_pb_utils()
        spec = importlib.util.spec_from_file_location(f"triton_model_{self.name}_{version}", model_py)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            self._auto_complete(module.TritonPythonModel)
        except pb_utils.TritonModelException as e:
            raise DFlashError(f"model {self.name!r} failed to load: {e}")
        self.decoupled = self.config.model_transaction_policy.decoupled
        self.inputs = {i.name: i for i in self.config.input}
        self.outputs = {o.name: o for o in self.config.output}
        self.instance = module.TritonPythonModel()
        args = {
            "model_config": json.dumps(_config_json(self.config)), "model_instance_kind": "CPU",
            "model_instance_name": f"{self.name}_0", "model_instance_device_id": "0",
            "model_repository": str(model_dir), "model_version": version, "model_name": self.name,
        }
        try:
            self.instance.initialize(args)
        except (pb_utils.TritonModelException, DFlashError) as e:
            raise DFlashError(f"model {self.name!r} failed to load: {e}")
        except ImportError as e:  # a model.py copied by another dflash-trt version names modules this one lacks
            raise DFlashError(f"model {self.name!r} failed to load: {e}; the repository was written by another "
                              f"dflash-trt version, regenerate it with `dflash-trt deploy triton`")

    def _auto_complete(self, model_class: Any) -> None:
        """Triton's Python backend lets the model complete its config before loading it (unless
        --disable-auto-complete-config): what ``auto_complete_config`` sets is applied here too."""
        hook = getattr(model_class, "auto_complete_config", None)
        if hook is None:
            return
        completed = hook(pb_utils.ModelConfig(_config_json(self.config))).as_dict()
        if "max_batch_size" in completed:
            self.config.max_batch_size = int(completed["max_batch_size"])
        policy = completed.get("model_transaction_policy")
        if policy is not None:
            self.config.model_transaction_policy.decoupled = bool(policy.get("decoupled", False))

    # -- Triton core's checks of a request ------------------------------------------------------
    def check_inputs(self, tensors: list[WireTensor]) -> list[pb_utils.Tensor]:
        """The request's inputs as the model sees them; InferError with Triton's wording if the
        config does not allow them."""
        out, seen = [], set()
        for t in tensors:
            cfg = self.inputs.get(t.name)
            if cfg is None:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected inference input '{t.name}' for model '{self.name}'; "
                                 f"it accepts {sorted(self.inputs)}")
            if t.name in seen:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"input '{t.name}' given more than once for model '{self.name}'")
            seen.add(t.name)
            want = self.input_datatype(t.name)
            if t.datatype != want:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"inference input '{t.name}' data-type is '{t.datatype}', but model "
                                 f"'{self.name}' expects '{want}'")
            dims = [int(d) for d in cfg.dims]
            shape = [int(s) for s in t.shape]
            if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)) or min(shape, default=0) < 0:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected shape for input '{t.name}' for model '{self.name}'. "
                                 f"Expected {dims}, got {shape}")
            n = int(np.prod(shape)) if shape else 1
            array = t.values()
            if array.size != n:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"input '{t.name}' holds {array.size} elements but its shape {shape} needs {n}")
            out.append(pb_utils.Tensor(t.name, array.reshape(shape)))
        missing = [name for name, cfg in self.inputs.items() if not cfg.optional and name not in seen]
        if missing:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"expected {len(self.inputs)} inputs but got {len(tensors)} inputs for model "
                             f"'{self.name}'. Got input(s) {sorted(seen)}, but missing required input(s) {missing}. "
                             f"Please provide all required input(s).")
        return out

    def check_outputs(self, names: list[str]) -> None:
        for name in names:
            if name not in self.outputs:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected inference output '{name}' for model '{self.name}'")

    def input_datatype(self, name: str) -> str:
        return wire_datatype(model_config_type_name(self.inputs[name].data_type))

    def output_datatype(self, name: str, array: np.ndarray) -> str:
        from tritonclient.utils import np_to_triton_dtype

        cfg = self.outputs.get(name)
        return wire_datatype(model_config_type_name(cfg.data_type)) if cfg else np_to_triton_dtype(array.dtype)

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata (the same fields over gRPC and HTTP)."""

        def tensors(configs):
            return [{"name": t.name, "datatype": wire_datatype(model_config_type_name(t.data_type)),
                     "shape": [int(d) for d in t.dims]} for t in configs]

        return {"name": self.name, "versions": [self.version], "platform": self.config.backend,
                "inputs": tensors(self.config.input), "outputs": tensors(self.config.output)}

    def config_json(self) -> dict[str, Any]:
        return _config_json(self.config)

    @property
    def backend(self) -> Any:
        """The serving Backend (serving/protocol.py) the model runs, when it exposes one (our
        model.py does): the OpenAI endpoints submit to it, sharing the runtime and its batches."""
        return getattr(self.instance, "backend", None)

    def execute(self, request: pb_utils.InferenceRequest) -> None:
        with self._execute_lock:
            self.instance.execute([request])

    def finalize(self) -> None:
        finalize = getattr(self.instance, "finalize", None)
        if finalize is not None:
            finalize()


def scalar_outputs(response: pb_utils.InferenceResponse) -> dict[str, Any]:
    """The statistics of a response the metrics count: its single-element numeric outputs, and the
    per-position lists (serving/metrics.py PER_POSITION_OUTPUTS) whatever their length."""
    from dflash_trt.serving.metrics import PER_POSITION_OUTPUTS

    values: dict[str, Any] = {}
    for t in response.output_tensors():
        array = t.as_numpy()
        if array.dtype == np.object_:
            continue
        if t.name() in PER_POSITION_OUTPUTS:
            values[t.name()] = array.reshape(-1).tolist()
        elif array.size == 1:
            values[t.name()] = array.reshape(-1)[0].item()
    return values


@dataclass
class Delivery:
    """What the host hands the transport for each response the model sends."""

    response: pb_utils.InferenceResponse | None  # None: an empty final (flags only)
    error: InferError | None
    final: bool


def make_sender(deliver: Callable[[Delivery], None],
                on_final: Callable[[bool, grpc.StatusCode | None, dict[str, Any]], None],
                on_first: Callable[[], None]) -> pb_utils.ResponseSender:
    """A response sender that routes the model's responses and reports the request's outcome."""
    state: dict[str, Any] = {"first": True, "error": None, "values": {}}

    def send(response: pb_utils.InferenceResponse | None, flags: int) -> None:
        final = bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is not None and state["first"]:
            state["first"] = False
            on_first()
        delivery = None
        if response is not None and response.has_error():
            err = response.error()
            code = GRPC_CODES.get(err.code(), grpc.StatusCode.INTERNAL)
            state["error"] = code
            delivery = Delivery(None, InferError(code, err.message()), final)
        elif response is not None:
            state["values"].update(scalar_outputs(response))
            delivery = Delivery(response, None, final)
        elif final:
            delivery = Delivery(None, None, True)
        if final:  # counted before the client can see its last message: metrics read right after it include it
            on_final(state["error"] is None, state["error"], state["values"])
        if delivery is not None:
            deliver(delivery)

    return pb_utils.ResponseSender(send)
