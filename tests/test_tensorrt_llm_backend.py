"""The TensorRT-LLM backend against a stand-in `tensorrt_llm` module: streaming, cancel, the
sampling-parameter and statistics mapping, K from the manifest.

TensorRT-LLM cannot be installed on these machines, so the stand-in is built ONLY from upstream's
real names, recorded as data in tests/upstream/tensorrt_llm_llmapi.json with the source file and
commit each comes from (NVIDIA/TensorRT-LLM: tensorrt_llm/llmapi/llm.py @ 00966934ce32 for
``LLM.generate_async(inputs, sampling_params, ..., streaming)``; tensorrt_llm/executor/result.py @
005bc848893f for ``CompletionOutput`` (text, token_ids, finish_reason, text_diff);
tensorrt_llm/serve/openai_server.py @ 00057725d9a6 for ``RequestOutput`` (async iteration,
finished, outputs, abort) and ``outputs[0].request_perf_metrics.speculative_decoding.{total_draft_tokens,
total_accepted_draft_tokens, acceptance_rate}``; tensorrt_llm/sampling_params.py @ 000a01de66f0 for
``SamplingParams``; DFlashDecodingConfig's fields from dflash_trt/engine/llm_api.py). A keyword the
backend passes that upstream lacks fails here (kw-only dataclasses, no **kwargs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trt.engine.llm_api import SECTION_KEYS
from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.serving.backends import BackendSettings, load_backend
from dflash_trt.serving.protocol import GenerateRequest

try:
    from tests.engine_fixtures import shared_gpu_tiny_engine, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import shared_gpu_tiny_engine, shared_tiny_engine

UPSTREAM = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_llmapi.json").read_text())
PIECES = ["Paris", " is", " the", " capital", "."]  # what the stand-in engine streams, one piece per step
PERF = {"total_draft_tokens": 12, "total_accepted_draft_tokens": 6, "acceptance_rate": 0.5}


def _kw_only_dataclass(name: str, fields: list[str]) -> type:
    return dataclasses.make_dataclass(name, [(f, object, dataclasses.field(default=None)) for f in fields],
                                      kw_only=True)


StandInSamplingParams = _kw_only_dataclass("SamplingParams", UPSTREAM["SamplingParams"]["fields_used"])
DFlashDecodingConfig = _kw_only_dataclass("DFlashDecodingConfig",
                                          sorted(SECTION_KEYS["speculative_config"] - {"decoding_type"}))
CompletionOutput = _kw_only_dataclass("CompletionOutput", UPSTREAM["CompletionOutput"]["fields"]
                                      + ["text_diff", "request_perf_metrics"])


class RequestOutput:
    """Async-iterable like upstream's: one CompletionOutput per streamed step, then finished."""

    def __init__(self, prompt_ids: list[int], params: object, pace_s: float, finish_reason: str) -> None:
        self.prompt_token_ids, self.params, self.pace_s = prompt_ids, params, pace_s
        self.finish_reason, self.finished, self.aborted = finish_reason, False, False
        self.outputs: list = []

    def abort(self) -> None:
        self.aborted = True

    async def _steps(self):
        text, ids = "", []
        for i, piece in enumerate(PIECES):
            await asyncio.sleep(self.pace_s)
            if self.aborted:
                return
            text, ids = text + piece, ids + [100 + i]
            self.finished = i == len(PIECES) - 1
            perf = SimpleNamespace(speculative_decoding=SimpleNamespace(**PERF)) if self.finished else None
            self.outputs = [CompletionOutput(index=0, text=text, token_ids=list(ids), text_diff=piece,
                                             finish_reason=self.finish_reason if self.finished else None,
                                             request_perf_metrics=perf)]
            yield self

    def __aiter__(self):
        return self._steps()


class LLM:
    instances: list = []

    def __init__(self, model: str, speculative_config: object = None, **kwargs: object) -> None:
        # As upstream's DecodingBaseConfig.speculative_model (and LLM's model): a local directory,
        # resolved against the process's working directory, or else a hub id to download
        # (tests/upstream/tensorrt_llm_node.json) -- which a node without the hub cannot.
        for what, path in (("model", model), ("speculative_model", getattr(speculative_config, "speculative_model", None))):
            if not Path(str(path)).is_dir():
                raise OSError(f"{what} {path!r} is no directory under {Path.cwd()}: TensorRT-LLM would take it for a hub id")
        self.model, self.speculative_config, self.kwargs = model, speculative_config, kwargs
        self.requests: list[RequestOutput] = []
        self.pace_s, self.finish_reason, self.closed = 0.0, "stop", False
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, queries=None, kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None) -> RequestOutput:
        assert streaming and isinstance(inputs, list) and all(isinstance(i, int) for i in inputs)
        out = RequestOutput(inputs, sampling_params, self.pace_s, self.finish_reason)
        self.requests.append(out)
        return out

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def standin(monkeypatch):
    """`tensorrt_llm` and `tensorrt_llm.llmapi` as a DFlash-capable release would provide them."""
    trt = types.ModuleType("tensorrt_llm")
    trt.__version__ = "1.3.0rc20"
    trt.LLM, trt.SamplingParams = LLM, StandInSamplingParams
    trt.llmapi = types.ModuleType("tensorrt_llm.llmapi")
    trt.llmapi.DFlashDecodingConfig = DFlashDecodingConfig
    monkeypatch.setitem(sys.modules, "tensorrt_llm", trt)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", trt.llmapi)
    LLM.instances = []
    return trt


@pytest.fixture
def engine(tmp_path_factory) -> Path:
    """A GPU engine (h100, bfloat16): TensorRT-LLM is never handed a CPU one."""
    return shared_gpu_tiny_engine(tmp_path_factory)


def test_standin_has_upstreams_signature():
    names = [p for p in inspect.signature(LLM.generate_async).parameters if p != "self"]
    assert names == UPSTREAM["LLM.generate_async"]["parameters"]
    assert set(UPSTREAM["CompletionOutput"]["finish_reasons"]) == {"stop", "length", "timeout", "cancelled"}


def test_streaming_sampling_params_and_statistics_are_mapped(standin, engine):
    backend = load_backend(engine, BackendSettings(backend="auto", max_draft_len=3))
    try:
        assert backend.backend == "tensorrt_llm" and "K=3" in backend.describe()
        llm = LLM.instances[-1]
        spec = llm.speculative_config
        assert spec.max_draft_len == 3  # K: the manifest's 7, lowered for this run
        assert spec.speculative_model == str(engine.resolve() / "draft")  # engine-relative path resolved
        assert llm.model == str(engine.resolve() / "target")
        assert llm.kwargs["tensor_parallel_size"] == 1 and "speculative_config" not in llm.kwargs
        params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=4, stop=["\n\n"])
        gen = backend.submit(GenerateRequest("Hello world", params=params))
        chunks = list(gen)
        assert [c.text for c in chunks] == PIECES and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        final = chunks[-1]
        assert final.finish_reason == "stop"
        req = llm.requests[-1]
        assert req.prompt_token_ids == backend.codec.encode("Hello world")  # our chat template, our ids
        sp = req.params
        assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop, sp.return_perf_metrics) == (
            9, 0.7, 0.9, 4, ["\n\n"], True)
        s = final.stats
        assert (s.total_draft_tokens, s.total_accepted_draft_tokens, s.acceptance_rate) == (12, 6, 0.5)
        assert s.tau == pytest.approx(1 + 3 * 0.5)  # K drafts every step: steps = drafted / K
        assert s.num_output_tokens == len(PIECES) and s.num_prompt_tokens == len(req.prompt_token_ids)
        assert 0 <= s.ttft_s <= s.decode_s
        default = backend.submit(GenerateRequest("Hi"))
        default.text()
        assert llm.requests[-1].params.max_tokens == backend.default_max_tokens
        with pytest.raises(InvalidRequest, match="max_seq_len"):
            backend.submit(GenerateRequest("Hi", params=SamplingParams(max_tokens=backend.max_seq_len + 1)))
    finally:
        backend.shutdown()
    assert LLM.instances[-1].closed


def test_cancel_aborts_the_request_and_ends_it_cancelled(standin, engine):
    backend = load_backend(engine, BackendSettings(backend="tensorrt_llm"))
    try:
        llm = LLM.instances[-1]
        llm.pace_s = 0.05
        gen = backend.submit(GenerateRequest("Hello world"))
        it = iter(gen)
        first = next(it)
        assert first.text == PIECES[0] and not first.finished
        gen.cancel()
        rest = list(it)
        assert rest and rest[-1].finished and rest[-1].finish_reason == "cancelled"
        assert llm.requests[-1].aborted and len(rest) < len(PIECES)
        llm.pace_s, llm.finish_reason = 0.0, "timeout"  # upstream's timeout is reported as cancelled
        assert backend.submit(GenerateRequest("Hi")).text()[1].finish_reason == "cancelled"
    finally:
        backend.shutdown()


def test_a_cpu_engine_is_never_handed_to_tensorrt_llm(standin, tmp_path_factory):
    """A CPU engine is float32 and TensorRT-LLM's DFlash kernels take fp16/bf16 only (flash-attn's
    README @ 014c349, tests/upstream/tensorrt_llm_node.json): even with TensorRT-LLM installed, auto
    serves it on the pytorch backend and asking for tensorrt_llm is one line."""
    cpu_engine = shared_tiny_engine(tmp_path_factory)
    with pytest.raises(DFlashError, match="float16/bfloat16 on a GPU only"):
        load_backend(cpu_engine, BackendSettings(backend="tensorrt_llm"))
    backend = load_backend(cpu_engine, BackendSettings(backend="auto"))
    try:
        assert backend.backend == "pytorch" and not LLM.instances
    finally:
        backend.shutdown()



def test_the_engine_loads_from_any_working_directory(standin, engine, tmp_path, monkeypatch):
    """`serve ENGINE` and a Triton repository's model.yaml give TensorRT-LLM absolute paths, so the
    drafter is found whatever directory the server was started in (the YAML's ./draft would not be)."""
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.serving.repository import TritonRepoSettings, generate_repository

    elsewhere = tmp_path / "submit-dir"
    elsewhere.mkdir()
    repo = generate_repository(engine, tmp_path / "repo", TritonRepoSettings(backend="tensorrt_llm"))
    monkeypatch.chdir(elsewhere)
    import yaml

    assert not Path("draft").exists()
    with pytest.raises(OSError, match="hub id"):  # the stand-in is strict: the YAML's own path fails here
        LLM(model=str(engine / "target"), speculative_config=DFlashDecodingConfig(speculative_model="./draft"))
    kwargs = {k: v for k, v in yaml.safe_load((repo / "dflash" / "1" / "model.yaml").read_text()).items()
              if k != "triton_config"}
    for backend in (load_backend(engine, BackendSettings(backend="tensorrt_llm")),
                    load_backend(engine, BackendSettings(backend="tensorrt_llm"), llm_kwargs=kwargs)):
        try:
            assert LLM.instances[-1].speculative_config.speculative_model == str(engine.resolve() / "draft")
        finally:
            backend.shutdown()
    assert load_manifest(engine).llm_api_options == "llm_api_options.yaml"
