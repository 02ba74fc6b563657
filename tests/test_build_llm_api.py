"""llm_api_options.yaml against TensorRT-LLM's LLM-API field names and placement.

TensorRT-LLM cannot be installed here, so the accepted keys are written out below from
tensorrt_llm/llmapi/llm_args.py at NVIDIA/TensorRT-LLM commit 0004396720054fd8e205cbf616f21f0b57c6b412
(the 1.3 line, PyTorch backend) and shared/design/upstream.md:
- BaseLlmArgs / TorchLlmArgs: tensor_parallel_size, pipeline_parallel_size,
  moe_expert_parallel_size, max_batch_size, max_seq_len, max_num_tokens, kv_cache_config,
  speculative_config, cuda_graph_config, moe_config (all extra="forbid");
- KvCacheConfig: dtype ("auto" | "fp8" | ...), free_gpu_memory_fraction, enable_block_reuse, ...;
- CudaGraphConfig (decode): batch_sizes, max_batch_size, enable_padding;
- MoeConfig.backend: AUTO | CUTLASS | CUTEDSL | TRTLLM | DEEPGEMM | DENSEGEMM | VANILLA | TRITON | MARLIN ...;
- DFlashDecodingConfig: decoding_type "DFlash", mask_token_id, target_layer_ids,
  attention_backend VANILLA | TRTLLM | FA4 (the 1.3.0rc27 reference: tests/upstream/
  tensorrt_llm_speculation.json; FA4 on SM90 only), plus DecodingBaseConfig's max_draft_len,
  speculative_model, draft_len_schedule, use_rejection_sampling and the acceptance-rate floor;
- TorchLlmArgs enable_attention_dp / stream_interval / num_postprocess_workers (top level, as in
  upstream's recipe qwen3.8-low-latency.yaml; sources in dflash_trt/engine/trtllm_fields.json).
The vLLM and SGLang flags are checked against their parsers' names recorded, with the source
file and version, in dflash_trt/engine/launch_flags.json (neither peer runs here on a GPU).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_trt.engine.llm_api import check_llm_api_options, launch_scripts, llm_api_options
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.errors import DFlashError

UPSTREAM_TOP_LEVEL = {
    "tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size",
    "max_batch_size", "max_seq_len", "max_num_tokens", "kv_cache_config", "speculative_config",
    "cuda_graph_config", "moe_config", "attn_backend", "gpus_per_node",
    "enable_attention_dp", "stream_interval", "num_postprocess_workers",
}
UPSTREAM_SECTIONS = {
    "kv_cache_config": {"dtype", "free_gpu_memory_fraction", "enable_block_reuse", "max_tokens", "tokens_per_block"},
    "cuda_graph_config": {"batch_sizes", "max_batch_size", "enable_padding"},
    "moe_config": {"backend", "max_num_tokens"},
    "speculative_config": set(json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_speculation.json")
                                         .read_text())["DFlashDecodingConfig_1.3.0rc27"]["fields"]),
}
RC27 = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_speculation.json").read_text())[
    "DFlashDecodingConfig_1.3.0rc27"]
UPSTREAM_DFLASH_ATTENTION = set(RC27["attention_backend"])
UPSTREAM_MOE_BACKENDS = {"AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON", "MARLIN"}


def _assert_upstream_shape(opts: dict) -> None:
    assert set(opts) <= UPSTREAM_TOP_LEVEL, set(opts) - UPSTREAM_TOP_LEVEL
    for section, keys in UPSTREAM_SECTIONS.items():
        if section in opts:
            assert set(opts[section]) <= keys, (section, set(opts[section]) - keys)


def test_moe_blackwell_options_use_upstream_names_and_placement():
    s = resolve_spec(None, {"gpu": "b300", "tp": 8, "ep": 8, "quant": "nvfp4", "kv_cache_quant": "fp8",
                            "max_batch_size": 256, "max_seq_len": 16384})
    opts = llm_api_options(s, is_moe=True, max_draft_len=15, max_num_tokens=8192, mask_token_id=200000,
                           target_layer_ids=[1, 9, 17, 25, 33])
    _assert_upstream_shape(opts)
    assert opts["tensor_parallel_size"] == 8 and opts["moe_expert_parallel_size"] == 8
    assert opts["kv_cache_config"]["dtype"] == "fp8"
    assert opts["moe_config"]["backend"] in UPSTREAM_MOE_BACKENDS and opts["moe_config"]["backend"] == "TRTLLM"
    sc = opts["speculative_config"]
    assert sc["decoding_type"] == "DFlash" and sc["max_draft_len"] == 15
    assert sc["attention_backend"] == "TRTLLM"  # Blackwell SM100/103
    assert sc["target_layer_ids"] == [1, 9, 17, 25, 33] and sc["mask_token_id"] == 200000
    check_llm_api_options(opts)


def test_dense_hopper_options_have_no_moe_keys_and_vanilla_attention():
    """Built for the first DFlash release (no FA4 there): VANILLA, upstream's default."""
    s = resolve_spec(None, {"gpu": "h100", "quant": "fp8", "tensorrt_llm_release": "1.3.0rc16"})
    opts = llm_api_options(s, is_moe=False, max_draft_len=15, max_num_tokens=8192, mask_token_id=151669,
                           target_layer_ids=[1, 9, 17, 25, 33])
    _assert_upstream_shape(opts)
    assert "moe_config" not in opts and "moe_expert_parallel_size" not in opts
    # dtype 'auto' (keep the checkpoint's kv_cache_quant_algo) and VANILLA attention are upstream's
    # defaults: left out, so the file needs only the first release with DFlash.
    assert "dtype" not in opts.get("kv_cache_config", {})
    assert "attention_backend" not in opts["speculative_config"]
    assert "tensor_parallel_size" not in opts  # 1 is the default
    # The YAML round-trips (what trtllm-serve --config reads).
    assert yaml.safe_load(yaml.safe_dump(opts)) == opts


@pytest.mark.parametrize("bad, needle", [
    ({"max_draft_len": 15}, "belongs under speculative_config"),
    ({"kv_cache_config": {"dtype": "fp8", "max_batch_size": 8}}, "belongs at the top level"),
    ({"speculative_config": {"decoding_type": "Dflash", "speculative_model": "d"}}, "not one of"),
    ({"model": "x"}, "command line"),
])
def test_check_rejects_what_tensorrt_llm_would_reject(bad, needle):
    s = resolve_spec(None, {"gpu": "h100"})
    opts = llm_api_options(s, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1, target_layer_ids=[1])
    for k, v in bad.items():
        if isinstance(v, dict) and k in opts:
            opts[k] = {**opts[k], **v}
        else:
            opts[k] = v
    with pytest.raises(DFlashError, match=needle):
        check_llm_api_options(opts)


def test_launch_scripts_are_valid_bash_with_the_same_engine(tmp_path):
    s = resolve_spec(None, {"gpu": "b300", "tp": 8, "ep": 8, "kv_cache_quant": "fp8"})
    scripts = launch_scripts(s, is_moe=True, max_draft_len=15, block_size=16)
    assert set(scripts) == {"launch/trtllm-serve.sh", "launch/vllm.sh", "launch/sglang.sh"}
    for rel, text in scripts.items():
        path = tmp_path / rel.replace("/", "_")
        path.write_text(text)
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
        assert "./target" in text and ("./draft" in text or "llm_api_options.yaml" in text)
    assert "--config ./llm_api_options.yaml" in scripts["launch/trtllm-serve.sh"]
    assert '"method": "dflash"' in scripts["launch/vllm.sh"] and "--enable-expert-parallel" in scripts["launch/vllm.sh"]
    sgl = scripts["launch/sglang.sh"]
    assert "--speculative-algorithm DFLASH" in sgl and "--speculative-num-draft-tokens 16" in sgl and "--ep-size 8" in sgl


LAUNCH_FLAGS = json.loads((Path(__file__).resolve().parents[1] / "dflash_trt/engine/launch_flags.json").read_text())


def _argv(script: str) -> list[str]:
    """The exec'd command of a launch script, split as bash would ("$@" and ${PORT...} kept as words)."""
    line = next(ln for ln in script.splitlines() if ln.startswith("exec "))
    return shlex.split(line)[1:]


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


@pytest.mark.parametrize("over", [
    {"gpu": "b300", "tp": 8, "ep": 8, "kv_cache_quant": "fp8", "enable_attention_dp": True, "stream_interval": 10},
    {"gpu": "h100", "tp": 2},
    {"gpu": "cpu"},
])
def test_launch_flags_exist_in_the_peers_parsers(over):
    s = resolve_spec(None, over)
    scripts = launch_scripts(s, is_moe="ep" in over, max_draft_len=15, block_size=16)
    for name, peer in (("launch/vllm.sh", "vllm"), ("launch/sglang.sh", "sglang")):
        argv = _argv(scripts[name])
        command = LAUNCH_FLAGS[peer]["command"]
        assert argv[:len(command)] == command, (name, argv)
        unknown = set(_flags(argv)) - set(LAUNCH_FLAGS[peer]["flags"])
        assert not unknown, (name, unknown)
    vllm = _argv(scripts["launch/vllm.sh"])
    spec_cfg = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert set(spec_cfg) <= set(LAUNCH_FLAGS["vllm"]["speculative_config_keys"])
    # The drafter's (non-causal) attention backend goes through speculative_config; the target's is left alone.
    assert "--attention-backend" not in vllm
    assert spec_cfg.get("attention_backend") == (None if over["gpu"] == "cpu" else "flash_attn")
    sgl = _argv(scripts["launch/sglang.sh"])
    assert "--pp-size" not in sgl  # SGLang's DFLASH only runs at pp_size 1: never passed
    if over.get("enable_attention_dp"):
        assert sgl[sgl.index("--attn-dp-size") + 1] == "8" and "--enable-dp-lm-head" in sgl
        assert sgl[sgl.index("--stream-interval") + 1] == "10"


def test_sglang_script_refuses_pipeline_parallel_with_a_clear_message(tmp_path):
    s = resolve_spec(None, {"gpu": "h100", "tp": 4, "pp": 2})
    scripts = launch_scripts(s, is_moe=False, max_draft_len=7, block_size=8)
    path = tmp_path / "sglang.sh"
    path.write_text(scripts["launch/sglang.sh"])
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: SGLang's DFLASH") and "PP 2" in proc.stderr
    assert "launch/trtllm-serve.sh" in proc.stderr
    assert LAUNCH_FLAGS["sglang"]["dflash_pp_size"] == 1
    # the other two scripts still serve the same engine
    assert "--pipeline-parallel-size 2" in scripts["launch/vllm.sh"]


def test_throughput_knobs_reach_the_yaml_only_when_not_upstreams_default():
    base = resolve_spec(None, {"gpu": "b300", "tp": 8, "ep": 8})
    opts = llm_api_options(base, is_moe=True, max_draft_len=15, max_num_tokens=8192, mask_token_id=1, target_layer_ids=[1])
    assert not {"enable_attention_dp", "stream_interval", "num_postprocess_workers"} & set(opts)
    tuned = resolve_spec(None, {"gpu": "b300", "tp": 8, "ep": 8, "enable_attention_dp": True, "stream_interval": 10,
                                "num_postprocess_workers": 4, "dflash_attention_backend": "TRTLLM"})
    opts = llm_api_options(tuned, is_moe=True, max_draft_len=15, max_num_tokens=8192, mask_token_id=1, target_layer_ids=[1])
    assert (opts["enable_attention_dp"], opts["stream_interval"], opts["num_postprocess_workers"]) == (True, 10, 4)
    assert opts["speculative_config"]["attention_backend"] in UPSTREAM_DFLASH_ATTENTION
    assert opts["speculative_config"]["attention_backend"] == "TRTLLM"
    _assert_upstream_shape(opts)
    check_llm_api_options(opts)


@pytest.mark.parametrize("key, value", [("stream_interval", 0), ("num_postprocess_workers", -1),
                                        ("dflash_attention_backend", "FLASHINFER")])
def test_bad_knob_values_are_one_line_errors(key, value):
    with pytest.raises(DFlashError, match=key):
        resolve_spec(None, {key: value})


def test_attention_backends_upstream_does_not_run_are_refused_in_one_line():
    """TRTLLM needs SM100/SM103 (dflash_attention.py), FA4 is validated on SM90 only
    (validate_dflash_fa4_runtime), and a backend no release has is refused by the check: sources in
    tests/upstream/tensorrt_llm_node.json and tensorrt_llm_speculation.json."""
    assert UPSTREAM_DFLASH_ATTENTION == {"VANILLA", "TRTLLM", "FA4"}
    hopper = resolve_spec(None, {"gpu": "h100", "dflash_attention_backend": "TRTLLM"})
    with pytest.raises(DFlashError, match="TRTLLM needs a Blackwell GPU"):
        llm_api_options(hopper, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1, target_layer_ids=[1])
    blackwell_fa4 = resolve_spec(None, {"gpu": "b200", "dflash_attention_backend": "FA4"})
    with pytest.raises(DFlashError, match="FA4 runs on SM90"):
        llm_api_options(blackwell_fa4, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1,
                        target_layer_ids=[1])
    hopper_fa4 = resolve_spec(None, {"gpu": "h200", "dflash_attention_backend": "FA4"})
    written = llm_api_options(hopper_fa4, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1,
                              target_layer_ids=[1])
    assert written["speculative_config"]["attention_backend"] == "FA4"
    check_llm_api_options(written)
    written["speculative_config"]["attention_backend"] = "FLASHINFER"
    with pytest.raises(DFlashError, match=r"attention_backend='FLASHINFER' is not one of \['FA4', 'TRTLLM', 'VANILLA'\]"):
        check_llm_api_options(written)


def _opts_for_check() -> dict:
    s = resolve_spec(None, {"gpu": "b200"})
    return llm_api_options(s, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1, target_layer_ids=[1])


def test_a_cpu_engines_trtllm_serve_script_refuses_in_one_line(tmp_path):
    """A CPU engine is float32; TensorRT-LLM's DFlash kernels take fp16/bf16 only (flash-attn README
    @ 014c349 in tests/upstream/tensorrt_llm_node.json): its launch script says so and exits 2."""
    scripts = launch_scripts(resolve_spec(None, {"gpu": "cpu"}), is_moe=False, max_draft_len=7, block_size=8)
    script = tmp_path / "trtllm-serve.sh"
    script.write_text(scripts["launch/trtllm-serve.sh"])
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: this engine is built for the CPU") and len(proc.stderr.splitlines()) == 1
    assert "trtllm-serve" not in scripts["launch/trtllm-serve.sh"].split("exit 2")[0].split("echo")[0]
