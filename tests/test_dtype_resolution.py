"""dtype resolution (runtime_options.py): "auto" per device everywhere, 16-bit arithmetic on a CPU
only where it is native (issue 35; issue 36 found the engine loader resolving "auto" as for the CPU
whatever the device).

A CPU without native bfloat16 cannot be borrowed here; it is emulated the way torch and oneDNN
themselves allow: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in a child process (read
once, when torch starts), on this machine's real detection code. On an AVX2 machine the same
child sees what the parent sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime_options import RuntimeOptions, auto_dtype, compute_dtype, cpu_has_native_bf16, torch_dtype

try:
    from tests.engine_fixtures import make_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import make_tiny_engine

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("dtype"))


def _dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_auto_follows_the_device_and_what_this_cpu_multiplies():
    native = cpu_has_native_bf16()
    assert auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert auto_dtype("meta") == torch_dtype("auto", "meta") == torch.bfloat16  # a GPU stand-in: its default
    # what a model in these weights runs in: 16 bits on a CPU only where native, always on other devices
    assert compute_dtype(torch.bfloat16, "cpu") == auto_dtype("cpu")
    assert compute_dtype(torch.float16, "cpu") == torch.float32
    assert compute_dtype(torch.float32, "cpu") == compute_dtype(torch.float32, "meta") == torch.float32
    assert compute_dtype(torch.bfloat16, "meta") == torch.bfloat16 and compute_dtype(torch.float16, "meta") == torch.float16


def test_the_engine_loader_resolves_auto_for_its_device(engine):
    for device in ("cpu", "meta"):
        pair = load_pair(PairSource(engine=engine), RuntimeOptions(dtype="auto", device=device, pack=False))
        assert _dtypes(pair.target) == _dtypes(pair.draft) == {auto_dtype(device)}, device
        assert {p.device.type for p in pair.target.parameters()} == {device}


CHILD = """
import json, sys, torch
from dflash_trt.engine.builder import resolve_compute_dtype
from dflash_trt.engine.devices import BuildDevice
from dflash_trt.engine.spec import BuildSpec
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime_options import RuntimeOptions, auto_dtype, compute_dtype, cpu_has_native_bf16
name = lambda d: str(d).removeprefix("torch.")
dtypes = lambda m: sorted({name(p.dtype) for p in m.parameters()})
out = {"capability": torch.backends.cpu.get_cpu_capability(), "native": cpu_has_native_bf16(),
       "auto_cpu": name(auto_dtype("cpu")), "compute_cpu": name(compute_dtype(torch.bfloat16, "cpu")),
       "build_cpu": name(resolve_compute_dtype(BuildSpec(), torch.bfloat16, BuildDevice("cpu"))),
       "build_cuda": name(resolve_compute_dtype(BuildSpec(), torch.bfloat16, BuildDevice("cuda", (80 << 30,)))),
       "build_forced": name(resolve_compute_dtype(BuildSpec(compute_dtype="bfloat16"), torch.bfloat16,
                                                  BuildDevice("cpu")))}
for device in ("cpu", "meta"):
    pair = load_pair(PairSource(engine=sys.argv[1]), RuntimeOptions(dtype="auto", device=device, pack=False))
    out["engine_" + device] = dtypes(pair.target) + dtypes(pair.draft)
print(json.dumps(out))
"""


def test_a_cpu_without_native_bf16_resolves_to_float32_and_other_devices_do_not_follow_it(engine):
    """The AVX2 machine of issue 35 (its CPU flags may still list avx512_bf16 here: what counts is
    what torch and oneDNN will use): "auto" is float32 on its CPU, bfloat16 on a GPU or the meta
    device (the engine loader resolved it as for the CPU there), and the build runs its bf16 models
    in float32 on that CPU only."""
    env = {**os.environ, **AVX2_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", CHILD, str(engine)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["capability"] == "AVX2" and got["native"] is False
    assert got["auto_cpu"] == got["compute_cpu"] == got["build_cpu"] == "float32"
    assert got["build_cuda"] == got["build_forced"] == "bfloat16"
    assert got["engine_cpu"] == ["float32", "float32"]
    assert got["engine_meta"] == ["bfloat16", "bfloat16"]
