"""`dflash-trt doctor`: what this environment has, and whether it can serve a given engine.

The CLI tests run the real probes on this machine (no TensorRT-LLM, no tritonserver, no GPU) and
check that a GPU engine is refused with one line per missing piece and a non-zero exit, and that
a CPU engine passes on the reference backend. The verdict logic is also checked against
environments built from upstream's REAL DFlashDecodingConfig fields as published in the
TensorRT-LLM API references (1.3.0rc27: .../1.3.0rc27/llm-api/reference/DFlashDecodingConfig.html;
the pre-attention_backend field set of PR 12794; sources in dflash_trt/engine/trtllm_fields.json),
since no TensorRT-LLM install can run here. What the engine's DFlash attention backend loads on the
node, and the capability check that replaces the version number, follow upstream's code recorded in
tests/upstream/tensorrt_llm_node.json: tensorrt_llm/_torch/speculative/dflash_attention.py @ 0352547de78e
(VANILLA imports flash_attn.flash_attn_with_kvcache; TRTLLM needs FlashInfer and SM100/SM103),
tensorrt_llm/llmapi/llm_args.py @ 0004396720054 (attention_backend VANILLA | TRTLLM), and the
unknown first DFlash tag (PR 12794's merge could not be read here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.deploy.doctor import Environment, GpuInfo, engine_findings, load_engine, parse_nvidia_smi
from dflash_trt.engine.llm_api import llm_api_options, render_yaml
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.trtllm_versions import min_version, requirements
from tests.deploy_engines import manifest_engine, served_engine

# DecodingBaseConfig + DFlashDecodingConfig fields of the 1.3.0rc27 API reference.
RC27_DFLASH_FIELDS = ["max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
                      "draft_len_schedule", "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold",
                      "use_rejection_sampling", "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty",
                      "mask_token_id", "target_layer_ids", "decoding_type", "attention_backend"]
# The same class before PR 16914 (no attention_backend).
PRE_16914_DFLASH_FIELDS = [f for f in RC27_DFLASH_FIELDS if f != "attention_backend"]
# TorchLlmArgs fields our files use (all in the published TorchLlmArgs reference).
TORCH_LLM_ARGS_FIELDS = ["tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "max_batch_size",
                         "max_seq_len", "max_num_tokens", "kv_cache_config", "cuda_graph_config", "moe_config",
                         "speculative_config", "enable_attention_dp", "stream_interval", "num_postprocess_workers"]
B200 = GpuInfo(0, "NVIDIA B200", 183359, (10, 0))
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559, (9, 0))
HAS_GPU_TOOLS = shutil.which("nvidia-smi") is not None


def gpu_engine(root: Path, gpu: str = "b300", quant: str = "nvfp4", tp: int = 8, **over) -> Path:
    """A GPU engine directory for the doctor: manifest + the llm_api_options.yaml the builder would write
    (for `tensorrt_llm_release` when given, else the container's)."""
    spec = resolve_spec(None, {"gpu": gpu, "tp": tp, "ep": tp, "quant": quant,
                               **{k: v for k, v in over.items() if v is not None}})
    opts = llm_api_options(spec, is_moe=True, max_draft_len=15, max_num_tokens=8192, mask_token_id=200000,
                           target_layer_ids=[1, 9, 17, 25, 33])
    engine = manifest_engine(root, tp, 1, gpus_per_node=8)
    (engine / "llm_api_options.yaml").write_text(render_yaml(opts, "test"))
    data = json.loads((engine / "dflash_trt.json").read_text())
    data.update(min_tensorrt_llm_version=min_version(opts), tensorrt_llm_requirements=requirements(opts), gpu=gpu,
                quantization={"weights": quant, "kv_cache": "none"})
    (engine / "dflash_trt.json").write_text(json.dumps(data))
    return engine


# attention_backend's values in the installed class (tests/upstream/tensorrt_llm_node.json, llm_args.py @ 0004396)
NODE = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_node.json").read_text())
UPSTREAM_ATTENTION = NODE["DFlashDecodingConfig"]["attention_backend"]


def env_with(version: str | None, fields: list[str] | None, gpus: list[GpuInfo], flash_attn: str | None = "2.8.3",
             flashinfer: str | None = "0.6.0", backends: list[str] | None = None, **probed) -> Environment:
    if backends is None and fields and "attention_backend" in fields:
        backends = sorted(UPSTREAM_ATTENTION)
    return Environment(python="3.12.3", torch="2.9.0", tensorrt_llm=version, dflash_fields=fields,
                       dflash_attention_backends=backends,
                       llm_args_fields=TORCH_LLM_ARGS_FIELDS if version else None,
                       tensorrt_llm_error=None if version else "not installed", gpus=gpus,
                       flash_attn=flash_attn, flash_attn_error=None if flash_attn else "not installed",
                       flashinfer=flashinfer, **probed)


@pytest.mark.skipif(HAS_GPU_TOOLS, reason="checks what a GPU-less machine reports")
def test_gpu_engine_on_this_machine_names_every_missing_piece_and_fails(tmp_path):
    engine = gpu_engine(tmp_path / "e")
    res = CliRunner().invoke(main, ["doctor", str(engine)])
    out = res.output
    assert res.exit_code == 1, out
    lines = out.splitlines()
    assert lines[0].startswith("ok       python ")
    missing = [ln for ln in lines if ln.startswith("MISSING")]
    # each missing piece is ONE line naming the fix
    assert all("; fix: " in ln for ln in missing), missing
    need = min_version(yaml.safe_load((engine / "llm_api_options.yaml").read_text()))
    assert any(f"needs TensorRT-LLM >= {need}; tensorrt_llm not installed" in ln for ln in missing), out
    # `make setup` installs tritonserver here: found, with nothing its Python backend lacks
    assert any(ln.startswith("ok       tritonserver ") for ln in lines), out
    assert not any("tritonserver" in ln for ln in missing), out
    assert any("8 per node: 0 GPU(s) visible here" in ln and "--gpus-per-node=8" in ln for ln in missing), out
    assert any("is NVFP4: needs FP4 tensor cores" in ln for ln in missing), out
    assert lines[-1].startswith(f"verdict: {engine} CANNOT be served here")
    assert "Traceback" not in out


def test_cpu_engine_is_servable_here_on_the_reference_backend(tmp_path):
    engine = served_engine(tmp_path)
    res = CliRunner().invoke(main, ["doctor", str(engine), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["servable"] is True
    assert report["environment"]["python"] and report["environment"]["torch"]
    assert any("reference backend" in f["what"] and f["ok"] for f in report["findings"])


def test_without_an_engine_doctor_reports_and_exits_zero():
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 0, res.output
    assert "tensorrt_llm" in res.output and "verdict" not in res.output


def test_bad_engine_path_is_one_line(tmp_path):
    res = CliRunner().invoke(main, ["doctor", str(tmp_path / "nope")])
    assert res.exit_code != 0 and res.output.startswith("error: ") and len(res.output.splitlines()) == 1


@pytest.mark.parametrize("gpu, quant, built_for, version, fields, gpus, problem", [
    # Blackwell engine (TRTLLM attention written) in an image with every field: servable
    ("b300", "nvfp4", None, "1.3.0rc27", RC27_DFLASH_FIELDS, [B200] * 8, None),
    # ... in a release with DFlash but before attention_backend: refused, naming the field
    ("b300", "nvfp4", None, "1.3.0rc16", PRE_16914_DFLASH_FIELDS, [B200] * 8, "missing attention_backend"),
    # Hopper engine built for the first DFlash release (VANILLA left out) there: servable
    ("h100", "fp8", "1.3.0rc16", "1.3.0rc16", PRE_16914_DFLASH_FIELDS, [H100] * 8, None),
    # an image without DFlash at all (the Triton trtllm images pin 1.2.1)
    ("h100", "fp8", "1.3.0rc16", "1.2.1", None, [H100] * 8, "needs TensorRT-LLM >= 1.3.0rc16, installed 1.2.1"),
    # NVFP4 engine on Hopper
    ("b300", "nvfp4", None, "1.3.0rc27", RC27_DFLASH_FIELDS, [H100] * 8, "needs FP4 tensor cores"),
    # fewer GPUs than ranks per node
    ("h100", "fp8", None, "1.3.0rc27", RC27_DFLASH_FIELDS, [H100] * 4, "4 GPU(s) visible"),
])
def test_verdicts_against_published_field_sets(tmp_path, gpu, quant, built_for, version, fields, gpus, problem):
    manifest, opts = load_engine(gpu_engine(tmp_path / "e", gpu=gpu, quant=quant, tensorrt_llm_release=built_for))
    findings = engine_findings(env_with(version, fields, gpus), manifest, opts, "auto")
    bad = [f.line() for f in findings if not f.ok]
    if problem is None:
        assert bad == []
    else:
        assert bad and any(problem in line for line in bad), bad


def test_parse_nvidia_smi_query_rows():
    """Rows in the documented `--query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits` form."""
    gpus = parse_nvidia_smi("0, NVIDIA B200, 183359, 10.0\n1, NVIDIA H100 80GB HBM3, 81559, 9.0\n")
    assert [(g.index, g.memory_mib, g.compute_capability, g.fp4, g.fp8) for g in gpus] == [
        (0, 183359, (10, 0), True, True), (1, 81559, (9, 0), False, True)]


@pytest.mark.parametrize("gpu, quant, built_for, env_kw, problem", [
    # Hopper engine for the first DFlash release: VANILLA imports flash_attn.flash_attn_with_kvcache (dflash_attention.py)
    ("h100", "fp8", "1.3.0rc16", {"flash_attn": None},
     "DFlash attention is VANILLA, which imports flash_attn.flash_attn_with_kvcache"),
    # Hopper engine for the container's release: FA4 imports flash_attn.cute
    ("h100", "fp8", None, {"flash_attn_cute": False}, "is FA4, which needs flash-attn's CuTe interface"),
    # Blackwell engine: TRTLLM needs FlashInfer ...
    ("b300", "nvfp4", None, {"flashinfer": None},
     "is TRTLLM, which needs FlashInfer and SM100/SM103 GPUs; flashinfer not installed"),
    # ... and the installed class must take the value the engine writes
    ("b300", "nvfp4", None, {"backends": ["VANILLA"]}, "attention_backend TRTLLM in the installed DFlashDecodingConfig"),
])
def test_the_attention_backend_the_engines_gpu_uses_is_checked(tmp_path, gpu, quant, built_for, env_kw, problem):
    manifest, opts = load_engine(gpu_engine(tmp_path / "e", gpu=gpu, quant=quant, tensorrt_llm_release=built_for))
    gpus = [B200 if gpu == "b300" else H100] * 8
    bad = [f.line() for f in engine_findings(env_with("1.3.0rc27", RC27_DFLASH_FIELDS, gpus, **env_kw),
                                             manifest, opts, "auto") if not f.ok]
    assert any(problem in line for line in bad), bad
    assert all("; fix: " in line for line in bad)


def test_a_vanilla_engine_on_a_blackwell_gpu_is_not_asked_for_flashinfer(tmp_path):
    manifest, opts = load_engine(gpu_engine(tmp_path / "e", gpu="h100", quant="fp8", tensorrt_llm_release="1.3.0rc16"))
    findings = engine_findings(env_with("1.3.0rc27", RC27_DFLASH_FIELDS, [H100] * 8, flashinfer=None), manifest, opts,
                               "trtllm")
    assert all(f.ok for f in findings), [f.line() for f in findings if not f.ok]


def test_the_capability_decides_not_the_version_number(tmp_path):
    """A release numbered below the recorded minimum whose installed DFlashDecodingConfig takes every
    key the engine writes is servable (the first DFlash tag is unknown: tensorrt_llm_node.json)."""
    assert NODE["DFlashDecodingConfig_origin"]["first_tag"] is None
    manifest, opts = load_engine(gpu_engine(tmp_path / "e", gpu="h100", quant="fp8", tensorrt_llm_release="1.3.0rc16"))
    findings = engine_findings(env_with("1.3.0rc14", PRE_16914_DFLASH_FIELDS, [H100] * 8), manifest, opts, "auto")
    assert all(f.ok for f in findings), [f.line() for f in findings if not f.ok]
    assert any("capability checked" in f.what for f in findings)
    # without the class, the number is all there is
    bad = [f.line() for f in engine_findings(env_with("1.3.0rc14", None, [H100] * 8), manifest, opts, "auto")
           if not f.ok]
    assert any("needs TensorRT-LLM >= 1.3.0rc16, installed 1.3.0rc14" in line for line in bad), bad


def test_a_cpu_engine_is_never_handed_to_tensorrt_llm(tmp_path):
    engine = served_engine(tmp_path)  # gpu cpu, float32
    manifest, opts = load_engine(engine)
    [finding] = engine_findings(env_with("1.3.0rc27", RC27_DFLASH_FIELDS, [H100] * 8), manifest, opts, "trtllm")
    assert not finding.ok and "float16/bfloat16 on a GPU only" in finding.line()
    res = CliRunner().invoke(main, ["doctor", str(engine), "--backend", "trtllm"])
    assert res.exit_code == 1 and "float16/bfloat16 on a GPU only" in res.output and "Traceback" not in res.output
    # the launcher refuses before MPI starts, on every rank alike
    res = CliRunner().invoke(main, ["launch", str(engine), "--backend", "trtllm", "--check"])
    assert res.exit_code == 2 and "float16/bfloat16 on a GPU only" in res.output and "Traceback" not in res.output
