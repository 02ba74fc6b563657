"""`dflash-trt build` on gpt-oss as it ships: MXFP4 experts kept or cast losslessly to NVFP4.

A tiny gpt-oss checkpoint in the released MXFP4 layout is written by the tests themselves
(tests/gptoss_fixtures.py). The oracles are independent of dflash_trt.checkpoints.dequant:
- transformers' own MXFP4 dequantization (`integrations/mxfp4.convert_moe_packed_tensors`, and
  `from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))` for the whole model);
- ModelOpt's own `dequantize_mxfp4_to_bf16` and `quantize_mxfp4_to_nvfp4_lossless`
  (modelopt.torch.export.shard_cast_utils, nvidia-modelopt 0.47.0).
TensorRT-LLM cannot run here: the engine's llm_api_options.yaml is checked against the MoE
backend table of TensorRT-LLM's gpt-oss deployment guide (MXFP4 experts: TRTLLM on Blackwell,
TRITON on Hopper) and BaseLlmArgs' `dtype` field (tensorrt_llm/llmapi/llm_args.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_trt.cli import main
from dflash_trt.checkpoints.dequant import dequant_mxfp4
from dflash_trt.engine.verify import verify_engine
from dflash_trt.runtime.reference.generate import autoregressive_generate
from dflash_trt.sampling_params import SamplingParams

try:
    from tests.gptoss_fixtures import save_tiny_mxfp4_gpt_oss, transformers_reference
except ImportError:  # tests/ is not a package
    from gptoss_fixtures import save_tiny_mxfp4_gpt_oss, transformers_reference

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> tuple[Path, Path]:
    return save_tiny_mxfp4_gpt_oss(tmp_path_factory.mktemp("gptoss"))


def _build(args: list[str]) -> None:
    r = CliRunner().invoke(main, ["build", "--no-progress", "--max-seq-len", "256", *args])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def engines(gptoss, tmp_path_factory) -> dict[str, Path]:
    """The three builds of the tiny gpt-oss: as shipped, the lossless NVFP4 cast, FP8 (experts doubled)."""
    tdir, ddir = gptoss
    root = tmp_path_factory.mktemp("gptoss_engines")
    common = ["--target", str(tdir), "--draft", str(ddir), "--calib-size", "4", "--calib-max-length", "32",
              "--gate-prompts", "3", "--gate-tokens", "8", "--min-tau", "1.0"]
    out = {"none": root / "none", "nvfp4": root / "nvfp4", "fp8": root / "fp8"}
    _build([*common, "--quant", "none", "--gpu", "b200", "--out", str(out["none"])])
    _build([*common, "--quant", "nvfp4", "--gpu", "b200", "--out", str(out["nvfp4"])])
    _build([*common, "--quant", "fp8", "--gpu", "h100", "--out", str(out["fp8"])])
    return out


def _generate(*args: str) -> list[int]:
    r = CliRunner().invoke(main, ["generate", "--json", "--raw", "--max-new-tokens", "16", *args, PROMPT])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])["output_ids"]


def test_mxfp4_dequant_equals_transformers_and_modelopt():
    from modelopt.torch.export import dequantize_mxfp4_to_bf16
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)  # [E, rows, G, 16]
    scales = torch.randint(110, 135, (3, 40, 4), dtype=torch.uint8, generator=g)  # 2^-17 .. 2^7
    ours = dequant_mxfp4(blocks, scales)  # [E, rows, G * 32]
    for dtype in (torch.float32, torch.bfloat16):  # transformers returns the [E, cols, rows] transpose
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(ours.to(dtype), ref)
    assert torch.equal(ours.to(torch.bfloat16), dequantize_mxfp4_to_bf16(blocks.flatten(-2), scales, "cpu"))


def test_quant_none_keeps_mxfp4_byte_for_byte_and_generates_the_source_tokens(gptoss, engines):
    tdir, ddir = gptoss
    eng = engines["none"]
    m = verify_engine(eng)
    assert (m.quantization.source_format, m.quantization.expert_format, m.quantization.dtype) == \
        ("MXFP4", "mxfp4", "bfloat16")
    src, out = load_file(str(tdir / "model.safetensors")), load_file(str(eng / "target/model.safetensors"))
    assert set(src) == set(out)
    mx = [k for k in src if k.endswith(("_blocks", "_scales"))]
    assert len(mx) == 4 * 2 * 2  # 4 layers x (gate_up, down) x (blocks, scales)
    for k in src:  # every tensor byte for byte (bf16 source, bf16 engine), experts included
        assert src[k].dtype == out[k].dtype and torch.equal(src[k].view(torch.uint8), out[k].view(torch.uint8)), k
    cfg = json.loads((eng / "target/config.json").read_text())
    assert cfg["quantization_config"] == json.loads((tdir / "config.json").read_text())["quantization_config"]
    assert not (eng / "target/hf_quant_config.json").exists()
    opts = yaml.safe_load((eng / "llm_api_options.yaml").read_text())
    assert opts["moe_config"] == {"backend": "TRTLLM"} and opts["dtype"] == "bfloat16"  # Blackwell + MXFP4

    from_engine = _generate("--engine", str(eng))
    from_source = _generate("--target", str(tdir), "--draft", str(ddir))
    assert from_engine == from_source
    # ... and both are the source model as transformers itself dequantizes it (greedy is lossless)
    r = CliRunner().invoke(main, ["generate", "--json", "--raw", "--max-new-tokens", "16", "--target", str(tdir),
                                  "--draft", str(ddir), PROMPT])
    prompt_ids = json.loads(r.stdout.strip().splitlines()[-1])["prompt_ids"]
    ref = autoregressive_generate(transformers_reference(tdir), prompt_ids, SamplingParams(max_tokens=16)).output_ids
    assert from_engine == ref


def test_nvfp4_cast_is_bit_exact_on_the_experts_and_leaves_attention_in_bf16(gptoss, engines):
    from modelopt.torch.export import mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless

    from dflash_trt.checkpoints.dequant import dequant_nvfp4

    tdir, ddir = gptoss
    eng = engines["nvfp4"]
    m = verify_engine(eng)
    assert m.quantization.recipe == "mlp-only" and m.quantization.expert_format == "nvfp4"
    report = m.quantization.report["mxfp4_cast"]
    assert report["tensors"] == 8 and report["lossless_blocks"] == report["mxfp4_blocks"] > 0
    src, out = load_file(str(tdir / "model.safetensors")), load_file(str(eng / "target/model.safetensors"))
    for layer in range(4):
        for proj in ("gate_up_proj", "down_proj"):
            base = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = src[base + "_blocks"], src[base + "_scales"]
            mxfp4 = dequant_mxfp4(blocks, scales).transpose(-1, -2)  # [E, in, out], as GptOssExperts holds it
            nvfp4 = dequant_nvfp4(out[base], out[base + "_weight_scale"], out[base + "_weight_scale_2"],
                                  tuple(mxfp4.shape))
            assert torch.equal(nvfp4, mxfp4), base  # the cast is lossless, bit for bit
            # and it is ModelOpt's own streaming cast, laid out as its export writes GptOss experts
            packed, block_scale, scale_2, n, n_ok = quantize_mxfp4_to_nvfp4_lossless(
                blocks.flatten(-2), scales, mxfp4_kmax(scales), "cpu")
            assert n == n_ok
            assert torch.equal(out[base], packed.transpose(-1, -2))
            assert torch.equal(out[base + "_weight_scale"].view(torch.uint8), block_scale.transpose(-1, -2).view(torch.uint8))
            assert torch.equal(out[base + "_weight_scale_2"], scale_2)
            assert out[base + "_input_scale"].item() > 0  # the one thing calibration measured
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):  # attention stays as released (bf16)
            key = f"model.layers.{layer}.self_attn.{w}.weight"
            assert out[key].dtype == torch.bfloat16 and torch.equal(out[key], src[key])
    hq = json.loads((eng / "target/hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and "model.layers.0.self_attn*" in hq["exclude_modules"]
    assert json.loads((eng / "target/config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    # a bit-exact cast leaves the reference runtime's model unchanged: same tokens as the source
    assert _generate("--engine", str(eng)) == _generate("--target", str(tdir), "--draft", str(ddir))


def test_fp8_on_gpt_oss_is_allowed_and_says_it_doubles_expert_memory(gptoss, engines):
    tdir, _ = gptoss
    r = CliRunner().invoke(main, ["plan", "--max-seq-len", "256", "--target", str(tdir), "--quant", "fp8", "--gpu", "h100"])
    assert r.exit_code == 0, r.output
    assert "FP8 experts take 1.9x the bytes of the shipped MXFP4 ones" in " ".join(r.stderr.split())
    m = verify_engine(engines["fp8"])
    assert m.quantization.expert_format == "fp8"
    out = load_file(str(engines["fp8"] / "target/model.safetensors"))
    assert out["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    opts = yaml.safe_load((engines["fp8"] / "llm_api_options.yaml").read_text())
    assert opts["moe_config"] == {"backend": "CUTLASS"}  # FP8 experts on Hopper


@pytest.mark.parametrize("quant", ["none", "nvfp4", "fp8"])
def test_plan_counts_the_expert_bytes_build_writes(engines, quant):
    """plan's per-GPU expert bytes (tp 1: the whole model) == the expert tensors in the engine."""
    m = verify_engine(engines[quant])
    out = load_file(str(engines[quant] / "target/model.safetensors"))
    written = sum(t.numel() * t.element_size() for k, t in out.items()
                  if ".mlp.experts." in k and not k.endswith("_bias"))
    assert m.plan["expert_bytes"] == written
    assert m.plan["expert_format"] == {"none": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8"}[quant]


def test_gpu_engine_keeps_16_bit_tensors_and_says_so(tiny_pair_dirs, tmp_path):
    """A float32 checkpoint built for a GPU: bfloat16 in config.json, the weights and the YAML."""
    tdir, ddir = tiny_pair_dirs
    assert json.loads((tdir / "config.json").read_text()).get("dtype", "float32") == "float32"
    out = tmp_path / "h100"
    _build(["--target", str(tdir), "--draft", str(ddir), "--quant", "fp8", "--gpu", "h100", "--out", str(out),
            "--calib-size", "2", "--calib-max-length", "16", "--no-gate"])
    assert json.loads((out / "target/config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(str(out / "target/model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # mlp-only: attention 16-bit
    assert yaml.safe_load((out / "llm_api_options.yaml").read_text())["dtype"] == "bfloat16"
    r = CliRunner().invoke(main, ["build", "--max-seq-len", "256", "--target", str(tdir), "--draft", str(ddir), "--gpu", "h100",
                                  "--dtype", "float32", "--dry-run"])
    assert r.exit_code == 2 and "--dtype float32 is for the CPU recipe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_mxfp4_on_hopper_needs_expert_parallel_only(gptoss):
    """TRITON (MXFP4 experts on Hopper) shards experts by EP only: a moe_tp split is refused."""
    tdir, _ = gptoss
    r = CliRunner().invoke(main, ["plan", "--max-seq-len", "256", "--target", str(tdir), "--gpu", "h100", "--tp", "2", "--ep", "1"])
    assert r.exit_code == 2 and "TRITON" in r.stderr and "--ep 2" in r.stderr
    r = CliRunner().invoke(main, ["plan", "--max-seq-len", "256", "--target", str(tdir), "--gpu", "h100", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.stderr


def test_a_mismatched_drafter_is_refused_by_the_gate(gptoss, tmp_path):
    """A drafter for another target with matching shapes (random weights: tau exactly 1)."""
    tdir, ddir = gptoss
    out = tmp_path / "eng"
    args = ["build", "--target", str(tdir), "--draft", str(ddir), "--quant", "nvfp4", "--gpu", "b200",
            "--out", str(out), "--no-progress", "--max-seq-len", "256", "--calib-size", "2", "--calib-max-length", "16",
            "--gate-prompts", "3", "--gate-tokens", "8"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "this drafter does not fit this target: unquantized tau 1.000 [1.000, 1.000]" in r.stderr
    assert len(r.stderr.strip().splitlines()[-1:]) == 1 and not out.exists()
    r = CliRunner().invoke(main, [*args, "--no-gate"])
    assert r.exit_code == 0, r.output
    assert verify_engine(out).acceptance is None
