"""The plain-torch dequantizer against ModelOpt's own quantizers (real ModelOpt, CPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.checkpoints.dequant import dequant_fp8, dequant_nvfp4, unpack_e2m1


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
