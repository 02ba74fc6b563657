"""Host a Triton Python-backend model: load its model.py through `triton_python_backend_utils`
(our pb_utils, installed in sys.modules) and do what Triton core does around it: check each
request's inputs against config.pbtxt, hand the model `pb_utils.InferenceRequest`s, and turn the
responses it sends back into `inference.ModelInferResponse` messages.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
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
FAILURE_REASONS = {grpc.StatusCode.INVALID_ARGUMENT: "REJECTED", grpc.StatusCode.CANCELLED: "CANCELED",
                   grpc.StatusCode.UNAVAILABLE: "REJECTED"}


class InferError(Exception):
    """A request-level failure: gRPC status + one-line message (Triton prefixes the request id)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def wire_datatype(config_type: str) -> str:
    """config.pbtxt TYPE_* -> the KServe v2 datatype name on the wire (TYPE_STRING -> BYTES)."""
    name = config_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


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


class HostedModel:
    """One model of the repository, loaded and initialized."""

    def __init__(self, model_dir: Path, version: str = "1") -> None:
        from google.protobuf import json_format

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
        self.decoupled = self.config.model_transaction_policy.decoupled
        self.inputs = {i.name: i for i in self.config.input}
        self.outputs = {o.name: o for o in self.config.output}
        self.stats = ModelStats()
        self._execute_lock = threading.Lock()  # Triton calls execute() of an instance one batch at a time
        model_py = model_dir / version / "model.py"
        if not model_py.is_file():
            raise DFlashError(f"{model_py} missing; regenerate the repository with `dflash-trt deploy triton`")
        _install_pb_utils()
        spec = importlib.util.spec_from_file_location(f"triton_model_{self.name}_{version}", model_py)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config_json = json_format.MessageToDict(self.config, preserving_proto_field_name=True)
        for tensors in (config_json.get("input", []), config_json.get("output", [])):
            for t in tensors:  # MessageToDict renders int64 as strings; Triton gives numbers
                t["dims"] = [int(d) for d in t.get("dims", [])]
        self.instance = module.TritonPythonModel()
        args = {
            "model_config": json.dumps(config_json), "model_instance_kind": "CPU",
            "model_instance_name": f"{self.name}_0", "model_instance_device_id": "0",
            "model_repository": str(model_dir), "model_version": version, "model_name": self.name,
        }
        try:
            self.instance.initialize(args)
        except pb_utils.TritonModelException as e:
            raise DFlashError(f"model {self.name!r} failed to load: {e}")
        except ImportError as e:  # a model.py copied by another dflash-trt version names modules this one lacks
            raise DFlashError(f"model {self.name!r} failed to load: {e}; the repository was written by another "
                              f"dflash-trt version, regenerate it with `dflash-trt deploy triton`")

    # -- request decoding (Triton core's checks) --------------------------------------------------
    def decode_inputs(self, request: Any) -> list[pb_utils.Tensor]:
        from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

        tensors: list[pb_utils.Tensor] = []
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(request.inputs):
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{len(request.inputs)} inputs but {len(raw)} raw_input_contents for model '{self.name}'")
        seen = set()
        for idx, tin in enumerate(request.inputs):
            cfg = self.inputs.get(tin.name)
            if cfg is None:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected inference input '{tin.name}' for model '{self.name}'; "
                                 f"it accepts {sorted(self.inputs)}")
            seen.add(tin.name)
            want = wire_datatype(model_config_type_name(cfg.data_type))
            if tin.datatype != want:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"inference input '{tin.name}' data-type is '{tin.datatype}', but model "
                                 f"'{self.name}' expects '{want}'")
            shape = [int(s) for s in tin.shape]
            dims = [int(d) for d in cfg.dims]
            if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)):
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected shape for input '{tin.name}' for model '{self.name}'. "
                                 f"Expected {dims}, got {shape}")
            n = int(np.prod(shape)) if shape else 1
            if raw:
                if want == "BYTES":
                    array = deserialize_bytes_tensor(raw[idx])
                    if array is None:
                        array = np.empty(0, dtype=np.object_)
                else:
                    array = np.frombuffer(raw[idx], dtype=triton_to_np_dtype(want))
            else:
                array = _from_contents(tin.contents, want)
            if array.size != n:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"input '{tin.name}' holds {array.size} elements but its shape {shape} needs {n}")
            tensors.append(pb_utils.Tensor(tin.name, array.reshape(shape)))
        missing = [name for name, cfg in self.inputs.items() if not cfg.optional and name not in seen]
        if missing:
            raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"expected {len(self.inputs)} inputs but got {len(request.inputs)} inputs for model "
                             f"'{self.name}'. Got input(s) {sorted(seen)}, but missing required input(s) {missing}. "
                             f"Please provide all required input(s).")
        for out in request.outputs:
            if out.name not in self.outputs:
                raise InferError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"unexpected inference output '{out.name}' for model '{self.name}'")
        return tensors

    # -- response encoding --------------------------------------------------------------------------
    def encode_response(self, response: pb_utils.InferenceResponse, request_id: str, requested: list[str]):
        from tritonclient.grpc import service_pb2
        from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

        msg = service_pb2.ModelInferResponse(model_name=self.name, model_version=self.version, id=request_id)
        values: dict[str, Any] = {}
        for t in response.output_tensors():
            if requested and t.name() not in requested:
                continue
            array = t.as_numpy()
            cfg = self.outputs.get(t.name())
            datatype = wire_datatype(model_config_type_name(cfg.data_type)) if cfg else np_to_triton_dtype(array.dtype)
            out = msg.outputs.add(name=t.name(), datatype=datatype, shape=list(array.shape))
            del out  # metadata only; the data goes in raw_output_contents, like tritonserver does
            if datatype == "BYTES":
                msg.raw_output_contents.append(serialize_byte_tensor(array).item())
            else:
                msg.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
            if array.size == 1:
                values[t.name()] = array.reshape(-1)[0]
        return msg, values

    def execute(self, request: pb_utils.InferenceRequest) -> None:
        with self._execute_lock:
            self.instance.execute([request])

    def finalize(self) -> None:
        finalize = getattr(self.instance, "finalize", None)
        if finalize is not None:
            finalize()


def model_config_type_name(value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(value)


def _from_contents(contents: Any, datatype: str) -> np.ndarray:
    from tritonclient.utils import triton_to_np_dtype

    if datatype == "BYTES":
        return np.array(list(contents.bytes_contents), dtype=np.object_)
    field_of = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                "FP64": "fp64_contents"}
    if datatype not in field_of:
        raise InferError(grpc.StatusCode.INVALID_ARGUMENT, f"datatype {datatype} needs raw_input_contents")
    return np.array(list(getattr(contents, field_of[datatype])), dtype=triton_to_np_dtype(datatype))


@dataclass
class Delivery:
    """What the host hands the transport for each response the model sends."""

    response: Any  # service_pb2.ModelInferResponse or None (empty final)
    error: InferError | None
    final: bool


def make_sender(model: HostedModel, request_id: str, requested: list[str], deliver: Callable[[Delivery], None],
                on_final: Callable[[bool, grpc.StatusCode | None, dict[str, Any]], None],
                on_first: Callable[[], None]) -> pb_utils.ResponseSender:
    """A response sender that converts the model's responses and reports the request's outcome."""
    state = {"first": True, "error": None, "values": {}}

    def send(response: pb_utils.InferenceResponse | None, flags: int) -> None:
        final = bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is not None and state["first"]:
            state["first"] = False
            on_first()
        if response is not None and response.has_error():
            err = response.error()
            code = GRPC_CODES.get(err.code(), grpc.StatusCode.INTERNAL)
            state["error"] = code
            deliver(Delivery(None, InferError(code, err.message()), final))
        elif response is not None:
            msg, values = model.encode_response(response, request_id, requested)
            state["values"].update(values)
            deliver(Delivery(msg, None, final))
        elif final:
            deliver(Delivery(None, None, True))
        if final:
            on_final(state["error"] is None, state["error"], state["values"])

    return pb_utils.ResponseSender(send)


def now_ns() -> int:
    return time.time_ns()
