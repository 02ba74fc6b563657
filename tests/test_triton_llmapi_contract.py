"""The repository `dflash-trt deploy triton` writes speaks tensorrtllm_backend's `llmapi` contract.

TensorRT-LLM cannot run on these machines, so the contract is upstream's real names recorded as
data, with source file and commit: tests/upstream/tensorrtllm_backend_llmapi.json
(NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt, 1/model.yaml,
1/model.py; triton-inference-server/server for the decoupled refusals). The generated config.pbtxt
and model.yaml are checked against it, and a client built ONLY from those names (no dflash_trt
helper) talks to the real tritonserver serving our repository, both as a unary client of the
default repository and as a streaming client of a decoupled one. Upstream's model hands text_input
to TensorRT-LLM as raw text, so such a client gets the answer to its raw prompt here too.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from dflash_trt.serving.repository import generate_repository
from tests.engine_fixtures import reference_answer, shared_tiny_engine

pytestmark = pytest.mark.timeout(120)

UPSTREAM = json.loads((Path(__file__).parent / "upstream" / "tensorrtllm_backend_llmapi.json").read_text())
CONFIG = UPSTREAM["config_pbtxt"]
# our outputs beside upstream's: (datatype, dims) as config.pbtxt must declare them
OURS_OUTPUT_TYPES = {"tau": ("TYPE_FP32", [1]), "num_input_tokens": ("TYPE_INT32", [1]),
                     "num_cached_tokens": ("TYPE_INT32", [1]),
                     "num_output_tokens": ("TYPE_INT32", [1]), "num_steps": ("TYPE_INT32", [1]),
                     "max_draft_len": ("TYPE_INT32", [1]),
                     "queue_time_ms": ("TYPE_FP32", [1]), "decode_time_ms": ("TYPE_FP32", [1]),
                     "position_drafted": ("TYPE_INT32", [-1]), "position_accepted": ("TYPE_INT32", [-1]),
                     "acceptance_histogram": ("TYPE_INT32", [-1])}
OURS_EXTRA_OUTPUTS = set(OURS_OUTPUT_TYPES)
# our one input beside upstream's: optional, so upstream's clients never need it
OURS_INPUT_TYPES = {"text_input_format": ("TYPE_STRING", [1], True)}
# config.pbtxt TYPE_* -> the datatype string a Triton client sends
WIRE = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32",
        "TYPE_UINT64": "UINT64", "TYPE_INT64": "INT64"}
NUMPY = {"BYTES": np.object_, "BOOL": bool, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}
PROMPT = "The capital of France is"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return shared_tiny_engine(tmp_path_factory)


def _upstream_input(name: str, value) -> grpcclient.InferInput:
    """An input typed and shaped from upstream's config.pbtxt alone."""
    spec = next(i for i in CONFIG["inputs"] if i["name"] == name)
    datatype = WIRE[spec["data_type"]]
    array = np.array(value if isinstance(value, list) else [value], dtype=NUMPY[datatype])
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def _request(stream: bool) -> list[grpcclient.InferInput]:
    return [_upstream_input("text_input", [PROMPT.encode()]), _upstream_input("streaming", stream),
            _upstream_input("sampling_param_max_tokens", MAX_TOKENS), _upstream_input("return_finish_reason", True)]


def _text(result) -> str:
    out = result.as_numpy("text_output")
    return out.reshape(-1)[0].decode() if out is not None and out.size else ""


def test_config_and_model_yaml_match_upstream(engine, tmp_path):
    repo = generate_repository(engine, tmp_path / "repo")
    from google.protobuf import text_format

    cfg = text_format.Parse((repo / "dflash" / "config.pbtxt").read_text(), mc.ModelConfig())
    ours_in = {i.name: (mc.DataType.Name(i.data_type), list(i.dims), i.optional) for i in cfg.input}
    for spec in CONFIG["inputs"]:  # every upstream input, same type, dims and optionality
        assert ours_in[spec["name"]] == (spec["data_type"], spec["dims"], spec.get("optional", False)), spec["name"]
    assert set(ours_in) - {i["name"] for i in CONFIG["inputs"]} == set(OURS_INPUT_TYPES)
    assert {name: ours_in[name] for name in OURS_INPUT_TYPES} == OURS_INPUT_TYPES
    ours_out = {o.name: (mc.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output}
    for spec in CONFIG["outputs"]:
        assert ours_out[spec["name"]] == (spec["data_type"], spec["dims"]), spec["name"]
    assert set(ours_out) - {o["name"] for o in CONFIG["outputs"]} == OURS_EXTRA_OUTPUTS
    assert {name: ours_out[name] for name in OURS_EXTRA_OUTPUTS} == OURS_OUTPUT_TYPES
    assert cfg.backend == CONFIG["backend"]
    model_yaml = yaml.safe_load((repo / "dflash" / "1" / "model.yaml").read_text())
    assert model_yaml["triton_config"]["decoupled"] is UPSTREAM["model_yaml"]["triton_config"]["decoupled"]
    assert set(UPSTREAM["model_yaml"]["llm_kwargs"]) & set(model_yaml) >= {"model", "backend"}


def test_an_upstream_unary_client_gets_the_reference_answer(triton_unary, engine):
    with grpcclient.InferenceServerClient(triton_unary.grpc_url) as c:
        r = c.infer("dflash", _request(stream=False), client_timeout=60)
        assert _text(r) == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
        assert r.as_numpy("finish_reason").reshape(-1)[0].decode() in ("length", "stop")
        assert 0 <= int(r.as_numpy("total_accepted_draft_tokens")[0]) <= int(r.as_numpy("total_draft_tokens")[0])
        # per draft position j: the steps that drafted it and the steps that kept it, summing to the totals
        drafted, accepted = r.as_numpy("position_drafted"), r.as_numpy("position_accepted")
        assert drafted.dtype == np.int32 and drafted.ndim == 1 and drafted.shape == accepted.shape
        assert drafted.sum() == int(r.as_numpy("total_draft_tokens")[0])
        assert accepted.sum() == int(r.as_numpy("total_accepted_draft_tokens")[0])
        assert (accepted <= drafted).all() and list(drafted) == sorted(drafted, reverse=True)
        with pytest.raises(InferenceServerException) as exc:  # upstream model.py's own refusal
            c.infer("dflash", _request(stream=True), client_timeout=60)
        assert UPSTREAM["model_py"]["behaviour"]["streaming_needs_decoupled"] in exc.value.message()


def test_an_upstream_streaming_client_of_a_decoupled_model(triton_streaming, engine):
    url = triton_streaming.grpc_url
    with grpcclient.InferenceServerClient(url) as c, pytest.raises(InferenceServerException) as exc:
        c.infer("dflash", _request(stream=False), client_timeout=60)
    refusal = UPSTREAM["triton_server"]["grpc_unary_on_decoupled"]
    assert refusal["message"] in exc.value.message() and "UNIMPLEMENTED" in str(exc.value.status())
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    texts = []
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer("dflash", _request(stream=True), request_id="s1", enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            texts.append(_text(result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    texts = [t for t in texts if t]
    assert len(set(texts)) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative text
    assert texts[-1] == reference_answer(engine, PROMPT, MAX_TOKENS, raw=True)
