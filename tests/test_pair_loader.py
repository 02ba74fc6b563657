"""The one pair loader (dflash_trt/pairs.py load_pair): engines, checkpoints and tiny pairs through
one function, bad input refused before the weights are read, the runtime options applied.

Real files: a tiny engine directory (tests/engine_fixtures.py) and a tiny checkpoint pair."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.pairs import PairSource, load_pair
from dflash_trt.runtime.reference.generate import dflash_generate
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams

try:
    from tests.engine_fixtures import make_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import make_tiny_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("loader"), max_draft_len=5)


@pytest.mark.parametrize("source, needle", [
    (dict(engine="e", target="t", draft="d"), "--engine already holds the target and drafter"),
    (dict(tiny=True, target="t", draft="d"), "--tiny uses a random pair; drop --target/--draft"),
    (dict(target="t"), "pass both --target and --draft, or neither"),
])
def test_conflicting_sources_are_one_line(source, needle):
    with pytest.raises(DFlashError, match=needle):
        PairSource(**source)


def test_an_engine_loads_with_its_limits_its_k_and_its_tokenizer(engine):
    pair = load_pair(PairSource(engine=engine), max_draft_len=3, policy="adaptive")
    assert pair.manifest is not None and pair.tokenizer is not None
    assert (pair.speculation.max_draft_len, pair.speculation.policy) == (3, "adaptive")
    assert pair.codec.max_seq_len == pair.manifest.limits.max_seq_len == 256
    with pytest.raises(DFlashError, match="--max-draft-len 6 is above the 5 this engine was built for"):
        load_pair(PairSource(engine=engine), max_draft_len=6)


def test_an_engine_is_refused_before_its_weights_load(engine, tmp_path):
    bad = tmp_path / "engine"
    shutil.copytree(engine, bad)
    weights = next((bad / "target").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight: the file still reads, only its sha256 tells
    weights.write_bytes(bytes(data))
    with pytest.raises(DFlashError, match="--max-draft-len 9 is above"):  # K first: before any hash or weight
        load_pair(PairSource(engine=bad), max_draft_len=9)
    with pytest.raises(DFlashError, match=weights.name):  # the hashes name the altered file
        load_pair(PairSource(engine=bad))
    assert load_pair(PairSource(engine=bad, verify=False)).manifest is not None  # unchecked, it loads
    with pytest.raises(DFlashError, match="--device 'tpu:0': give cpu, cuda or cuda:N"):
        load_pair(PairSource(engine=bad), RuntimeOptions(device="tpu:0"))


def test_checkpoints_and_the_engine_give_the_same_pair(engine, tmp_path):
    """The engine's target is read by the engine's streaming reader, a checkpoint's by
    transformers: the same weights decode the same tokens."""
    from_engine = load_pair(PairSource(engine=engine))
    as_checkpoints = load_pair(PairSource(engine / "target", engine / "draft"))
    assert as_checkpoints.manifest is None and as_checkpoints.codec.max_seq_len is None
    assert as_checkpoints.speculation.max_draft_len == 7  # the drafter's B - 1: no manifest limits it
    params = SamplingParams(max_tokens=12)
    ids = from_engine.codec.encode("Hello world")
    spec = from_engine.speculation
    assert (dflash_generate(from_engine.draft, from_engine.target, ids, params, spec).output_ids
            == dflash_generate(as_checkpoints.draft, as_checkpoints.target, ids, params, spec).output_ids)


def test_the_drafter_is_validated_against_the_target_before_weights(engine, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(engine / "draft", draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    (draft / "model.safetensors").unlink()  # never read: the configs already disagree
    with pytest.raises(DFlashError, match="hidden_size"):
        load_pair(PairSource(engine / "target", draft))


def test_the_options_decide_dtype_upcast_and_device(engine):
    bf16 = load_pair(PairSource(engine=engine), RuntimeOptions(dtype="bfloat16", pack=False))
    assert {p.dtype for m in (bf16.target, bf16.draft) for p in m.parameters()} == {torch.bfloat16}
    run32 = load_pair(PairSource(engine=engine), RuntimeOptions(dtype="bfloat16", compute_dtype="float32", pack=False))
    assert {p.dtype for m in (run32.target, run32.draft) for p in m.parameters()} == {torch.float32}
    # the upcast is exact: the bf16 weights, widened
    first = next(run32.target.parameters())
    assert torch.equal(first, next(bf16.target.parameters()).float())
    meta = load_pair(PairSource(engine=engine), RuntimeOptions(device="meta"))
    assert {p.device.type for m in (meta.target, meta.draft) for p in m.parameters()} == {"meta"}


def test_a_tiny_pair_needs_no_files():
    pair = load_pair(PairSource(tiny=True), max_draft_len=2)
    assert pair.tokenizer is None and pair.manifest is None and pair.speculation.max_draft_len == 2
