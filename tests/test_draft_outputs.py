"""The drafter computes only the block positions a step reads (`outputs`): the same hidden
states as the whole block's, bit for bit with the CPU runtime's panel kernel (batch-invariant
linear layers), and to rounding with oneDNN's (DFLASH_TRT_PANEL_GEMM=0) or plain layers.

k = 1 is the case that found the attention's dependence on the query count (issue 35): one query
runs PyTorch's attention as a GEMV, several as a GEMM, which sum in other orders on AVX2 and
AVX-512 alike; the drafter therefore attends from every block position and narrows after."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.cpu import panel_gemm
from dflash_trt.runtime.cpu.packing import PackedCPULinear, num_packed, pack_cpu_linears, repack
from dflash_trt.runtime.tiny import random_draft, tiny_target


@pytest.mark.parametrize("kernel", ["panels", "onednn", "plain"])
@pytest.mark.parametrize("rows,ctx,k", [(1, 3, 3), (4, 2, 1), (3, 5, 7)])
def test_only_the_draft_slots_equal_the_whole_blocks_slots(kernel, rows, ctx, k):
    """The panel kernel's claim is bit for bit (oneDNN's blocking, like MKL's, follows the row
    count: those two are equal to rounding). Where the panel kernel cannot load, its leg is
    skipped with the reason, never loosened."""
    if kernel == "panels" and panel_gemm.unavailable() is not None:
        pytest.skip(f"the panel kernel is inactive here: {panel_gemm.unavailable()}")
    target = tiny_target("qwen3", seed=3, hidden_size=64)
    draft = random_draft(target.config, seed=1, num_layers=2, block_size=8).eval()
    if kernel != "plain":
        pack_cpu_linears(draft)
        repack(draft, kernel)
        assert num_packed(draft) > 0
        assert {m.kernel for m in draft.modules() if isinstance(m, PackedCPULinear)} == {kernel}
    H, B = target.config.hidden_size, draft.block_size
    g = torch.Generator().manual_seed(rows * 100 + k)
    feats = torch.randn(rows, ctx, len(draft.target_layer_ids) * H, generator=g)
    block = torch.randn(rows, B, H, generator=g)
    pos = torch.arange(ctx + B)[None].expand(rows, -1) + 20
    mask = torch.ones(rows, 1, 1, ctx + B, dtype=torch.bool)
    for m in (None, mask):
        with torch.inference_mode():
            whole = draft(feats, block, pos, None, m)[:, 1 : k + 1]  # [rows, k, H]
            slots = draft(feats, block, pos, None, m, outputs=slice(1, k + 1))
        assert slots.shape == (rows, k, H)
        if kernel == "panels":
            assert torch.equal(slots, whole)
        else:
            torch.testing.assert_close(slots, whole, rtol=1e-5, atol=1e-6)
