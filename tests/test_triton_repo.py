"""`dflash-trt deploy triton`: the generated model repository, checked against Triton's real schema.

No Triton server binary can run here, so config.pbtxt is parsed strictly with protobuf's text
format into `tritonclient.grpc.model_config_pb2.ModelConfig` (the schema tritonserver itself
uses) and compared with what model.py reads. The same repository is served by the tests in
test_triton_server.py through the Python-backend interface.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

try:
    from tests.engine_fixtures import shared_gpu_tiny_engine, shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import shared_gpu_tiny_engine, shared_tiny_engine

from dflash_trt.cli import main
from dflash_trt.engine.manifest import load_manifest
from dflash_trt.errors import DFlashError
from dflash_trt.resources import resource_dir
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.serving.detokenizer import IncrementalDetokenizer
from dflash_trt.serving.repository import TritonRepoSettings, generate_repository, parse_config, render_config
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return shared_tiny_engine(tmp_path_factory)


def _model_py_names(path: Path) -> dict[str, tuple[str, ...]]:
    """INPUTS / OUTPUTS / PARAMETERS as declared in model.py (read without importing it)."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INPUTS", "OUTPUTS", "PARAMETERS"):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def test_generated_config_parses_strictly_and_matches_model_py(engine, tmp_path):
    repo = generate_repository(engine, tmp_path / "repo")
    cfg = parse_config((repo / "dflash" / "config.pbtxt").read_text())
    manifest = load_manifest(engine)
    from tritonclient.grpc import model_config_pb2 as mc

    assert cfg.name == "dflash" and cfg.backend == "python" and cfg.max_batch_size == 0
    # decoupled is NOT in config.pbtxt: model.yaml's triton_config sets it, as upstream's llmapi model
    # (tests/upstream/tensorrtllm_backend_llmapi.json); the default repository is not decoupled
    assert not cfg.model_transaction_policy.decoupled
    types = {i.name: mc.DataType.Name(i.data_type) for i in cfg.input}
    assert types["text_input"] == "TYPE_STRING" and types["streaming"] == "TYPE_BOOL"
    assert types["sampling_param_max_tokens"] == "TYPE_INT32" and types["sampling_param_temperature"] == "TYPE_FP32"
    optional = {i.name for i in cfg.input if i.optional}
    assert "text_input" not in optional
    assert {"sampling_param_max_tokens", "sampling_param_stop", "streaming", "sampling_param_seed"} <= optional
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["engine_dir"] == str(engine.resolve())
    assert int(params["max_seq_len"]) == manifest.limits.max_seq_len
    assert params["llm_api_options"] == manifest.llm_api_options
    assert 1 <= int(params["default_max_tokens"]) <= manifest.limits.max_seq_len
    # K is recorded resolved: the engine's limits.max_draft_len unless lowered; serving's policy is adaptive
    assert int(params["max_draft_len"]) == manifest.limits.max_draft_len and params["policy"] == "adaptive"
    # a CPU engine is served by the pytorch backend, sampled steps by the default draft method
    assert params["draft_method"] == DEFAULT_DRAFT_METHOD
    assert params["cuda_graphs"] == "auto"  # on for a CUDA device, off on a CPU (model.py reads it as None)
    assert params["torch_compile"] == "false"  # opt-in

    names = _model_py_names(repo / "dflash" / "1" / "model.py")
    assert set(names["INPUTS"]) == {i.name for i in cfg.input}
    assert set(names["OUTPUTS"]) == {o.name for o in cfg.output}
    assert set(names["PARAMETERS"]) <= set(params)
    out_types = {o.name: mc.DataType.Name(o.data_type) for o in cfg.output}
    assert out_types["text_output"] == "TYPE_STRING" and out_types["tau"] == "TYPE_FP32"
    assert out_types["total_draft_tokens"] == out_types["total_accepted_draft_tokens"] == "TYPE_INT32"
    # model.py is the template, unchanged; the record names the engine and the settings
    assert (repo / "dflash" / "1" / "model.py").read_bytes() == (resource_dir("triton_repo") / "dflash" / "1" / "model.py").read_bytes()
    record = json.loads((repo / "dflash_trt_repo.json").read_text())
    assert record["engine_dir"] == str(engine.resolve()) and record["settings"]["model_name"] == "dflash"


def test_flags_reach_the_config_and_paths_are_escaped(engine):
    odd = '/data/engines/my "quoted" dir\\x'
    settings = TritonRepoSettings(model_name="smol", backend="reference", default_max_tokens=17, max_queue=3,
                                  policy="fixed", max_draft_len=3, draft_method="greedy", device="cuda",
                                  cuda_graphs=True, torch_compile=True, engine_path=odd)
    cfg = parse_config(render_config(engine, settings))
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.name == "smol"
    assert params["engine_dir"] == odd  # round-trips through text-format escaping
    # `reference` is the old name of the pytorch backend: the repository records the current one
    assert (params["backend"], params["default_max_tokens"], params["max_queue"], params["policy"],
            params["max_draft_len"], params["draft_method"], params["device"], params["cuda_graphs"],
            params["torch_compile"]) == ("pytorch", "17", "3", "fixed", "3", "greedy", "cuda", "true", "true")


def test_max_draft_len_above_the_engine_is_refused(engine):
    """The engine's memory plan holds limits.max_draft_len drafts a step: a repository may lower K, not raise it."""
    built = load_manifest(engine).limits.max_draft_len
    with pytest.raises(DFlashError, match=f"above the {built} this engine was built for"):
        render_config(engine, TritonRepoSettings(max_draft_len=built + 1))


def test_default_max_tokens_above_engine_limit_is_refused(engine):
    limit = load_manifest(engine).limits.max_seq_len
    with pytest.raises(DFlashError, match="max_seq_len"):
        render_config(engine, TritonRepoSettings(default_max_tokens=limit + 1))


def test_strict_parse_rejects_unknown_fields():
    with pytest.raises(DFlashError, match="not a valid Triton ModelConfig"):
        parse_config('name: "x"\nbackend: "python"\nmax_batch_sise: 0\n')


def test_cli_writes_repo_and_refuses_bad_input_with_one_line(engine, tmp_path):
    runner = CliRunner()
    out = tmp_path / "repo"
    ok = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(out), "--model-name", "m1"])
    assert ok.exit_code == 0, ok.output
    assert (out / "m1" / "config.pbtxt").is_file()

    again = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output and "Traceback" not in again.output
    forced = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(out), "--force"])
    assert forced.exit_code == 0 and (out / "dflash" / "config.pbtxt").is_file() and not (out / "m1").exists()

    missing = runner.invoke(main, ["deploy", "triton", str(tmp_path / "nope"), "--out", str(tmp_path / "r2")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert not (tmp_path / "r2").exists()

    bad_name = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "r3"),
                                    "--model-name", "a/b"])
    assert bad_name.exit_code == 2 and "--model-name" in bad_name.output and not (tmp_path / "r3").exists()

    inside = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(engine / "repo")])
    assert inside.exit_code == 2 and "inside the engine" in inside.output


def test_not_an_engine_leaves_nothing_behind(tmp_path):
    (tmp_path / "half").mkdir()  # an interrupted build: no manifest
    with pytest.raises(DFlashError, match="dflash_trt.json missing"):
        generate_repository(tmp_path / "half", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".repo")]


class _CharTokenizer:
    """decode() of a toy vocabulary: id -> one character, 0 -> half of a UTF-8 character."""

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join(b"\xc3" if i == 0 else bytes([i]) for i in ids)
        return raw.decode("utf-8", errors="replace")


def test_detokenizer_holds_back_partial_characters_and_stop_prefixes():
    d = IncrementalDetokenizer(TextCodec(_CharTokenizer(), 256), stop=["END"])
    parts = [d.add([ord("a")]), d.add([0]), d.add([0xA9]), d.add([ord("E")]), d.add([ord("N")])]
    assert parts[:3] == ["a", "", "\u00e9"]  # \xc3\xa9 = é, never a replacement char
    assert parts[3:] == ["", ""]  # "EN" could still become "END"
    assert d.add([ord("X")]) == "ENX" and not d.stopped
    assert d.add([ord("E"), ord("N"), ord("D"), ord("z")]) == "" and d.stopped
    assert d.flush() == "" and d.emitted == "a\u00e9ENX"


def test_a_repository_tritonserver_cannot_load_is_one_line_and_nothing_is_left_running(engine, tmp_path):
    """The real tritonserver runs model.py's initialize(): a hand-edited config is caught before the
    engine loads, and Triton's own check of a model folder whose name is not the config's; either
    way the start fails with one line saying why, and no server is left."""
    import psutil

    from dflash_trt.serving.tritonserver import ServerPorts, TritonServerProcess

    repo = generate_repository(engine, tmp_path / "repo")
    cfg = repo / "dflash" / "config.pbtxt"
    text = cfg.read_text()
    start = text.index('  {\n    name: "decode_time_ms"')
    cfg.write_text(text[:start].rstrip().rstrip(",") + text[text.index("\n]", start):])
    parse_config(cfg.read_text())  # still a valid ModelConfig...
    log = tmp_path / "tritonserver.log"
    before = {p.pid for p in psutil.process_iter() if p.name() == "tritonserver"}
    server = TritonServerProcess(repo, ServerPorts(grpc=0, metrics=None), log=log.open("w"))
    with pytest.raises(DFlashError) as exc:  # ...but not the one model.py needs
        server.start(ready_timeout_s=120)
    assert "could not load model 'dflash'" in str(exc.value) and "decode_time_ms" in str(exc.value)
    assert "regenerate it with `dflash-trt deploy triton`" in str(exc.value) and "\n" not in str(exc.value)
    assert not server.running
    assert {p.pid for p in psutil.process_iter() if p.name() == "tritonserver"} <= before

    (repo / "dflash").rename(repo / "other")
    with pytest.raises(DFlashError) as exc:
        TritonServerProcess(repo, ServerPorts(grpc=0, metrics=None), log=log.open("w")).start(ready_timeout_s=120)
    assert "'other'" in str(exc.value) and "\n" not in str(exc.value)


def test_tensorrt_llm_is_used_only_with_native_dflash(monkeypatch, engine, tmp_path_factory):
    """TensorRT-LLM cannot be installed here: a stand-in module without DFlashDecodingConfig (an
    older release) must be detected and refused when explicitly requested."""
    import sys
    import types

    from dflash_trt.serving.backends import BackendSettings, load_backend
    from dflash_trt.serving.tensorrt_llm_backend import tensorrt_llm_status

    usable, why = tensorrt_llm_status()
    assert not usable and "tensorrt_llm" in why
    old = types.ModuleType("tensorrt_llm")
    old.__version__ = "1.2.1"
    old.llmapi = types.ModuleType("tensorrt_llm.llmapi")
    monkeypatch.setitem(sys.modules, "tensorrt_llm", old)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", old.llmapi)
    usable, why = tensorrt_llm_status()
    assert not usable and "1.2.1" in why and "DFlashDecodingConfig" in why
    with pytest.raises(DFlashError, match="backend tensorrt_llm requested"):
        load_backend(shared_gpu_tiny_engine(tmp_path_factory), BackendSettings(backend="tensorrt_llm"))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_BYTES = st.sampled_from([0x20, 0x41, 0x42, 0x61, 0x62, 0x2E, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0x00])


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(_BYTES, max_size=40), cuts=st.lists(st.integers(1, 5), max_size=40),
       stop=st.lists(st.text(alphabet="ABab. \u00e9", min_size=1, max_size=3), max_size=2))
def test_detokenizer_stream_equals_whole_decode(ids, cuts, stop):
    """However the ids arrive, the streamed text is the whole decode cut before the first stop
    string, and no piece is ever taken back (pieces only append)."""
    tok = _CharTokenizer()
    d = IncrementalDetokenizer(TextCodec(tok, 256), stop=stop)
    pieces, i = [], 0
    for n in cuts + [len(ids)]:
        if i >= len(ids) or d.stopped:
            break
        pieces.append(d.add(ids[i:i + n]))
        i += n
    pieces.append(d.flush())
    fed = ids[:i]
    full = tok.decode(fed)
    hits = [full.find(s) for s in stop if s in full]
    expected = full[: min(hits)] if hits else full
    assert "".join(pieces) == expected


@pytest.mark.parametrize("gpu, dtype, want", [("h100", "bfloat16", ("cuda", "bfloat16")),
                                              ("b300", "float16", ("cuda", "float16")),
                                              ("cpu", "float32", ("cpu", "float32"))])
def test_deploy_triton_takes_device_and_dtype_from_the_engines_gpu_not_this_machine(tmp_path_factory, tmp_path, gpu,
                                                                                    dtype, want):
    """This machine has no GPU; the repository is for the node the engine was built for."""
    import torch

    assert not torch.cuda.is_available()
    engine = shared_tiny_engine(tmp_path_factory) if gpu == "cpu" else shared_gpu_tiny_engine(tmp_path_factory, gpu, dtype)
    res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "repo")])
    assert res.exit_code == 0, res.output
    params = {k: v.string_value for k, v in parse_config((tmp_path / "repo" / "dflash" / "config.pbtxt").read_text())
              .parameters.items()}
    assert (params["device"], params["dtype"]) == want
    # flags still win
    res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "r2"), "--device", "cpu",
                                    "--dtype", "float32", "--backend", "pytorch"])
    params = {k: v.string_value for k, v in parse_config((tmp_path / "r2" / "dflash" / "config.pbtxt").read_text())
              .parameters.items()}
    assert res.exit_code == 0 and (params["device"], params["dtype"]) == ("cpu", "float32")


def test_the_draft_method_follows_the_backend_and_tensorrt_llm_runs_exact_match_only(tmp_path_factory, tmp_path):
    """A GPU engine's repository is TensorRT-LLM's, which verifies sampled steps by exact match: that
    is recorded; another method is refused in one line naming the way out (by load_backend too, for
    `auto` on a node whose TensorRT-LLM loads); the pytorch backend takes any method, and `auto`
    leaves the default to the backend that loads."""
    engine = shared_gpu_tiny_engine(tmp_path_factory, "h100", "bfloat16")

    def params(*flags: str) -> dict[str, str]:
        out = tmp_path / f"repo{len(list(tmp_path.iterdir()))}"
        res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(out), *flags])
        assert res.exit_code == 0, res.output
        return {k: v.string_value for k, v in parse_config((out / "dflash" / "config.pbtxt").read_text()).parameters.items()}

    assert params("--backend", "tensorrt_llm")["draft_method"] == "match"
    assert params("--backend", "pytorch")["draft_method"] == DEFAULT_DRAFT_METHOD
    assert params("--backend", "pytorch", "--draft-method", "greedy")["draft_method"] == "greedy"
    assert params()["draft_method"] == ""  # --backend auto: TensorRT-LLM's match, else DEFAULT_DRAFT_METHOD
    res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "no"),
                                    "--backend", "tensorrt_llm", "--draft-method", "probabilistic"])
    assert res.exit_code == 2 and "Traceback" not in res.output and not (tmp_path / "no").exists()
    assert res.output.splitlines()[-1].startswith("error: --draft-method probabilistic: the tensorrt_llm backend verifies sampled "
                                 "steps as TensorRT-LLM's engine does (exact match); use --backend pytorch")


def test_a_cpu_engine_repository_for_tensorrt_llm_is_refused(engine, tmp_path):
    res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "repo"),
                                    "--backend", "tensorrt_llm"])
    assert res.exit_code == 2 and "float16/bfloat16 on a GPU only" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "repo").exists()


def test_upstreams_newer_optional_input_is_declared_only_once_a_release_has_it(engine):
    """sampling_param_logits_post_processor_name: read by the llmapi model's helpers.py @ 0df60f9ad779,
    declared by no config.pbtxt read (0a71057313ec, c8c6df08bd0e; tests/upstream/tensorrt_llm_node.json):
    the repository keeps the released contract (tests/upstream/tensorrtllm_backend_llmapi.json)."""
    here = Path(__file__).parent / "upstream"
    record = json.loads((here / "tensorrt_llm_node.json").read_text())["llmapi_logits_post_processor"]
    released = json.loads((here / "tensorrtllm_backend_llmapi.json").read_text())["config_pbtxt"]
    declared = {i.name for i in parse_config(render_config(engine, TritonRepoSettings())).input}
    assert declared == {i["name"] for i in released["inputs"]} | {"text_input_format"}  # ours, optional
    assert record["in_a_released_config_pbtxt"] is False and record["input"] not in declared
    assert released["commit"] in record["config_pbtxt_commits_read"]
