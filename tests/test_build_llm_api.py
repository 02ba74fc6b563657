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
  attention_backend VANILLA | TRTLLM, plus DecodingBaseConfig's max_draft_len, speculative_model.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from dflash_trt.engine.llm_api import check_llm_api_options, launch_scripts, llm_api_options
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.errors import DFlashError

UPSTREAM_TOP_LEVEL = {
    "tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size",
    "max_batch_size", "max_seq_len", "max_num_tokens", "kv_cache_config", "speculative_config",
    "cuda_graph_config", "moe_config", "attn_backend", "gpus_per_node",
}
UPSTREAM_SECTIONS = {
    "kv_cache_config": {"dtype", "free_gpu_memory_fraction", "enable_block_reuse", "max_tokens", "tokens_per_block"},
    "cuda_graph_config": {"batch_sizes", "max_batch_size", "enable_padding"},
    "moe_config": {"backend", "max_num_tokens"},
    "speculative_config": {"decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
                           "target_layer_ids", "attention_backend"},
}
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
    s = resolve_spec(None, {"gpu": "h100", "quant": "fp8"})
    opts = llm_api_options(s, is_moe=False, max_draft_len=15, max_num_tokens=8192, mask_token_id=151669,
                           target_layer_ids=[1, 9, 17, 25, 33])
    _assert_upstream_shape(opts)
    assert "moe_config" not in opts and "moe_expert_parallel_size" not in opts
    assert opts["kv_cache_config"]["dtype"] == "auto"  # keeps the checkpoint's kv_cache_quant_algo
    assert opts["speculative_config"]["attention_backend"] == "VANILLA"
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
