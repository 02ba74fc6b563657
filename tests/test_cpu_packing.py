"""oneDNN-packed linear layers (runtime/cpu/packing.py): same outputs, same greedy text, tied
weights kept, gradients still flow for training, and packing declines where it does not apply."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime import autoregressive_generate, dflash_generate
from dflash_trt.runtime.batched.runtime import batched_generate
from dflash_trt.runtime.cpu.packing import (
    PackedCPULinear,
    num_packed,
    pack_cpu_linears,
    packed_bytes,
    packing_unsupported,
    set_packed,
)
from dflash_trt.runtime.targets.loading import load_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


class _Ops(TorchDispatchMode):
    """The names of the ops a call dispatches: which kernel a linear layer ran, where the packed and
    the dense path give the same bits (the tiny target's logits do) and outputs cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _packed_kernels(names: set[str]) -> set[str]:
    """The packed kernels among `names`: the panel GEMM's ops (dflash_<variant>::) and oneDNN's."""
    return {n for n in names if n.startswith(("dflash_", "mkldnn::")) or n == "aten::mkldnn_linear"}


def test_packed_layers_give_the_same_logits_and_keep_weights_shared(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0])
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    head = model.get_output_embeddings()
    keys = set(model.state_dict())
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.inference_mode():
        want = model(ids).logits
    n = pack_cpu_linears(model)
    assert n == len(linears) and pack_cpu_linears(model) == n  # every linear, lm_head included; idempotent
    assert num_packed(model) == n and packed_bytes(model) == sum(m.weight.numel() * 4 for m in linears)
    packed_head = model.get_output_embeddings()
    assert isinstance(packed_head, PackedCPULinear) and packed_head.weight is head.weight
    tied = head.weight is model.get_input_embeddings().weight  # SmolLM2 ties them; the tiny target does not
    assert (packed_head.weight is model.get_input_embeddings().weight) == tied
    assert set(model.state_dict()) == keys  # nothing extra saved
    with torch.inference_mode():
        with _Ops() as packed_run:
            got = model(ids).logits
        set_packed(model, False)
        with _Ops() as stock_run:
            stock_path = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert _packed_kernels(packed_run.names) and "aten::linear" not in packed_run.names  # the packed kernels ran
    assert torch.equal(stock_path, want)  # switched off: exactly the dense path
    assert not _packed_kernels(stock_run.names) and "aten::linear" in stock_run.names  # and it did switch off


def test_packed_layer_with_bias_matches_nn_linear():
    lin = torch.nn.Linear(24, 40, bias=True)
    x = torch.randn(3, 7, 24)
    with torch.inference_mode():
        torch.testing.assert_close(PackedCPULinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_training_through_packed_layers_still_gets_gradients(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0])
    pack_cpu_linears(model)
    x = torch.randn(2, 4, model.config.hidden_size, requires_grad=True)
    model.get_output_embeddings()(x).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_greedy_text_is_unchanged_by_packing(tiny_pair_dirs):
    """Plain decoding with stock layers; plain, DFlash and batched DFlash with packed ones (target
    and drafter): one token stream."""
    tdir, ddir = tiny_pair_dirs
    prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8]]
    stock = [autoregressive_generate(load_target(tdir), p, SamplingParams(max_tokens=24)).output_ids for p in prompts]
    pair = load_pair(PairSource(tdir, ddir))  # packs both models by default
    assert num_packed(pair.target) > 0 and num_packed(pair.draft) > 0
    for p, want in zip(prompts, stock):
        assert autoregressive_generate(pair.target, p, SamplingParams(max_tokens=24)).output_ids == want
        assert dflash_generate(pair.draft, pair.target, p, SamplingParams(max_tokens=24)).output_ids == want
    assert [r.output_ids for r in batched_generate(pair.draft, pair.target, prompts, SamplingParams(max_tokens=24))] == stock


def test_packing_declines_where_it_does_not_apply(tiny_pair_dirs):
    model = load_target(tiny_pair_dirs[0], dtype=torch.bfloat16)
    assert "bfloat16" in packing_unsupported(model)
    assert pack_cpu_linears(model) == 0
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    pair = load_pair(PairSource(*tiny_pair_dirs), RuntimeOptions(pack=False))
    assert num_packed(pair.target) == 0 and num_packed(pair.draft) == 0


def test_onednn_kernel_and_its_fallback_without_the_pointwise_op_compute_the_same(monkeypatch):
    """Where the panel kernel cannot be built, layers pack for oneDNN (blocked layout, MKL's GEMV
    for one row); builds without torch.ops.mkldnn._linear_pointwise use mkldnn_linear instead."""
    import dflash_trt.runtime.cpu.packing as cp

    lin = torch.nn.Linear(24, 40, bias=True)
    with torch.inference_mode():
        for rows in (1, 5):
            x = torch.randn(rows, 24)
            layer = PackedCPULinear(lin, kernel="onednn")
            with _Ops() as fast_run:
                fast = layer(x)
            torch.testing.assert_close(fast, lin(x), rtol=1e-5, atol=1e-5)
            monkeypatch.setattr(cp, "_LINEAR_POINTWISE", None)
            layer = PackedCPULinear(lin, kernel="onednn")
            with _Ops() as slow_run:
                slow = layer(x)
            monkeypatch.undo()
            torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
            # each leg ran its kernel (one row: MKL's GEMV on the dense weight in both)
            want_fast, want_slow = ({"aten::linear"}, {"aten::linear"}) if rows == 1 else (
                {"mkldnn::_linear_pointwise"}, {"aten::mkldnn_linear"})
            assert _packed_kernels(fast_run.names) | ({"aten::linear"} & fast_run.names) == want_fast
            assert _packed_kernels(slow_run.names) | ({"aten::linear"} & slow_run.names) == want_slow


def test_a_pair_for_another_device_is_loaded_there_unpacked(tiny_pair_dirs):
    """Regression (seen on an H100): `bench --device cuda` loaded the pair on CPU, packed it, then
    moved it, and the first GPU forward failed inside oneDNN. load_pair loads on the device,
    where packing declines. "meta" stands in for a GPU here (no GPU in CI): any non-CPU device."""
    on_cpu = load_pair(PairSource(str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1])), RuntimeOptions(dtype="float32"))
    assert num_packed(on_cpu.target) > 0
    pair = load_pair(PairSource(str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1])),
                     RuntimeOptions(dtype="float32", device="meta"))
    assert num_packed(pair.target) == 0 and num_packed(pair.draft) == 0
    assert {p.device.type for m in (pair.target, pair.draft) for p in m.parameters()} == {"meta"}
