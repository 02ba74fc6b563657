"""A `tritonclient.grpc` client for the generated DFlash model (works with tritonserver too).

It always uses the streaming API (ModelStreamInfer): tritonserver only serves decoupled models
that way. With stream=False the model answers with one response; with stream=True text arrives
as the drafter's blocks are accepted. `enable_empty_final_response` makes the end explicit.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_trt.errors import DFlashError

STAT_OUTPUTS = ("acceptance_length", "acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens",
                "num_output_tokens", "queue_time_ms", "decode_time_ms")


@dataclass
class ClientResult:
    text: str
    finish_reason: str
    stats: dict[str, float] = field(default_factory=dict)  # the model's statistics outputs
    ttft_s: float = 0.0  # request sent -> first text received (client side)
    latency_s: float = 0.0  # request sent -> final response
    chunks: int = 0


def build_inputs(prompt: str | bytes, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 stream: bool = False) -> list[Any]:
    """InferInputs named and typed as in triton_repo/dflash/config.pbtxt.in."""
    from tritonclient.grpc import InferInput

    def tensor(name: str, datatype: str, array: np.ndarray) -> Any:
        t = InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    text = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    inputs = [tensor("text_input", "BYTES", np.array([text], dtype=np.object_)),
              tensor("stream", "BOOL", np.array([stream], dtype=bool))]
    if max_tokens is not None:
        inputs.append(tensor("max_tokens", "INT32", np.array([max_tokens], dtype=np.int32)))
    if temperature is not None:
        inputs.append(tensor("temperature", "FP32", np.array([temperature], dtype=np.float32)))
    if top_p is not None:
        inputs.append(tensor("top_p", "FP32", np.array([top_p], dtype=np.float32)))
    if seed is not None:
        inputs.append(tensor("seed", "UINT64", np.array([seed], dtype=np.uint64)))
    if stop:
        inputs.append(tensor("stop", "BYTES", np.array([s.encode("utf-8") for s in stop], dtype=np.object_)))
    return inputs


def _scalar(result: Any, name: str) -> Any:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value.item()


def read_result(result: Any) -> tuple[str, dict[str, Any]]:
    """(text_output, {finish_reason and statistics present in this response})."""
    text = _scalar(result, "text_output") or ""
    extra = {n: v for n in ("finish_reason", *STAT_OUTPUTS) if (v := _scalar(result, n)) is not None}
    return text, extra


def generate(url: str, prompt: str | bytes, model: str = "dflash", stream: bool = False,
             on_text: Callable[[str], None] | None = None, timeout_s: float = 300.0, request_id: str = "",
             **sampling: Any) -> ClientResult:
    """Send one request over a gRPC stream and wait (at most `timeout_s`) for its final response."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    parts: list[str] = []
    out = ClientResult("", "")
    t0 = time.perf_counter()
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, build_inputs(prompt, stream=stream, **sampling), request_id=request_id,
                                  enable_empty_final_response=True)
        deadline = t0 + timeout_s
        while True:
            try:
                result, error = responses.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                raise DFlashError(f"no final response from {url} within {timeout_s:.0f}s; raise --timeout or check "
                                  f"the server") from None
            if error is not None:
                raise DFlashError(f"{url} model {model!r}: {error.message() if hasattr(error, 'message') else error}")
            text, extra = read_result(result)
            if text:
                if not parts:
                    out.ttft_s = time.perf_counter() - t0
                parts.append(text)
                out.chunks += 1
                if on_text is not None:
                    on_text(text)
            if "finish_reason" in extra:
                out.finish_reason = str(extra.pop("finish_reason"))
            out.stats.update(extra)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except InferenceServerException as e:
        # A stream that could not start reports the real cause (e.g. connection refused) through the
        # callback; the exception raised by async_stream_infer only says the stream is broken.
        cause = e.message()
        try:
            _, error = responses.get(timeout=1.0)
            cause = error.message() if error is not None else cause
        except queue.Empty:
            pass
        raise DFlashError(f"cannot reach the server at {url}: {' '.join(str(cause).split())}; is `dflash-trt serve` "
                          f"running there?") from None
    finally:
        try:
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()
    out.text = "".join(parts)
    out.latency_s = time.perf_counter() - t0
    return out
