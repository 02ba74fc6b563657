"""A `tritonclient.grpc` client for the generated DFlash model (works with tritonserver too).

It speaks the llmapi contract (config.pbtxt: text_input, streaming, sampling_param_*,
return_finish_reason) and uses whichever call the repository allows, as Triton does. The prompt
goes as one chat turn (``text_input_format`` = "user": the model applies the target's chat
template, as `dflash-trt generate` encodes a prompt); ``text_input_format=None`` sends it as
upstream's clients do, raw text:

- a decoupled model: the streaming API (ModelStreamInfer; tritonserver refuses unary calls to
  decoupled models); with stream=True text arrives as the drafter's blocks are accepted (each
  response holds the whole text so far; `on_text` gets the new part), and
  ``enable_empty_final_response`` makes the end explicit;
- a model that is not decoupled: one unary ModelInfer; with stream=True the whole answer comes
  at once (such a model cannot stream).

`dflash-trt client http://host:port ...` goes through openai_client.py instead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_trt.errors import DFlashError

STAT_OUTPUTS = ("tau", "acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens", "num_input_tokens",
                "num_cached_tokens", "kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_hit_rate",
                "num_output_tokens", "num_steps", "max_draft_len", "queue_time_ms", "decode_time_ms",
                "arrival_time_ns", "first_token_time_ns")
# lists: one value per draft position (0-based), and the histogram of accepted drafts per step
POSITION_OUTPUTS = ("position_drafted", "position_accepted", "acceptance_histogram")


@dataclass
class ClientResult:
    text: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)  # the model's statistics outputs (per-position: lists)
    ttft_s: float = 0.0  # request sent -> first text received (client side)
    latency_s: float = 0.0  # request sent -> final response
    chunks: int = 0
    streamed: bool = False  # text came in pieces (a decoupled model asked to stream)


def build_inputs(prompt: str | bytes, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 stream: bool = False, text_input_format: str | None = "user",
                 perf_metrics: bool = False) -> list[Any]:
    """InferInputs named and typed as in triton_repo/dflash/config.pbtxt.in (the llmapi contract);
    `text_input_format`: "user" (one chat turn), "messages" (a JSON array of chat messages), or
    None / "raw" (the text as it is, upstream's meaning); `perf_metrics`: ask for the *_time_ns outputs."""
    from tritonclient.grpc import InferInput

    def tensor(name: str, datatype: str, array: np.ndarray) -> Any:
        t = InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    text = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    inputs = [tensor("text_input", "BYTES", np.array([text], dtype=np.object_)),
              tensor("streaming", "BOOL", np.array([stream], dtype=bool)),
              tensor("return_finish_reason", "BOOL", np.array([True], dtype=bool))]
    if text_input_format not in (None, "raw"):
        inputs.append(tensor("text_input_format", "BYTES", np.array([text_input_format.encode()], dtype=np.object_)))
    if perf_metrics:
        inputs.append(tensor("sampling_param_return_perf_metrics", "BOOL", np.array([True], dtype=bool)))
    if max_tokens is not None:
        inputs.append(tensor("sampling_param_max_tokens", "INT32", np.array([max_tokens], dtype=np.int32)))
    if temperature is not None:
        inputs.append(tensor("sampling_param_temperature", "FP32", np.array([temperature], dtype=np.float32)))
    if top_p is not None:
        inputs.append(tensor("sampling_param_top_p", "FP32", np.array([top_p], dtype=np.float32)))
    if seed is not None:
        inputs.append(tensor("sampling_param_seed", "UINT64", np.array([seed], dtype=np.uint64)))
    if stop:
        inputs.append(tensor("sampling_param_stop", "BYTES", np.array([s.encode("utf-8") for s in stop],
                                                                      dtype=np.object_)))
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
    for name in POSITION_OUTPUTS:
        array = result.as_numpy(name)
        if array is not None:
            extra[name] = [int(x) for x in array.reshape(-1)]
    return text, extra


def per_position_acceptance(stats: dict[str, Any]) -> list[float] | None:
    """accepted / drafted at each draft position, from a response's per-position counts (None: absent)."""
    drafted, accepted = stats.get("position_drafted"), stats.get("position_accepted")
    if drafted is None or accepted is None:
        return None
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


@dataclass(frozen=True)
class ModelInfo:
    decoupled: bool  # streams (ModelStreamInfer); else one unary ModelInfer
    formats: bool  # declares text_input_format (dflash-trt's model.py; upstream's llmapi model does not)


_MODELS: dict[tuple[str, str], ModelInfo] = {}
_MODELS_LOCK = threading.Lock()


def model_info(client: Any, url: str, model: str) -> ModelInfo:
    """What the client needs of `model`'s config at `url` (asked once per process)."""
    key = (url, model)
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key]
    config = client.get_model_config(model, client_timeout=30).config
    info = ModelInfo(bool(config.model_transaction_policy.decoupled),
                     any(i.name == "text_input_format" for i in config.input))
    with _MODELS_LOCK:
        _MODELS[key] = info
    return info


def is_decoupled(client: Any, url: str, model: str) -> bool:
    """Whether `model` at `url` is decoupled (its config, asked once per process)."""
    return model_info(client, url, model).decoupled


def generate(url: str, prompt: str | bytes, model: str = "dflash", stream: bool = False,
             on_text: Callable[[str], None] | None = None, timeout_s: float = 300.0, request_id: str = "",
             raw: bool = False, **sampling: Any) -> ClientResult:
    """Send one request and wait (at most `timeout_s`) for its final response. `raw`: the prompt as
    raw text (upstream's meaning), else one chat turn (text_input_format "user")."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    sampling.setdefault("text_input_format", None if raw else "user")

    client = grpcclient.InferenceServerClient(url=url)
    t0 = time.perf_counter()
    try:
        info = model_info(client, url, model)
        if not info.formats and sampling["text_input_format"] not in (None, "raw"):
            if sampling["text_input_format"] != "user":
                raise DFlashError(f"{url} model {model!r} takes raw text only (its config declares no "
                                  f"text_input_format, as upstream's llmapi model); send one prompt as raw text")
            _warn_raw(url, model)
            sampling["text_input_format"] = None
        if info.decoupled:
            out = _stream(client, url, model, prompt, stream, on_text, timeout_s, request_id, sampling)
        else:
            r = client.infer(model, build_inputs(prompt, stream=False, **sampling), request_id=request_id,
                             client_timeout=timeout_s)
            text, extra = read_result(r)
            out = ClientResult(text, str(extra.pop("finish_reason", "")), extra, chunks=1 if text else 0)
            out.ttft_s = time.perf_counter() - t0
            if on_text is not None and text:
                on_text(text)
    except InferenceServerException as e:
        raise DFlashError(_reason(url, model, e)) from None
    finally:
        client.close()
    out.latency_s = time.perf_counter() - t0
    return out


_WARNED: set[tuple[str, str]] = set()


def _warn_raw(url: str, model: str) -> None:
    """Once per model: a prompt meant as a chat turn goes as raw text to a model that cannot take one."""
    import sys

    if (url, model) not in _WARNED:
        _WARNED.add((url, model))
        print(f"note: {url} model {model!r} declares no text_input_format (upstream's llmapi model): the prompt goes "
              f"as raw text, no chat template; pass --raw to say so", file=sys.stderr)


def _reason(url: str, model: str, e: Any) -> str:
    message = " ".join(str(e.message() if hasattr(e, "message") else e).split())
    status = str(e.status()) if hasattr(e, "status") and e.status() else ""
    if "UNAVAILABLE" in status and ("connect" in message.lower() or "failed" in message.lower()):
        return f"cannot reach the server at {url}: {message}; is `dflash-trt serve` running there?"
    return f"{url} model {model!r}: {message}"


def _stream(client: Any, url: str, model: str, prompt: str | bytes, stream: bool,
            on_text: Callable[[str], None] | None, timeout_s: float, request_id: str,
            sampling: dict[str, Any]) -> ClientResult:
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    out = ClientResult("", "", streamed=stream)
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
                raise DFlashError(_reason(url, model, error))
            text, extra = read_result(result)
            if len(text) > len(out.text):  # each response holds the whole text so far
                if not out.chunks:
                    out.ttft_s = time.perf_counter() - t0
                new, out.text = text[len(out.text):], text
                out.chunks += 1
                if on_text is not None:
                    on_text(new)
            if "finish_reason" in extra:
                out.finish_reason = str(extra.pop("finish_reason"))
            out.stats.update(extra)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except InferenceServerException as e:
        # A stream that could not start reports the real cause (e.g. connection refused) through the
        # callback; the exception raised by async_stream_infer only says the stream is broken.
        cause: Any = e
        try:
            _, error = responses.get(timeout=1.0)
            cause = error if error is not None else e
        except queue.Empty:
            pass
        raise DFlashError(_reason(url, model, cause)) from None
    finally:
        client.stop_stream(cancel_requests=True)
    return out
