"""The plain-torch dequantizer against ModelOpt's own quantizers and dequantizers (real ModelOpt
0.47: FP8QTensor, NVFP4QTensor, MXFP4QTensor, export_hf_checkpoint), for every scale layout, on
the CPU and, where a GPU is visible, on it (tests/device_harness.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.checkpoints.dequant import dequant_fp8, dequant_mxfp4, dequant_nvfp4, unpack_e2m1

try:
    from tests.device_harness import DATA_DEVICES
except ImportError:  # tests/ is not a package
    from device_harness import DATA_DEVICES


def _modelopt_nvfp4():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor


def test_e2m1_codes_decode_to_the_fp4_grid():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)  # element 2i in the low nibble
    vals = unpack_e2m1(packed)
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize("shape", [(32, 64), (3, 48, 160)])
def test_nvfp4_matches_modelopt_dequantize(shape):
    Q = _modelopt_nvfp4()
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.05
    qt, scale, scale_2 = Q.quantize(w.clone(), 16)
    ref = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    ours = dequant_nvfp4(qt._quantized_data, scale, scale_2, tuple(w.shape))
    assert torch.equal(ours, ref)
    # and it is a faithful reconstruction: NVFP4 error is bounded by half the largest grid step (1 of 6)
    assert (ours - w).abs().max() <= w.abs().max() / 6 + 1e-6


def test_nvfp4_expert_layout_packs_along_axis_minus_2():
    """GptOss experts are [E, in, out]; ModelOpt blocks along `in`, so the packed axis is -2."""
    Q = _modelopt_nvfp4()
    torch.manual_seed(1)
    w = torch.randn(4, 64, 96) * 0.1  # [E, in, out]
    qt, scale, scale_2 = Q.quantize(w.transpose(-1, -2).contiguous(), 16)  # blocks along `in`
    ref = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}).transpose(-1, -2)
    packed = qt._quantized_data.transpose(-1, -2)  # [E, in/2, out], as exported
    ours = dequant_nvfp4(packed, scale.transpose(-1, -2), scale_2, tuple(w.shape))
    assert torch.equal(ours, ref)


def test_fp8_export_equals_modelopt_fake_quant(tmp_path):
    """After calibration, the exported FP8 weight * scale equals ModelOpt's fake-quantized weight."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.recipes import modelopt_config, resolve_recipe
    from dflash_trt.runtime.tiny import tiny_target

    model = tiny_target("llama", seed=3)

    def forward_loop(m):
        for ids in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]):
            m(torch.tensor([ids]))

    full = resolve_recipe("fp8", "full", None, is_moe=False, native_experts=None, num_layers=4)
    mtq.quantize(model, modelopt_config("fp8", "none", full), forward_loop)
    fake = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_quantizer") and mod.weight_quantizer.is_enabled:
            with torch.no_grad():
                fake[name + ".weight"] = mod.weight_quantizer(mod.weight.detach().clone())
    assert len(fake) == 4 * 7  # q,k,v,o,gate,up,down in each of 4 layers; lm_head stays float
    export_hf_checkpoint(model, export_dir=tmp_path / "t")  # (replaces the weights in place)
    loaded = load_checkpoint(tmp_path / "t").state_dict()
    for key, ref in fake.items():
        torch.testing.assert_close(loaded[key], ref, rtol=1e-6, atol=1e-8)


def test_fp8_per_channel_scale_broadcasts():
    w = torch.tensor([[1.0, -2.0], [4.0, 8.0]]).to(torch.float8_e4m3fn)
    out = dequant_fp8(w, torch.tensor([0.5, 2.0]))
    assert out.tolist() == [[0.5, -1.0], [8.0, 16.0]]


@pytest.mark.parametrize("device", DATA_DEVICES)
@pytest.mark.parametrize("layout", ["per tensor", "per channel", "per channel keepdim", "blocks", "blocks cut short"])
def test_fp8_equals_modelopt_dequantize(device, layout):
    """Each FP8 scale layout ModelOpt's FP8QTensor makes, dequantized by it and by us: the same bits."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    shape = (200, 300) if layout == "blocks cut short" else (256, 384)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, shape[0])[:, None]
    kwargs: dict = {"block_sizes": {-1: 128, -2: 128}} if layout.startswith("blocks") else {}
    if layout.startswith("per channel"):
        kwargs = {"axis": 0}
    qt, scale = FP8QTensor.quantize(w.to(device), **kwargs)
    ref = qt.dequantize(dtype=torch.float32, scale=scale, **({"block_sizes": kwargs["block_sizes"]} if "block_sizes" in
                                                             kwargs else {}))
    ours_scale = scale.flatten() if layout == "per channel" else scale  # the export's [out] or the amax's [out, 1]
    assert {"per tensor": 1, "blocks": 6, "blocks cut short": 6}.get(layout, shape[0]) == scale.numel()
    ours = dequant_fp8(qt._quantized_data, ours_scale)
    assert ours.device == ref.device and torch.equal(ours, ref)


@pytest.mark.parametrize("device", DATA_DEVICES)
def test_mxfp4_equals_modelopt_dequantize(device):
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 1, 64)
    qt, scales = MXFP4QTensor.quantize(w.to(device), 32)
    ref = qt.dequantize(dtype=torch.float32, scale=scales, block_sizes={-1: 32})
    ours = dequant_mxfp4(qt._quantized_data.view(2, 8, 2, 16), scales.view(2, 8, 2)).view(2, 8, 64)
    assert ours.device == ref.device and torch.equal(ours, ref)


@pytest.mark.parametrize("cfg_name,algo,scale_shape", [
    ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "FP8_PER_CHANNEL_PER_TOKEN", (320,)),  # [out] per output channel
    ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "fp8_pb_wo", (3, 1, 2, 1)),  # 128 x 128 tiles, the last cut short
])
def test_modelopt_fp8_exports_load_as_their_fake_quantized_weights(tmp_path, cfg_name, algo, scale_shape):
    """A ModelOpt export in each FP8 scale layout, read back by load_checkpoint, equals ModelOpt's
    own fake-quantized weights (hidden 192, intermediate 320: block grids with partial tiles).
    Per-channel scales of one layer differ by up to ~10x, so one row's scale for all (issue 36) fails."""
    import copy
    import json

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file

    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.runtime.tiny import tiny_target

    model = tiny_target("llama", seed=3, hidden_size=192, intermediate_size=320, num_layers=2, num_heads=4)
    mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), lambda m: m(torch.tensor([[1, 2, 3, 4, 5, 6]])))
    fake = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_quantizer") and mod.weight_quantizer.is_enabled:
            with torch.no_grad():
                fake[name + ".weight"] = mod.weight_quantizer(mod.weight.detach().clone())
    assert len(fake) == 2 * 7
    export_hf_checkpoint(model, export_dir=tmp_path / "t")
    assert json.loads((tmp_path / "t" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    exported = load_file(str(tmp_path / "t" / "model.safetensors"))
    assert tuple(exported["model.layers.0.mlp.up_proj.weight_scale"].shape) == scale_shape
    loaded = load_checkpoint(tmp_path / "t").state_dict()
    for key, ref in fake.items():  # fake quantization rounds its own way: to the last ulp
        torch.testing.assert_close(loaded[key], ref, rtol=1e-6, atol=1e-8, msg=key)
