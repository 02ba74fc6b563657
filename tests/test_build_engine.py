"""End to end on CPU: build engines (none / fp8 / nvfp4, and a tiny GptOss MoE at tp=2 ep=2),
verify them, load them back into the reference runtime, and generate.

"Reference" weights are rebuilt here independently of dflash_trt.checkpoints.dequant: FP8 as
`float(W) * weight_scale`, NVFP4 through ModelOpt's own NVFP4QTensor.dequantize. The engine
loaded with `load_pair` must generate exactly what the reference runtime generates on those
weights, and (DFlash being lossless) exactly what plain greedy decoding of that target does.
TensorRT-LLM itself cannot run here; its input (llm_api_options.yaml) is checked against the
upstream field names in test_build_llm_api.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.builder import build_engine, prepare
from dflash_trt.engine.manifest import load_manifest
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.verify import verify_engine
from dflash_trt.errors import DFlashError
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime.drafters.loading import load_drafter
from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate
from dflash_trt.sampling_params import SamplingParams

PROMPT = [5, 17, 33, 2, 9, 41, 7]


def _build(out: Path, target: Path, draft: Path, **over) -> Path:
    # Random drafters do not fit their target (tau is 1): min_tau 1.0 lets the gate run anyway.
    spec = resolve_spec(None, {"target": str(target), "draft": str(draft), "gpu": "cpu", "max_seq_len": 256,
                               "calibration.num_samples": 4, "calibration.max_length": 32,
                               "gate.num_prompts": 2, "gate.max_new_tokens": 12, "gate.min_tau": 1.0, **over})
    return build_engine(prepare(spec), out, progress=False)


def _reference_target(tdir: Path):
    """The exported checkpoint as float weights, dequantized without dflash_trt.checkpoints.dequant."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((tdir / "config.json").read_text())
    raw.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw), dtype=torch.float32)
    sd = {}
    for f in tdir.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    state = {}
    for key, ref in model.state_dict().items():
        if key not in sd:
            continue
        t = sd[key]
        base = key[: -len("weight")] if key.endswith(".weight") else key + "_"
        if t.dtype == torch.float8_e4m3fn:
            state[key] = t.float() * sd[base + "weight_scale"].float()
        elif t.dtype == torch.uint8:
            scale, scale_2 = sd[base + "weight_scale"], sd[base + "weight_scale_2"]
            if t.shape[-1] * 2 == ref.shape[-1]:  # nn.Linear [out, in/2]
                qt = NVFP4QTensor(ref.shape, torch.float32, t)
                state[key] = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
            else:  # fused experts [E, in/2, out]: blocks along `in`
                shape_t = ref.transpose(-1, -2).shape
                qt = NVFP4QTensor(shape_t, torch.float32, t.transpose(-1, -2).contiguous())
                state[key] = qt.dequantize(dtype=torch.float32, scale=scale.transpose(-1, -2).contiguous(),
                                           double_scale=scale_2, block_sizes={-1: 16}).transpose(-1, -2)
        else:
            state[key] = t.float()
    missing, _ = model.load_state_dict(state, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing
    return model.eval()


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_pair_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engines")
    target, draft = tiny_pair_dirs
    return {
        "none": _build(root / "none", target, draft, quant="none"),
        "fp8": _build(root / "fp8", target, draft, quant="fp8", kv_cache_quant="fp8"),
        "nvfp4": _build(root / "nvfp4", target, draft, quant="nvfp4"),
    }


@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_engine_directory_is_complete_and_verifies(engines, tiny_pair_dirs, quant):
    eng = engines[quant]
    m = verify_engine(eng)
    assert m.quantization.weights == quant and m.gpu == "cpu" and m.min_tensorrt_llm_version
    for rel in ("target/config.json", "draft/config.json", "draft/model.safetensors", "llm_api_options.yaml",
                "launch/trtllm-serve.sh", "launch/vllm.sh", "launch/sglang.sh"):
        assert rel in m.files and (eng / rel).is_file(), rel
    assert any(r.startswith("target/") and r.endswith(".safetensors") for r in m.files)
    # The drafter ships byte for byte; the YAML names it and its DFlash settings.
    _, draft = tiny_pair_dirs
    assert (eng / "draft/model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()
    opts = yaml.safe_load((eng / "llm_api_options.yaml").read_text())
    sc = opts["speculative_config"]
    assert sc == {**sc, "decoding_type": "DFlash", "speculative_model": "./draft", "max_draft_len": 7,
                  "mask_token_id": m.draft.mask_token_id, "target_layer_ids": m.draft.target_layer_ids}
    assert m.spec["quant"] == quant and m.plan["quant"] == quant and m.timings_s
    if quant == "none":
        assert m.acceptance is None and not (eng / "target/hf_quant_config.json").exists()
    else:
        hq = json.loads((eng / "target/hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == {"fp8": "FP8", "nvfp4": "NVFP4"}[quant]
        assert "lm_head" in hq["exclude_modules"]  # lm_head stays unquantized, as upstream recipes do
        assert hq.get("kv_cache_quant_algo") == ("FP8" if quant == "fp8" else None)
        assert m.acceptance["before"]["tau"] >= 1.0 and m.acceptance["after"]["tau"] >= 1.0
        assert "nvidia-modelopt" in m.versions


@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_engine_generates_what_the_reference_runtime_generates(engines, tiny_pair_dirs, quant):
    eng = engines[quant]
    pair = load_pair(PairSource(engine=eng))
    got = dflash_generate(pair.draft, pair.target, PROMPT, SamplingParams(max_tokens=24))
    ref_target = _reference_target(eng / "target")
    ref_draft = load_drafter(tiny_pair_dirs[1])
    ref = dflash_generate(ref_draft, ref_target, PROMPT, SamplingParams(max_tokens=24))
    assert got.output_ids == ref.output_ids
    assert got.output_ids == autoregressive_generate(ref_target, PROMPT, SamplingParams(max_tokens=24)).output_ids  # lossless
    src = _reference_target(tiny_pair_dirs[0]).model.layers[0]
    mlp = pair.target.model.layers[0].mlp
    w, orig = mlp.gate_proj.weight, src.mlp.gate_proj.weight
    # the default recipe (mlp-only) leaves attention in its source dtype, untouched; nvfp4's also
    # down_proj (dflash_trt.engine.recipes.DEFAULT_KEEP_MODULES), recorded in the manifest
    assert torch.equal(pair.target.model.layers[0].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    kept = verify_engine(eng).quantization.keep_modules
    assert kept == (["down_proj"] if quant == "nvfp4" else [])
    assert torch.equal(mlp.down_proj.weight, src.mlp.down_proj.weight) == (quant in ("none", "nvfp4"))
    if quant == "none":
        assert torch.equal(w, orig)
    else:  # really quantized, and close: NVFP4 error < 1/6 of the largest weight, FP8 < 1/16
        err = (w - orig).abs().max() / orig.abs().max()
        assert 0 < err < {"fp8": 1 / 16, "nvfp4": 1 / 6}[quant]


def test_verify_fails_after_one_byte_changes(engines, tmp_path):
    eng = tmp_path / "copy"
    shutil.copytree(engines["nvfp4"], eng)
    weights = next(p for p in sorted((eng / "target").glob("*.safetensors")))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    rel = weights.relative_to(eng).as_posix()
    with pytest.raises(DFlashError, match=rel):
        verify_engine(eng)
    r = CliRunner().invoke(main, ["verify", str(eng)])
    assert r.exit_code != 0 and rel in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(DFlashError, match=rel):
        load_pair(PairSource(engine=eng))  # the loader verifies first


def test_verify_rejects_an_unlisted_file_and_a_missing_manifest(engines, tmp_path):
    eng = tmp_path / "copy"
    shutil.copytree(engines["none"], eng)
    (eng / "draft" / "extra.bin").write_bytes(b"x")
    with pytest.raises(DFlashError, match="draft/extra.bin is not listed"):
        verify_engine(eng)
    (eng / "dflash_trt.json").unlink()
    with pytest.raises(DFlashError, match="not a dflash-trt engine directory"):
        verify_engine(eng)


def test_moe_engine_records_tp_ep_and_runs_in_the_reference_runtime(tmp_path):
    from tests.conftest import save_tiny_pair

    target, draft = save_tiny_pair(tmp_path / "pair", arch="gpt_oss")
    eng = _build(tmp_path / "moe", target, draft, quant="fp8", gpu="h100", tp=2, ep=2)
    m = verify_engine(eng)
    assert (m.mapping.tp, m.mapping.ep, m.mapping.world_size) == (2, 2, 2)
    opts = yaml.safe_load((eng / "llm_api_options.yaml").read_text())
    assert opts["tensor_parallel_size"] == 2 and opts["moe_expert_parallel_size"] == 2
    assert opts["moe_config"] == {"backend": "CUTLASS"}  # Hopper: CUTLASS does TP and EP
    hq = json.loads((eng / "target/hf_quant_config.json").read_text())["quantization"]
    assert any("router" in x for x in hq["exclude_modules"])  # MoE routers stay unquantized
    pair = load_pair(PairSource(engine=eng))
    got = dflash_generate(pair.draft, pair.target, PROMPT, SamplingParams(max_tokens=16))
    ref_target = _reference_target(eng / "target")
    assert got.output_ids == dflash_generate(load_drafter(draft), ref_target, PROMPT, SamplingParams(max_tokens=16)).output_ids
    assert got.output_ids == autoregressive_generate(ref_target, PROMPT, SamplingParams(max_tokens=16)).output_ids


def test_failed_build_leaves_no_directory(tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    out = tmp_path / "engine"
    with pytest.raises(DFlashError, match="calibration prompts file"):
        _build(out, target, draft, quant="fp8", **{"calibration.prompts": str(tmp_path / "missing.jsonl")})
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no half-written or .partial directory


def test_asking_the_gate_for_more_prompts_than_its_source_has_is_refused(tiny_pair_dirs, tmp_path):
    """The held-out split or a gate.prompts list caps what --gate-prompts can decode; asking for more
    silently decoded fewer, and an inconclusive verdict then advised asking for more again."""
    target, draft = tiny_pair_dirs
    out = tmp_path / "eng"
    with pytest.raises(DFlashError, match=r"--gate-prompts 3: gate.prompts has 2 prompts"):
        _build(out, target, draft, quant="fp8", **{"gate.prompts": ["Say hi.", "Count to three."], "gate.num_prompts": 3})
    assert not out.exists()


def test_cli_build_verify_and_refuse_to_overwrite(tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    out = tmp_path / "eng"
    args = ["build", "--target", str(target), "--draft", str(draft), "--max-seq-len", "256", "--out", str(out),
            "--no-progress", "--profile", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    # --quant none streams the checkpoint into the engine: no model is loaded
    assert summary["engine"] == str(out) and summary["peak_rss_mib"] > 0 and "export" in summary["timings_s"]
    assert "load" not in summary["timings_s"]
    assert "build profile" in r.stderr
    assert load_manifest(out).name.endswith("none-cpu-tp1")
    ok = CliRunner().invoke(main, ["verify", str(out)])
    assert ok.exit_code == 0 and ok.stdout.startswith("ok:")
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "already exists" in again.stderr and "--force" in again.stderr


def test_sigterm_during_a_build_removes_the_temporary_directory(tmp_path):
    """`timeout`, `scancel` and `kill` send SIGTERM, which by default skips all cleanup."""
    import os
    import signal

    from dflash_trt.process import sigterm_as_interrupt
    from dflash_trt.fsutil import atomic_directory

    out = tmp_path / "engine"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt(), atomic_directory(out) as tmp:
            (tmp / "target").mkdir()
            (tmp / "target" / "model.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_embedded_pair_builds_and_generates(tmp_path, quant):
    """The embedded pair (SmolLM2-135M + the project's drafter) built on CPU, loaded back, lossless."""
    from dflash_trt.embedded import default_pair_dirs

    try:
        target, draft = default_pair_dirs()
    except DFlashError as e:
        pytest.skip(f"embedded pair not available in this checkout: {e}")
    eng = _build(tmp_path / "smol", target, draft, quant=quant, max_seq_len=512, **{"gate.accept_tau_drop": True})
    m = verify_engine(eng)
    assert m.quantization.weights == quant
    if quant != "none":
        assert m.acceptance["before"]["tau"] >= 1.0 and m.acceptance["after"]["tau"] >= 1.0
        print(f"embedded {quant}: tau {m.acceptance['before']['tau']:.2f} -> {m.acceptance['after']['tau']:.2f}")
    pair = load_pair(PairSource(engine=eng))
    assert pair.tokenizer is not None
    ids = pair.tokenizer("The capital of France is")["input_ids"]
    got = dflash_generate(pair.draft, pair.target, ids, SamplingParams(max_tokens=12))
    assert got.output_ids == autoregressive_generate(pair.target, ids, SamplingParams(max_tokens=12)).output_ids


def test_recorded_spec_is_a_valid_build_spec(tmp_path, tiny_pair_dirs):
    """The Slurm build job re-runs `build --spec` on the manifest's spec: it must be accepted as is."""
    import json

    import yaml
    from click.testing import CliRunner

    from dflash_trt.cli import main

    tdir, ddir = tiny_pair_dirs
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", "--target", str(tdir), "--draft", str(ddir), "--out", str(out),
                                    "--max-seq-len", "256", "--no-progress", "--no-gate"])
    assert res.exit_code == 0, res.output
    spec = json.loads((out / "dflash_trt.json").read_text())["spec"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(main, ["build", "--spec", str(tmp_path / "spec.yaml"), "--dry-run", "--no-progress"])
    assert res.exit_code == 0, res.output


def test_a_build_running_in_float32_writes_the_engine_a_bfloat16_run_writes(tiny_pair_dirs, tmp_path):
    """--compute-dtype float32, what "auto" picks on a CPU without native bf16 (issue 35: bf16 ran
    4.8x slower than float32 there): calibration and the gate run on the exact float32 upcast of the
    bf16 model, and the engine is the bf16 run's -- every tensor in the same dtype with the same
    bits (quantized weights, their scales, the unquantized embeddings, norms and lm_head), config.json
    saying bfloat16 -- except the activation scales, calibrated on float32 activations, within
    bf16's rounding of the bf16 run's."""
    from safetensors.torch import load_file

    tdir, ddir = tiny_pair_dirs
    tensors, manifests = {}, {}
    for compute in ("bfloat16", "float32"):
        eng = _build(tmp_path / compute, tdir, ddir, quant="fp8", gpu="h100", dtype="bfloat16", compute_dtype=compute)
        tensors[compute] = {k: v for f in sorted((eng / "target").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        manifests[compute] = load_manifest(eng)
        assert json.loads((eng / "target/config.json").read_text())["dtype"] == "bfloat16"
        assert manifests[compute].acceptance["compute_dtype"] == compute
    bf16, f32 = tensors["bfloat16"], tensors["float32"]
    assert bf16.keys() == f32.keys()
    assert any(v.dtype == torch.float8_e4m3fn for v in bf16.values()) and "lm_head.weight" in bf16
    for name, want in bf16.items():
        got = f32[name]
        assert got.dtype == want.dtype, name
        if name.endswith("input_scale"):
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
        else:
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert {t.dtype for n, t in bf16.items() if not n.endswith("_scale")} == {torch.bfloat16, torch.float8_e4m3fn}
