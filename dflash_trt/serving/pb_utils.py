"""The part of Triton's `triton_python_backend_utils` that a Python-backend model.py uses.

`dflash-trt serve` installs this module as ``sys.modules["triton_python_backend_utils"]`` before
importing the repository's model.py, so the file the tests exercise is the file a real Triton
server runs. Names and signatures follow the Python backend's documented interface (Tensor,
InferenceRequest, InferenceResponse, TritonError, TritonModelException, Logger, response senders,
ModelConfig for ``auto_complete_config``, TRITONSERVER_RESPONSE_COMPLETE_FINAL,
get_input_tensor_by_name, ...); only what model.py needs is implemented, and anything else raises
AttributeError rather than pretending.

As in Triton's Python backend (since 23.10), every request has a response sender, decoupled or
not; a model that is not decoupled must send exactly one response, flagged final.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1

_log = logging.getLogger("triton_python_backend_utils")

# config.pbtxt data types -> numpy (Triton's TYPE_STRING is an object array of bytes)
_TYPE_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class TritonModelException(Exception):
    """Raised by a model to fail initialize() or a request."""


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True

    def shape(self) -> list[int]:
        return list(self._array.shape)


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Decoupled-mode sender. The host passes `deliver(response, flags)` to route responses."""

    def __init__(self, deliver: Callable[[InferenceResponse | None, int], None]) -> None:
        self._deliver = deliver
        self._cancelled = threading.Event()
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._closed:
                raise TritonModelException("response sender already closed by a COMPLETE_FINAL flag")
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._closed = True
        self._deliver(response, flags)

    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    # host side
    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def closed(self) -> bool:
        return self._closed


class InferenceRequest:
    def __init__(self, inputs: list[Tensor], request_id: str = "", sender: ResponseSender | None = None,
                 parameters: dict[str, Any] | None = None, requested_output_names: list[str] | None = None,
                 model_name: str = "", model_version: int = 1) -> None:
        self._inputs = inputs
        self._request_id = request_id
        self._sender = sender
        self._parameters = parameters or {}
        self._requested = requested_output_names or []
        self._model_name = model_name
        self._model_version = model_version

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def requested_output_names(self) -> list[str]:
        return self._requested

    def model_name(self) -> str:
        return self._model_name

    def get_response_sender(self) -> ResponseSender:
        if self._sender is None:
            raise TritonModelException("this request has no response sender")
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.is_cancelled()


class ModelConfig:
    """What ``TritonPythonModel.auto_complete_config`` receives: the model's config.pbtxt as a
    dict, completed by the model before Triton loads it (the setters used by model.py)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self._config["max_batch_size"] = int(max_batch_size)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = {"decoupled": bool(transaction_policy_dict.get("decoupled", False))}


class Logger:
    @staticmethod
    def log_info(message: str) -> None:
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug(message)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in model_config.get("input", []) if c["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in model_config.get("output", []) if c["name"] == name), None)


def triton_string_to_numpy(triton_type: str) -> Any:
    return _TYPE_TO_NUMPY[triton_type]


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
