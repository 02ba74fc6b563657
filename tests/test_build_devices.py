"""`build --device auto|cpu|cuda`: which device, and how the target is spread over the GPUs.

No GPU is lent to this machine: what is tested is the DECISION (dflash_trt.engine.devices), a pure
function of the free bytes each GPU reports, on meta models (no weights); the CPU path runs for real
in every other build test. A GPU run of `build --device cuda` is in the issue's GPU checklist.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.checkpoints.placement import device_of
from dflash_trt.checkpoints.streaming import empty_model
from dflash_trt.engine.devices import plan_device_map, resolve_device, usable_bytes
from dflash_trt.errors import DFlashError

GB = 10**9


def _layer_index(prefix: str) -> int:
    return int(prefix.split(".")[2]) if prefix.startswith("model.layers.") else -1


def _module_bytes(model, prefix: str) -> int:
    from accelerate.utils import compute_module_sizes

    return compute_module_sizes(model, dtype=torch.bfloat16)[prefix]


def test_resolve_device():
    assert resolve_device("cpu", free=(80 * GB,)).kind == "cpu"
    assert resolve_device("auto", free=()).kind == "cpu"
    cuda = resolve_device("auto", free=(80 * GB, 80 * GB))
    assert cuda.kind == "cuda" and cuda.num_gpus == 2
    with pytest.raises(DFlashError, match="--device cuda but no CUDA GPU is visible"):
        resolve_device("cuda", free=())


def test_one_gpu_takes_the_whole_model():
    from dflash_trt.runtime.tiny import tiny_target_config

    meta = empty_model(tiny_target_config("llama"), torch.bfloat16)
    assert plan_device_map(meta, [80 * GB], torch.bfloat16) == {"": 0}


def test_gpt_oss_120b_spreads_over_every_gpu_in_layer_order():
    """The real gpt-oss-120b shape (build/archs/gpt-oss-120b.json) in bf16, experts dequantized:
    ~234 GB, more than 2 H100s hold, spread over 8 of them."""
    import json

    from transformers import AutoConfig

    from dflash_trt.engine.archs import known_archs_dir

    raw = json.loads((known_archs_dir() / "gpt-oss-120b.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("_source", "quantization_config")}
    meta = empty_model(AutoConfig.for_model(raw.pop("model_type"), **raw), torch.bfloat16)
    total = _module_bytes(meta, "")
    assert 230 * GB < total < 240 * GB
    free = [79 * GB] * 8  # what an 80 GB H100 reports free
    dmap = plan_device_map(meta, free, torch.bfloat16)
    assert set(dmap.values()) == set(range(8))  # every visible GPU holds a share
    layers = [(i, dev) for k, dev in dmap.items() if (i := _layer_index(k)) >= 0]
    assert sorted(i for i, _ in layers) == list(range(36))  # no layer split or dropped
    assert [dev for _, dev in sorted(layers)] == sorted(dev for _, dev in layers)  # in order, GPU by GPU
    for gpu in range(8):  # and nothing beyond what leaves room for activations
        held = sum(_module_bytes(meta, k) for k, d in dmap.items() if d == gpu)
        assert held <= usable_bytes(free[gpu])
    assert dmap["model.embed_tokens"] == 0 and dmap["lm_head"] == 7
    for name, _ in meta.named_parameters():
        assert isinstance(device_of(dmap, name), int)
    with pytest.raises(DFlashError, match=r"needs 23\d\.\d GB of GPU memory in bfloat16 but the 2 visible GPU"):
        plan_device_map(meta, [79 * GB] * 2, torch.bfloat16)


def test_uneven_gpus_get_uneven_shares(monkeypatch):
    import dflash_trt.engine.devices as devices
    from dflash_trt.runtime.tiny import tiny_target_config

    cfg = tiny_target_config("llama", hidden_size=512, num_layers=16, intermediate_size=2048, vocab_size=8000)
    meta = empty_model(cfg, torch.bfloat16)
    total = _module_bytes(meta, "")
    # a 50 MB model against a 2 GB minimum headroom sized for real GPUs: no minimum in this test
    monkeypatch.setattr(devices, "GPU_HEADROOM_MIN_BYTES", 0)
    free = [int(total * 0.8), int(total * 0.5)]
    dmap = plan_device_map(meta, free, torch.bfloat16)
    held = [sum(_module_bytes(meta, k) for k, d in dmap.items() if d == g) for g in (0, 1)]
    assert held[0] + held[1] == total and held[0] > held[1] > 0
    assert all(h <= usable_bytes(f) for h, f in zip(held, free))


def test_build_device_cuda_without_a_gpu_is_one_line(tiny_pair_dirs, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    tdir, ddir = tiny_pair_dirs
    r = CliRunner().invoke(main, ["build", "--target", str(tdir), "--draft", str(ddir), "--max-seq-len", "256",
                                  "--quant", "fp8", "--device", "cuda", "--out", str(tmp_path / "e"), "--no-progress"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --device cuda but no CUDA GPU is visible")
    assert not (tmp_path / "e").exists()
