"""Checkpoint loading on a device, and over a device map that spreads a target over two devices.

`build --device cuda` loads the target over every visible GPU (an accelerate device map) and
dequantizes each tensor on its GPU as it is read. Without GPUs the two devices of the map are
"cpu" and "meta" (tests/device_harness.py): every parameter must land on the device the map gives
it, the dequantizers must run wholly there (strict_devices refuses a CPU table or scale meeting
meta weights, as CUDA refuses it), and a forward must carry the activations across the two
devices. Formats: float, ModelOpt-layout NVFP4 and gpt-oss MXFP4 (both made by hand here: only
placement is under test; their values are tested against ModelOpt and transformers elsewhere),
and transformers' fine-grained FP8, whose loaded values must equal transformers' own
dequantization (`FineGrainedFP8Config(dequantize=True)`, transformers 5.14).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoints.placement import device_of, home_device, model_devices
from dflash_trt.checkpoints.streaming import load_checkpoint
from dflash_trt.runtime.tiny import tiny_target

try:
    from tests.device_harness import DEVICES, needs_cuda, strict_devices
    from tests.gptoss_fixtures import MODULES_TO_NOT_CONVERT
except ImportError:  # tests/ is not a package
    from device_harness import DEVICES, needs_cuda, strict_devices
    from gptoss_fixtures import MODULES_TO_NOT_CONVERT

# layer 0 and the embedding on one device, the rest on the other: what plan_device_map makes of two GPUs
TWO_DEVICES = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
               "model.layers.1": "meta", "model.norm": "meta", "lm_head": "meta"}


def _rewrite(tdir: Path, convert, quantization_config: dict, hf_quant: dict | None = None) -> None:
    """Replace model.safetensors's tensors by `convert(key, tensor)` (a dict) and declare the format."""
    state = load_file(str(tdir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        out.update(convert(key, value))
    save_file({k: v.contiguous() for k, v in out.items()}, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (tdir / "config.json").write_text(json.dumps(cfg, indent=2))
    if hf_quant is not None:
        (tdir / "hf_quant_config.json").write_text(json.dumps({"quantization": hf_quant}))


def _float(root: Path) -> Path:
    tiny_target("llama", seed=1, num_layers=2).save_pretrained(root / "float")
    return root / "float"


def _fine_grained_fp8(root: Path) -> Path:
    """transformers' own FP8 quantizer (Fp8Quantize, 128 x 128 blocks) over a tiny Llama whose
    projections span 2 x 3 blocks."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    tdir = root / "fp8"
    tiny_target("llama", seed=1, hidden_size=256, intermediate_size=384, num_layers=2).save_pretrained(tdir)
    config = FineGrainedFP8Config(weight_block_size=[128, 128])
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    _rewrite(tdir, lambda k, v: quantize.convert({k: v}) if k.endswith("proj.weight") else {k: v},
             {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    return tdir


def _nvfp4(root: Path) -> Path:
    """ModelOpt's NVFP4 layout, random codes: uint8 [out, in/2], FP8 block scales [out, in/16], a scale_2."""
    g = torch.Generator().manual_seed(2)
    tdir = root / "nvfp4"
    tiny_target("llama", seed=1, num_layers=2).save_pretrained(tdir)

    def convert(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if not key.endswith("proj.weight"):
            return {key: value}
        out, cols = value.shape
        base = key[: -len("weight")]
        return {key: torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8, generator=g),
                base + "weight_scale": (torch.rand(out, cols // 16, generator=g) + 0.5).to(torch.float8_e4m3fn),
                base + "weight_scale_2": torch.tensor(0.01)}

    algo = {"quant_algo": "NVFP4", "group_size": 16}
    _rewrite(tdir, convert, {"quant_method": "modelopt", **algo}, algo)
    return tdir


def _mxfp4(root: Path) -> Path:
    """gpt-oss's released layout, random codes: experts as [E, out, in/32, 16] blocks + E8M0 scales."""
    g = torch.Generator().manual_seed(3)
    tdir = root / "mxfp4"
    tiny_target("gpt_oss", seed=1, num_layers=2, hidden_size=64, intermediate_size=96, vocab_size=160
                ).save_pretrained(tdir)

    def convert(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {key: value}
        E, cols, rows = value.shape  # GptOssExperts keeps [E, in, out]; the release stores the transpose
        return {key + "_blocks": torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g),
                key + "_scales": torch.randint(118, 130, (E, rows, cols // 32), dtype=torch.uint8, generator=g)}

    _rewrite(tdir, convert, {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT})
    return tdir


FORMATS = {"float": _float, "fp8 blocks": _fine_grained_fp8, "nvfp4": _nvfp4, "mxfp4": _mxfp4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device_checkpoints")
    return {name: make(root) for name, make in FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_device_map_over_two_devices_places_and_dequantizes_each_tensor_on_its_device(checkpoints, fmt):
    with strict_devices():
        model = load_checkpoint(checkpoints[fmt], device_map=TWO_DEVICES)
    for name, p in model.named_parameters():
        assert p.device.type == device_of(TWO_DEVICES, name), name
    assert home_device(model) == torch.device("cpu") and len(model_devices(model)) == 2
    # the host's half holds the same values as a load on the host alone
    whole = dict(load_checkpoint(checkpoints[fmt]).named_parameters())
    for name, p in model.named_parameters():
        if p.device.type == "cpu":
            assert torch.equal(p, whole[name]), name
    # a forward crosses to the meta half and back: only the copy of its (data-less) logits to the
    # home device can fail, never an op between the two devices. (Not gpt-oss: its experts' grouped
    # matmul has no float32 meta kernel in torch 2.13.)
    if fmt != "mxfp4":
        with strict_devices(), pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_device_takes_every_tensor(checkpoints, fmt, device):
    with strict_devices():
        model = load_checkpoint(checkpoints[fmt], device=device)
    assert model_devices(model) == [torch.device(device if device != "cuda" else "cuda:0")]


def test_fine_grained_fp8_loads_as_transformers_dequantizes_it(checkpoints):
    """transformers' `weight_scale_inv` block scales (Qwen3-*-FP8, DeepSeek-V3 style checkpoints):
    the reference runtime's weights equal transformers' own dequantized load, bit for bit."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from dflash_trt.runtime.targets.loading import load_target

    tdir = checkpoints["fp8 blocks"]
    ref = AutoModelForCausalLM.from_pretrained(
        tdir, dtype=torch.float32, quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128], dequantize=True))
    want = ref.state_dict()
    for got in (load_checkpoint(tdir).state_dict(), load_target(tdir).state_dict()):  # build's and generate's loads
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=needs_cuda)])
def test_the_gates_models_share_the_targets_home_device(tiny_pair_dirs, tmp_path, device):
    """What `build` calibrates and gates with: the drafter (its draft vocabulary too) where the
    target's inputs go, the target over every visible GPU on cuda."""
    import shutil

    from dflash_trt.engine.builder import load_models, prepare
    from dflash_trt.engine.devices import resolve_device
    from dflash_trt.engine.spec import resolve_spec
    from dflash_trt.runtime.drafters.draft_vocab import save_draft_vocab

    tdir, ddir = tiny_pair_dirs
    shutil.copytree(ddir, tmp_path / "draft")
    save_draft_vocab(tmp_path / "draft", torch.arange(30), 1.0)
    spec = resolve_spec(None, {"target": str(tdir), "draft": str(tmp_path / "draft"), "gpu": "cpu",
                               "max_seq_len": 256})
    models = load_models(prepare(spec), torch.float32, resolve_device(device), torch.float32)
    home = home_device(models.target)
    visible = {torch.device("cpu")} if device == "cpu" else {torch.device("cuda", i) for i in
                                                             range(torch.cuda.device_count())}
    assert home.type == device and set(model_devices(models.target)) <= visible
    assert model_devices(models.draft) == [home] and models.draft.draft_vocab.device == home
