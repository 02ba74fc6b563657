"""Triton Python-backend model: DFlash speculative decoding over one dflash-trt engine directory.

Copied unchanged into every repository `dflash-trt deploy triton` writes; everything specific to
a deployment is in config.pbtxt's `parameters` and in model.yaml beside this file. It runs in
tritonserver's Python backend (`dflash-trt serve` starts tritonserver over the repository; on a
node, NVIDIA's container runs it), which provides `triton_python_backend_utils`.

It speaks the contract of tensorrtllm_backend's `llmapi` model (NVIDIA/TensorRT-LLM,
triton_backend/all_models/llmapi/tensorrt_llm): the same inputs and outputs, model.yaml's
`triton_config` deciding `decoupled` through auto_complete_config, streaming only when
decoupled, text_output holding the whole text so far, finish_reason / stop_reason on request,
the `stop` input cancelling the requests of a request id, and `text_input` handed to the engine
as raw text, as upstream hands it to TensorRT-LLM. Beyond it:

- the optional input `text_input_format` (ours; upstream's clients never send it): "raw" (the
  default, upstream's meaning), "user" (text_input is one user turn: the target's chat template
  is applied, assistant turn opened) or "messages" (text_input is a JSON array of OpenAI chat
  messages, through the same template). `dflash-trt client` sends "user", the OpenAI front
  "messages" for /v1/chat/completions;
- the final response always carries the speculative statistics (acceptance_rate,
  total_draft_tokens, total_accepted_draft_tokens, tau), the per-position counts
  (position_drafted[j] / position_accepted[j]: steps that drafted / accepted draft position j,
  0-based), acceptance_histogram[j] (drafting steps that accepted exactly j drafts), num_steps,
  max_draft_len (K), num_input_tokens, num_output_tokens, queue_time_ms, decode_time_ms;
- the same statistics are counted on Triton's own metrics port through the backend's custom
  metrics (dflash_trt/serving/metrics.py: ours, and vLLM's and TensorRT-LLM's names), before the
  final response is sent, so a client that reads the metrics after its answer finds it counted.

The engine is loaded by dflash_trt.serving.backends.load_backend with the repository's backend
(TensorRT-LLM with model.yaml's LLM() arguments, or dflash-trt's pytorch backend). This file only
translates Triton requests and responses: the sampling inputs become one SamplingParams,
validated once.
"""

import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

# What this model reads and writes; config.pbtxt must declare exactly these (checked at load).
INPUTS = ("text_input", "image_url", "streaming", "sampling_param_best_of", "sampling_param_temperature",
          "sampling_param_top_k", "sampling_param_top_p", "sampling_param_frequency_penalty",
          "sampling_param_presence_penalty", "sampling_param_max_tokens", "sampling_param_stop",
          "sampling_param_seed", "sampling_param_exclude_input_from_output", "sampling_param_return_perf_metrics",
          "return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop", "lora_id", "lora_name",
          "lora_path", "lora_ckpt_source", "text_input_format")
OUTPUTS = ("text_output", "finish_reason", "stop_reason", "cumulative_logprob", "kv_cache_reused_block",
           "kv_cache_missed_block", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks", "kv_cache_hit_rate",
           "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
           "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
           "tau", "num_input_tokens", "num_cached_tokens", "num_output_tokens", "num_steps", "max_draft_len", "queue_time_ms",
           "decode_time_ms", "position_drafted", "position_accepted", "acceptance_histogram")
TEXT_INPUT_FORMATS = ("raw", "user", "messages")  # text_input_format's values (module docstring)
PARAMETERS = ("engine_dir", "backend", "default_max_tokens", "max_queue", "policy", "max_draft_len", "draft_method",
              "dtype", "device", "cuda_graphs", "torch_compile")
# upstream's override of the model.yaml path (relative to this folder)
MODEL_YAML = os.environ.get("LLM_CONFIG_PATH", "model.yaml")
CANCELLED = "Request cancelled by client"


class _BadRequest(Exception):
    pass


def _model_yaml():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), MODEL_YAML)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise pb_utils.TritonModelException(f"cannot read {path} ({e}); regenerate the repository with "
                                            f"`dflash-trt deploy triton`")
    if not isinstance(data.get("triton_config"), dict):
        raise pb_utils.TritonModelException(f"{path} has no triton_config; regenerate the repository with "
                                            f"`dflash-trt deploy triton`")
    return data


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """model.yaml's triton_config decides decoupled and max_batch_size, as in upstream's llmapi."""
        triton = _model_yaml()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton.get("decoupled", False))))
        auto_complete_model_config.set_max_batch_size(int(triton.get("max_batch_size", 0)))
        return auto_complete_model_config

    def initialize(self, args):
        from dflash_trt.serving.backends import BackendSettings, load_backend

        self.model_config = config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        declared_in = {c["name"] for c in config.get("input", [])}
        declared_out = {c["name"] for c in config.get("output", [])}
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        missing = (set(INPUTS) - declared_in) | (set(OUTPUTS) - declared_out) | (set(PARAMETERS) - set(params))
        if missing:
            raise pb_utils.TritonModelException(
                f"config.pbtxt does not declare {sorted(missing)} that model.py uses; regenerate it with "
                f"`dflash-trt deploy triton`")
        settings = BackendSettings(
            backend=params["backend"], dtype=params["dtype"], device=params["device"],
            default_max_tokens=int(params["default_max_tokens"]), max_queue=int(params["max_queue"]),
            policy=params["policy"], max_draft_len=int(params["max_draft_len"]),
            draft_method=params["draft_method"] or None,  # "": the backend's own
            draft_len_schedule=params.get("draft_len_schedule") or None,  # a repository written before it: the engine's
            cuda_graphs={"true": True, "false": False}.get(params["cuda_graphs"]),  # "auto": on for CUDA
            torch_compile=params["torch_compile"] == "true",
            # a repository written before prefix caching: the runtime's default (on)
            **({"prefix_cache": params["prefix_cache"] == "true"} if "prefix_cache" in params else {}),
            **({"prefix_cache_mib": float(params["prefix_cache_mib"])} if params.get("prefix_cache_mib") else {}),
        )
        llm_kwargs = {k: v for k, v in _model_yaml().items() if k != "triton_config"}
        self.backend = load_backend(params["engine_dir"], settings, llm_kwargs=llm_kwargs)
        from dflash_trt.serving.metrics import SpeculationMetrics

        self.metrics = SpeculationMetrics(pb_utils, args.get("model_name", config.get("name", "")),
                                          str(args.get("model_version", "1")))
        # the pytorch backend's batched runtime with its prefix cache on (None: no prefix cache)
        self.prefix_caching = getattr(self.backend, "prefix_cache_stats", lambda: None)() is not None
        self._live = {}  # request id -> its running Generations (the `stop` input cancels them)
        self._lock = threading.Lock()
        pb_utils.Logger.log_info(f"dflash: engine {params['engine_dir']} loaded ({'decoupled' if self.decoupled else 'not decoupled'}): "
                                 f"{self.backend.describe()}")

    def execute(self, requests):
        # Return at once and answer through each request's response sender (decoupled or not, as
        # upstream's llmapi model), so the server's request thread is never held by a generation.
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="dflash-request", daemon=True).start()
        return None

    def finalize(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown(cancel_pending=True)

    # ------------------------------------------------------------------------------------------
    def _serve(self, request):
        from dflash_trt.serving.protocol import InvalidRequest, ServerBusy

        sender = request.get_response_sender()
        request_id = request.request_id()
        try:
            parsed = self._parse(request)
        except (_BadRequest, InvalidRequest) as e:
            return _fail(sender, str(e), pb_utils.TritonError.INVALID_ARG)
        if parsed["stop"]:
            return self._stop(request_id, sender)
        if parsed["streaming"] and not self.decoupled:
            return _fail(sender, "Streaming is only supported in decoupled mode. (this repository was written without "
                                 "--decoupled; regenerate it with `dflash-trt deploy triton --decoupled` or send "
                                 "streaming=false)", pb_utils.TritonError.INVALID_ARG)
        arrival_ns = time.monotonic_ns()
        try:
            generation = self.backend.submit(parsed["request"])
        except InvalidRequest as e:
            return _fail(sender, str(e), pb_utils.TritonError.INVALID_ARG)
        except ServerBusy as e:
            return _fail(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
        generation.watch(sender.is_cancelled)
        self._track(request_id, generation, add=True)
        text, final, cancelled = "", None, False
        try:
            for chunk in generation:
                text += chunk.text
                if chunk.finished:
                    # asked for now: the iteration itself cancels the generation once it is left
                    final, cancelled = chunk, generation.is_cancelled()
                    break
                if parsed["streaming"] and chunk.text:
                    sender.send(self._response(text, parsed))
        except Exception as e:  # noqa: BLE001 - the request fails alone, the model keeps serving
            return _fail(sender, str(e), pb_utils.TritonError.INTERNAL)
        finally:
            self._track(request_id, generation, add=False)
        if final is None or (final.finish_reason == "cancelled" and cancelled):
            # its row is free from the next step on: say so, with what it had decoded
            produced = final.stats.num_output_tokens if final is not None and final.stats else 0
            self.metrics.request_cancelled()
            pb_utils.Logger.log_info(f"dflash: request {request_id or '-'} cancelled by its client after {produced} "
                                     f"of {parsed['request'].params.max_tokens or 'default'} tokens")
            return _fail(sender, CANCELLED, pb_utils.TritonError.CANCELLED)
        response = self._response(text, parsed, final, arrival_ns)
        self.metrics.request_finished(final.stats, self.prefix_caching)  # before the client can see its answer
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _track(self, request_id, generation, add):
        if not request_id:
            return
        with self._lock:
            live = self._live.setdefault(request_id, set())
            (live.add if add else live.discard)(generation)
            if not live:
                del self._live[request_id]

    def _stop(self, request_id, sender):
        """The `stop` input: cancel what runs under this request id (upstream's handle_stop_request)."""
        if not request_id:
            return _fail(sender, "A request id must be provided for request cancellation",
                         pb_utils.TritonError.INVALID_ARG)
        with self._lock:
            running = list(self._live.get(request_id, ()))
        for generation in running:
            generation.cancel()
        _fail(sender, CANCELLED, pb_utils.TritonError.CANCELLED)

    @staticmethod
    def _response(text, parsed, final=None, arrival_ns=0):
        tensors = [_tensor("text_output", [text.encode("utf-8")], np.object_)]
        if final is None:
            return pb_utils.InferenceResponse(output_tensors=tensors)
        s = final.stats
        if parsed["return_finish_reason"]:
            tensors.append(_tensor("finish_reason", [final.finish_reason.encode()], np.object_))
        if parsed["return_stop_reason"]:
            tensors.append(_tensor("stop_reason", [str(final.stop_reason).encode()], np.object_))
        if parsed["return_perf_metrics"]:  # steady-clock nanoseconds, as TensorRT-LLM's timing metrics
            scheduled = arrival_ns + int(s.queue_s * 1e9)
            tensors += [
                _tensor("arrival_time_ns", [arrival_ns], np.int64),
                _tensor("first_scheduled_time_ns", [scheduled], np.int64),
                _tensor("first_token_time_ns", [scheduled + int(s.ttft_s * 1e9)], np.int64),
                _tensor("last_token_time_ns", [scheduled + int(s.decode_s * 1e9)], np.int64),
            ]
        tensors += [
            _tensor("acceptance_rate", [s.acceptance_rate], np.float32),
            _tensor("total_accepted_draft_tokens", [s.total_accepted_draft_tokens], np.int32),
            _tensor("total_draft_tokens", [s.total_draft_tokens], np.int32),
            _tensor("tau", [s.tau], np.float32),
            _tensor("num_input_tokens", [s.num_prompt_tokens], np.int32),
            _tensor("num_cached_tokens", [s.num_cached_tokens], np.int32),
            # prefix caching, as upstream's outputs: the prompt's blocks reused / computed
            _tensor("kv_cache_reused_block", [s.num_reused_blocks], np.int32),
            _tensor("kv_cache_missed_block", [s.num_missed_blocks], np.int32),
            _tensor("kv_cache_hit_rate", [s.kv_cache_hit_rate], np.float32),
            _tensor("num_output_tokens", [s.num_output_tokens], np.int32),
            _tensor("num_steps", [s.num_steps], np.int32),
            _tensor("max_draft_len", [s.max_draft_len], np.int32),
            _tensor("queue_time_ms", [s.queue_s * 1e3], np.float32),
            _tensor("decode_time_ms", [s.decode_s * 1e3], np.float32),
            # one value per draft position (empty when nothing was drafted, or the backend sees no steps)
            _tensor("position_drafted", s.position_drafted, np.int32),
            _tensor("position_accepted", s.position_accepted, np.int32),
            _tensor("acceptance_histogram", s.acceptance_histogram, np.int32),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _parse(self, request):
        from dflash_trt.sampling_params import SamplingParams
        from dflash_trt.serving.protocol import GenerateRequest

        def scalar(name, default=None):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                return default
            array = tensor.as_numpy()
            if array.size != 1:
                raise _BadRequest(f"{name} must hold exactly one value, got shape {list(array.shape)}")
            return array.reshape(-1)[0]

        def text(value, name):
            if isinstance(value, str):
                return value
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError as e:
                raise _BadRequest(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text")

        parsed = {"stop": bool(scalar("stop", False)), "streaming": bool(scalar("streaming", False)),
                  "return_finish_reason": bool(scalar("return_finish_reason", False)),
                  "return_stop_reason": bool(scalar("return_stop_reason", False)),
                  "return_perf_metrics": bool(scalar("sampling_param_return_perf_metrics", False))}
        if parsed["stop"]:
            return parsed
        _refuse_unsupported(request, scalar)
        prompts = pb_utils.get_input_tensor_by_name(request, "text_input")
        if prompts is None:
            raise _BadRequest("text_input is missing; send the prompt as a BYTES tensor of shape [1]")
        prompts = prompts.as_numpy().reshape(-1)
        if prompts.size != 1:
            raise _BadRequest(f"text_input holds {prompts.size} prompts; this model takes one prompt per request "
                              f"(shape [1])")
        prompt = text(prompts[0], "text_input")
        if not prompt:
            raise _BadRequest("text_input is empty; send a non-empty prompt")
        fmt = scalar("text_input_format")
        fmt = "raw" if fmt is None else text(fmt, "text_input_format")
        if fmt not in TEXT_INPUT_FORMATS:
            raise _BadRequest(f"text_input_format={fmt!r}; send one of {', '.join(TEXT_INPUT_FORMATS)} (raw: the text "
                              f"as it is, as upstream's llmapi model; user: one chat turn; messages: a JSON array of "
                              f"chat messages)")
        stop_tensor = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
        stop = () if stop_tensor is None else tuple(text(s, "sampling_param_stop")
                                                    for s in stop_tensor.as_numpy().reshape(-1))
        max_tokens = scalar("sampling_param_max_tokens")
        seed = scalar("sampling_param_seed")
        params = SamplingParams(  # raises InvalidRequest (NaN, inf, out of range)
            max_tokens=None if max_tokens is None else int(max_tokens),
            temperature=float(scalar("sampling_param_temperature", 0.0)),
            top_p=float(scalar("sampling_param_top_p", 1.0)),
            seed=None if seed is None else int(seed),
            stop=stop,
        )
        if fmt == "messages":
            try:
                messages = json.loads(prompt)
            except json.JSONDecodeError as e:
                raise _BadRequest(f"text_input is not a JSON array of chat messages ({e.msg} at character {e.pos}); "
                                  f'send [{{"role": "user", "content": "..."}}], or text_input_format=raw')
            parsed["request"] = GenerateRequest(messages=messages, params=params)  # InvalidRequest if malformed
        else:
            parsed["request"] = GenerateRequest(prompt=prompt, params=params, raw=fmt == "raw")
        return parsed


def _refuse_unsupported(request, scalar):
    """Inputs of the contract this engine cannot honour: refused by name, never silently ignored."""
    if pb_utils.get_input_tensor_by_name(request, "image_url") is not None:
        raise _BadRequest("image_url: this engine is text-only; send text_input alone")
    if any(pb_utils.get_input_tensor_by_name(request, n) is not None
           for n in ("lora_id", "lora_name", "lora_path", "lora_ckpt_source")):
        raise _BadRequest("lora_*: LoRA adapters are not supported by dflash-trt; send the request without them")
    if scalar("return_cumulative_logprob", False):
        raise _BadRequest("return_cumulative_logprob: dflash-trt computes no log probabilities; leave it false")
    checks = (("sampling_param_best_of", 1, "1 (one answer per request)"),
              ("sampling_param_top_k", 0, "0 (no top-k cut; use sampling_param_top_p)"),
              ("sampling_param_frequency_penalty", 0, "0 (penalties are not supported)"),
              ("sampling_param_presence_penalty", 0, "0 (penalties are not supported)"))
    for name, neutral, fix in checks:
        value = scalar(name)
        if value is not None and value != neutral:
            raise _BadRequest(f"{name}={value} is not supported by dflash-trt; send {fix} or leave it out")


def _tensor(name, values, dtype):
    return pb_utils.Tensor(name, np.array(values, dtype=dtype))


def _fail(sender, message, code):
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
