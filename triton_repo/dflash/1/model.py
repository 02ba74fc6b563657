"""Triton Python-backend model: DFlash speculative decoding over one dflash-trt engine directory.

Copied unchanged into every repository `dflash-trt deploy triton` writes; everything specific to
a deployment is in config.pbtxt's `parameters`. Runs inside a real Triton server (the Python
backend provides `triton_python_backend_utils`) and inside `dflash-trt serve` (which installs its
own implementation of that module), so both run this exact file.

The engine is loaded by dflash_trt.serving.backends.load_backend: TensorRT-LLM's LLM API (from
the engine's llm_api_options.yaml) when `tensorrt_llm` is importable and has DFlashDecodingConfig,
otherwise dflash-trt's pytorch backend (the batched runtime with the repository's policy); the
choice and its reason are logged. This file only translates Triton requests and responses
(dflash_trt.serving.protocol): the sampling inputs become one SamplingParams, validated once.
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# What this model reads and writes; config.pbtxt must declare exactly these (checked at load).
INPUTS = ("text_input", "max_tokens", "temperature", "top_p", "seed", "stop", "stream")
OUTPUTS = ("text_output", "finish_reason", "acceptance_length", "acceptance_rate", "total_draft_tokens",
           "total_accepted_draft_tokens", "num_output_tokens", "queue_time_ms", "decode_time_ms")
PARAMETERS = ("engine_dir", "backend", "default_max_tokens", "max_queue", "policy", "max_draft_len", "dtype", "device")
OPTIONAL_PARAMETERS = {"cuda_graphs": "false"}  # absent from repositories written before it existed


class _BadRequest(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args):
        from dflash_trt.serving.backends import BackendSettings, load_backend

        self.model_config = config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "config.pbtxt must set model_transaction_policy { decoupled: true }; regenerate it with "
                "`dflash-trt deploy triton`")
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
            cuda_graphs=params.get("cuda_graphs", OPTIONAL_PARAMETERS["cuda_graphs"]) == "true",
        )
        self.engine = load_backend(params["engine_dir"], settings)
        pb_utils.Logger.log_info(f"dflash: engine {params['engine_dir']} loaded: {self.engine.describe()}")

    def execute(self, requests):
        # Decoupled: return at once and answer through each request's response sender, so the
        # server's request thread is never held by a generation. The runtime queues them.
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="dflash-request", daemon=True).start()
        return None

    def finalize(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(cancel_pending=True)

    # ------------------------------------------------------------------------------------------
    def _serve(self, request):
        from dflash_trt.serving.protocol import InvalidRequest, ServerBusy

        sender = request.get_response_sender()
        try:
            gen_request, stream = self._parse(request)
            generation = self.engine.submit(gen_request)
        except (_BadRequest, InvalidRequest) as e:
            return self._fail(sender, str(e), pb_utils.TritonError.INVALID_ARG)
        except ServerBusy as e:
            return self._fail(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
        generation.watch(sender.is_cancelled)
        try:
            if stream:
                for chunk in generation:
                    if chunk.finished:
                        break
                    if chunk.text:
                        sender.send(self._response(chunk.text))
                final_text = chunk.text
            else:
                final_text, chunk = generation.text()
        except Exception as e:  # noqa: BLE001 - the request fails, the model keeps serving
            return self._fail(sender, str(e), pb_utils.TritonError.INTERNAL)
        if chunk.finish_reason == "cancelled" and sender.is_cancelled():
            return self._fail(sender, "request cancelled by the client", pb_utils.TritonError.CANCELLED)
        sender.send(self._response(final_text, chunk), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _fail(sender, message, code):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(text, final=None):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if final is not None:
            s = final.stats
            tensors += [
                pb_utils.Tensor("finish_reason", np.array([final.finish_reason.encode()], dtype=np.object_)),
                pb_utils.Tensor("acceptance_length", np.array([s.acceptance_length], dtype=np.float32)),
                pb_utils.Tensor("acceptance_rate", np.array([s.acceptance_rate], dtype=np.float32)),
                pb_utils.Tensor("total_draft_tokens", np.array([s.total_draft_tokens], dtype=np.int32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.array([s.total_accepted_draft_tokens], dtype=np.int32)),
                pb_utils.Tensor("num_output_tokens", np.array([s.num_output_tokens], dtype=np.int32)),
                pb_utils.Tensor("queue_time_ms", np.array([s.queue_s * 1e3], dtype=np.float32)),
                pb_utils.Tensor("decode_time_ms", np.array([s.decode_s * 1e3], dtype=np.float32)),
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

        prompt = scalar("text_input")
        if prompt is None:
            raise _BadRequest("text_input is missing; send the prompt as a BYTES tensor of shape [1]")
        stop_tensor = pb_utils.get_input_tensor_by_name(request, "stop")
        stop = () if stop_tensor is None else tuple(text(s, "stop") for s in stop_tensor.as_numpy().reshape(-1))
        max_tokens = scalar("max_tokens")
        seed = scalar("seed")
        params = SamplingParams(  # raises InvalidRequest (NaN, inf, out of range)
            max_tokens=None if max_tokens is None else int(max_tokens),
            temperature=float(scalar("temperature", 0.0)),
            top_p=float(scalar("top_p", 1.0)),
            seed=None if seed is None else int(seed),
            stop=stop,
        )
        prompt_text = text(prompt, "text_input")
        if not prompt_text:
            raise _BadRequest("text_input is empty; send a non-empty prompt")
        return GenerateRequest(prompt=prompt_text, params=params), bool(scalar("stream", False))
