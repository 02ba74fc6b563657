"""Dequantization on every device, for every scale layout (tests/device_harness.py: cpu, meta, cuda).

The meta leg runs each dequantizer under strict_devices: a table or scale left on the CPU while
the weights are on the device (issue 36: `unpack_e2m1`'s E2M1 table, which broke every MXFP4 and
NVFP4 build on a GPU) raises there. The data legs compare values with transformers' own
dequantizers (transformers 5.14: `integrations/finegrained_fp8.Fp8Dequantize` for FP8 block
scales, `integrations/mxfp4.convert_moe_packed_tensors` for MXFP4) or with values worked by hand;
ModelOpt's own dequantizers (FP8QTensor, NVFP4QTensor, MXFP4QTensor) are the oracles of
tests/test_build_dequant.py (ModelOpt takes ~15 s to import: the integration tier).
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.checkpoints.dequant import (dequant_fp8, dequant_mxfp4, dequant_nvfp4, dequantize_tensor,
                                            read_fp8_block, read_quant_algo, unpack_e2m1)

try:
    from tests.device_harness import DATA_DEVICES, DEVICES, strict_devices
except ImportError:  # tests/ is not a package
    from device_harness import DATA_DEVICES, DEVICES, strict_devices

FP8 = torch.float8_e4m3fn


def _fp8(values, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(FP8).to(device)


def _random_fp8(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(FP8)


def _reader(state: dict[str, torch.Tensor]):
    return state.__contains__, state.__getitem__


def _check(out: torch.Tensor, device: str, shape: tuple[int, ...], want: torch.Tensor | None = None) -> None:
    """`out` on `device` with `shape`; on a data device equal to `want`."""
    assert out.device.type == device and tuple(out.shape) == shape
    if want is not None and device != "meta":
        assert torch.equal(out.cpu(), want)


# -- E2M1, NVFP4, MXFP4 --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_table_lives_on_the_codes_device(device):
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).to(device)
    with strict_devices():
        vals = unpack_e2m1(packed)
    _check(vals, device, (16,), torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]))


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_on_device_equals_transformers(device):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8, generator=g)  # [E, rows, G, 16]
    scales = torch.randint(115, 135, (2, 8, 3), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, rows, G*32]
    with strict_devices():
        out = dequant_mxfp4(blocks.to(device), scales.to(device))
    _check(out, device, (2, 8, 96), want)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_on_device(device):
    """Worked by hand: codes 1 (0.5) and 15 (-6) times block scale 2 (FP8) times scale_2 0.25."""
    packed = torch.full((2, 8), 1 | (15 << 4), dtype=torch.uint8)  # 2 rows x 16 values, one block of 16
    block = torch.full((2, 1), 2.0).to(FP8)
    with strict_devices():
        out = dequant_nvfp4(packed.to(device), block.to(device), torch.tensor(0.25).to(device), (2, 16))
    _check(out, device, (2, 16), torch.tensor([0.25, -3.0]).repeat(2, 8))


# -- FP8: per tensor, per output channel, per block ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_per_tensor(device):
    with strict_devices():
        out = dequant_fp8(_fp8([[1, -2], [4, 8]], device), torch.tensor(0.5).to(device))
    _check(out, device, (2, 2), torch.tensor([[0.5, -1], [2, 4]]))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_per_output_channel_through_the_loader(device):
    """issue 36: the loader scaled every row of a 2-D weight by row 0's scale ([[.5, -1], [2, 4]])."""
    state = {"m.weight": _fp8([[1, -2], [4, 8]]), "m.weight_scale": torch.tensor([0.5, 2.0])}
    with strict_devices():
        out, keys = dequantize_tensor("m.weight", (2, 2), "FP8_PER_CHANNEL_PER_TOKEN", *_reader(state),
                                      device=device)
    assert keys == ["m.weight", "m.weight_scale"]
    _check(out, device, (2, 2), torch.tensor([[0.5, -1.0], [8.0, 16.0]]))
    # [out, 1] (ModelOpt's keepdim amax) is the same layout
    state["m.weight_scale"] = torch.tensor([[0.5], [2.0]])
    out, _ = dequantize_tensor("m.weight", (2, 2), "FP8", *_reader(state), device=device)
    _check(out, device, (2, 2), torch.tensor([[0.5, -1.0], [8.0, 16.0]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(256, 384), (128, 128)])
def test_fp8_blocks_equal_transformers_fine_grained_fp8(device, shape):
    """transformers' `weight_scale_inv` [R/128, C/128] (multiplied, despite its name)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    R, C = shape
    w = _random_fp8(shape)
    s = torch.rand(R // 128, C // 128, generator=torch.Generator().manual_seed(1)) + 0.5
    want = Fp8Dequantize(None).convert({"weight$": w, "weight_scale_inv": s})["weight"]
    state = {"m.weight": w, "m.weight_scale_inv": s}
    with strict_devices():
        out, keys = dequantize_tensor("m.weight", shape, "FP8", *_reader(state), device=device, fp8_block=(128, 128))
    assert keys == ["m.weight", "m.weight_scale_inv"]
    _check(out, device, shape, want)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_blocks_cut_short_at_the_edges(device):
    """A 200 x 300 weight in 128 x 128 blocks: a 2 x 3 grid whose last row and column of tiles are
    cut short (ModelOpt pads, scales and crops; worked here tile by tile)."""
    w = _random_fp8((200, 300))
    s = torch.arange(1.0, 7.0).view(2, 3)
    want = w.float().clone()
    for i in range(2):
        for j in range(3):
            want[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= s[i, j]
    with strict_devices():
        out = dequant_fp8(w.to(device), s.to(device))  # no block named: 128 x 128 fits the grid
        kept = dequant_fp8(w.to(device), s.view(2, 1, 3, 1).to(device))  # as ModelOpt's FP8_PB_WO export keeps it
    _check(out, device, (200, 300), want)
    _check(kept, device, (200, 300), want)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_stacked_experts_each_layout(device):
    """[E, R, C] experts: one scale per expert [E], per expert and output row [E, R], per expert
    and column [E, C] (ModelOpt's BMM-style experts), per expert block grid [E, gr, gc]
    (transformers' `<experts>.gate_up_proj_scale_inv`)."""
    E, R, C = 3, 4, 6
    w = _random_fp8((E, R, C))
    g = torch.Generator().manual_seed(2)
    layouts = {
        "per expert": (torch.rand(E, generator=g), lambda s: s.view(E, 1, 1)),
        "per expert row": (torch.rand(E, R, generator=g), lambda s: s.view(E, R, 1)),
        "per expert column": (torch.rand(E, C, generator=g), lambda s: s.view(E, 1, C)),
        "per expert block": (torch.rand(E, 2, 3, generator=g),
                             lambda s: s.repeat_interleave(2, 1).repeat_interleave(2, 2)),
    }
    for name, (s, expand) in layouts.items():
        state = {"experts.gate_up_proj": w, "experts.gate_up_proj_scale_inv": s}
        with strict_devices():
            out, _ = dequantize_tensor("experts.gate_up_proj", (E, R, C), "FP8", *_reader(state), device=device,
                                       fp8_block=(2, 2) if name == "per expert block" else None)
        _check(out, device, (E, R, C), w.float() * expand(s))


def test_fp8_scales_that_fit_no_layout_are_refused():
    w = _random_fp8((256, 256))
    with pytest.raises(ValueError, match=r"FP8 scale \(3,\) fits no layout"):
        dequant_fp8(w, torch.ones(3))
    with pytest.raises(ValueError, match="do not tile a 256 x 256 weight in 64 x 64 blocks"):
        dequant_fp8(w, torch.ones(2, 2), block=(64, 64))
    with pytest.raises(ValueError, match="do not tile"):  # 3 x 3 tiles of 256: no 128 block, no exact division
        dequant_fp8(w, torch.ones(3, 3))
    with pytest.raises(ValueError, match="square"):  # experts [E, 4, 4] with a [E, 4] scale: rows or columns?
        dequant_fp8(_random_fp8((2, 4, 4)), torch.ones(2, 4))


def _write_config(d, qc: dict | None, hq: dict | None = None) -> None:
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **({"quantization_config": qc} if qc else {})}))
    if hq is not None:
        (d / "hf_quant_config.json").write_text(json.dumps({"quantization": hq}))


def test_quant_formats_read_from_either_producer(tmp_path):
    fine = tmp_path / "fine"  # transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3 style)
    _write_config(fine, {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    assert (read_quant_algo(fine), read_fp8_block(fine)) == ("FP8", (128, 128))
    blocks = tmp_path / "modelopt_pb"  # ModelOpt's FP8_2D_BLOCKWISE export writes the name in lower case
    _write_config(blocks, {"quant_method": "modelopt", "quant_algo": "fp8_pb_wo"}, {"quant_algo": "fp8_pb_wo"})
    assert (read_quant_algo(blocks), read_fp8_block(blocks)) == ("FP8_PB_WO", None)
    bad = tmp_path / "bad"
    _write_config(bad, {"quant_method": "fp8", "weight_block_size": [128]})
    from dflash_trt.errors import DFlashError

    with pytest.raises(DFlashError, match="weight_block_size=\\[128\\]; want two positive integers"):
        read_fp8_block(bad)


@pytest.mark.parametrize("device", DATA_DEVICES)
def test_fp8_bfloat16_result_rounds_once(device):
    """The loader's bf16 result is the float32 product rounded once (no bf16 product first)."""
    state = {"m.weight": _fp8([[448.0, 3.0]]), "m.weight_scale": torch.tensor(1.00390625)}
    out, _ = dequantize_tensor("m.weight", (1, 2), "FP8", *_reader(state), dtype=torch.bfloat16, device=device)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), (torch.tensor([[448.0, 3.0]]) * 1.00390625).to(torch.bfloat16))
