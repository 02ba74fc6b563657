"""The panel GEMM (runtime/cpu/panel_gemm.py, kernels/panel_gemm.cpp), built here from source by the
machine's compiler as `make setup` builds it: products equal to F.linear up to float32 rounding,
bit-for-bit batch invariance (a row's outputs do not depend on the other rows), bias and ragged
shapes, tracing through torch.compile, and the switch that keeps oneDNN.

Every ISA variant this CPU runs is built and tested (issue 35): on an AVX-512 machine the
x86-64-v4 build AND the x86-64-v3 (AVX2) one, which an AVX2 machine serves the runtime with; on an
AVX2 machine (or under ATEN_CPU_CAPABILITY=avx2) the v3 build alone. Where both run, they must
give the same bits (both sum every output's k in the same order with FMAs)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.cpu import panel_gemm
from dflash_trt.runtime.cpu.packing import PackedCPULinear, packed_kernel

pytestmark = pytest.mark.skipif(panel_gemm.unavailable() is not None,
                                reason=f"panel GEMM kernel unavailable here: {panel_gemm.unavailable()}")

VARIANTS = panel_gemm.variants()


@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    reason = panel_gemm.unavailable(request.param)
    assert reason is None, f"{request.param} runs on this CPU but was not built: {reason}"
    return request.param


def test_the_variants_follow_torchs_cpu_capability():
    """AVX-512 runs v4 and v3 (v4 serves), AVX2 v3 alone: what torch dispatches its own kernels to."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        assert VARIANTS == ["x86_64_v4", "x86_64_v3"]
    elif cap == "AVX2":
        assert VARIANTS == ["x86_64_v3"]
    assert panel_gemm.default_variant() == VARIANTS[0]
    assert panel_gemm.unavailable("x86_64_v9") is not None and "does not run on this CPU" in panel_gemm.unavailable("x86_64_v9")


@pytest.mark.parametrize("n,k", [(40, 24), (576, 576), (192, 1536), (17, 5), (1, 33)])
def test_products_match_f_linear_for_every_row_count(variant, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = panel_gemm.pack(w, variant)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 3, 4, 7, 8, 9, 13, 16, 33):
        x = torch.randn(m, k, generator=gen)
        got = panel_gemm.linear(x, panels, n, b, variant)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)
        assert torch.equal(panel_gemm.linear(x, panels, n, None, variant) + b, got)  # the bias is added after the sum


def test_a_rows_outputs_do_not_depend_on_the_other_rows_bit_for_bit(variant):
    """What makes a sequence's tokens independent of its batch: the same row alone, first, last or
    in the middle of 1..40-row batches (every tile shape and row chunking) gives identical bits."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 576, generator=gen)
    panels = panel_gemm.pack(w, variant)
    row = torch.randn(1, 576, generator=gen)
    alone = panel_gemm.linear(row, panels, 1536, None, variant)
    for m in range(1, 41):
        others = torch.randn(m, 576, generator=gen)
        for at in {0, m // 2, m}:
            batch = torch.cat([others[:at], row, others[at:]])
            assert torch.equal(panel_gemm.linear(batch, panels, 1536, None, variant)[at], alone[0]), (m, at)


@pytest.mark.skipif(len(VARIANTS) < 2, reason=f"one variant runs here ({VARIANTS[0]})")
def test_every_variant_gives_the_same_bits():
    """An engine decodes the same tokens on an AVX2 and an AVX-512 machine: the v3 build's products
    are the v4 build's, bit for bit, for every tile shape (1..33 rows) and ragged N and K."""
    gen = torch.Generator().manual_seed(2)
    for n, k in [(1536, 576), (576, 1536), (40, 24), (17, 5)]:
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        panels = panel_gemm.pack(w, VARIANTS[0])
        assert all(torch.equal(panel_gemm.pack(w, v), panels) for v in VARIANTS[1:])
        for m in (1, 2, 3, 5, 8, 9, 13, 16, 17, 33):
            x = torch.randn(m, k, generator=gen)
            want = panel_gemm.linear(x, panels, n, b, VARIANTS[0])
            for v in VARIANTS[1:]:
                assert torch.equal(panel_gemm.linear(x, panels, n, b, v), want), (v, n, k, m)


def test_packed_layer_uses_the_panels_and_traces_as_one_graph(variant):
    assert packed_kernel() == "panels"
    lin = torch.nn.Linear(64, 80, bias=True)
    layer = PackedCPULinear(lin)
    assert layer.variant == panel_gemm.default_variant()
    layer.repack("panels", variant)
    assert layer.kernel == "panels" and f"kernel=panels, variant={variant}" in repr(layer)
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        want = layer(x)
        torch._dynamo.reset()
        traced = torch.compile(layer, fullgraph=True, backend="eager")(x)  # the op has a fake: no graph break
    assert torch.equal(traced, want)
    torch.testing.assert_close(want, lin(x), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused_in_one_line():
    panels = panel_gemm.pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="do not match"):
        panel_gemm.linear(torch.randn(2, 9), panels, 32, None)
    with pytest.raises(RuntimeError, match="float32"):
        panel_gemm.pack(torch.randn(4, 4, dtype=torch.float64))


def test_the_switch_keeps_onednn(monkeypatch):
    """DFLASH_TRT_PANEL_GEMM=0 (A/B runs, a suspected kernel fault) packs for oneDNN instead."""
    monkeypatch.setenv(panel_gemm.DISABLE_ENV, "0")
    panel_gemm._load.cache_clear()
    try:
        assert panel_gemm.unavailable() == f"{panel_gemm.DISABLE_ENV}=0"
        assert PackedCPULinear(torch.nn.Linear(8, 8)).kernel == "onednn"
    finally:
        monkeypatch.delenv(panel_gemm.DISABLE_ENV)
        panel_gemm._load.cache_clear()
    assert panel_gemm.unavailable() is None


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's cpp_extension waits without a timeout for its ``lock`` file to vanish; a build
    killed mid-way leaves it, and `make setup` once hung a whole CI run on one. A fresh process
    loading the built kernels from a cache holding such a file must load them, not wait. (The
    cache is the one the suite uses: the file is removed whatever the outcome.)"""
    import subprocess
    import sys
    import time

    # this source version's builds only: a cache shared with older checkouts holds other versions,
    # which this process never loads (nor unlocks)
    built = [panel_gemm.build_dir(v) for v in panel_gemm.variants()]
    assert all(any(d.glob("*.so")) for d in built), f"a variant of this source is not built: {built}"
    code = ("from dflash_trt.runtime.cpu import panel_gemm as p; import sys; "
            "sys.exit(0 if all(p.unavailable(v) is None for v in p.variants()) else 3)")
    try:
        for d in built:
            (d / "lock").touch()  # what a killed build leaves
        done = subprocess.run([sys.executable, "-c", code], timeout=90, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        # gone for good: another test process (a parallel worker) loading the kernel holds the
        # file for a moment while torch runs ninja, so a left lock is one still there after 10 s
        deadline = time.time() + 10
        while any((d / "lock").exists() for d in built):
            assert time.time() < deadline, "the stale lock files were left in place"
            time.sleep(0.1)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the kernel waited on a stale cpp_extension lock file")
    finally:
        for d in built:
            (d / "lock").unlink(missing_ok=True)
