"""How an engine speculates on the node: the draft-length schedule, sampled verification, the
acceptance-rate floor and DFlash2, through `build` -> llm_api_options.yaml / launch scripts ->
manifest -> `verify` and `doctor` (issues 43 and 44).

TensorRT-LLM, vLLM's GPU runners and SGLang cannot run here. What they accept is recorded as data
with its source and version: tests/upstream/tensorrt_llm_speculation.json (DFlashDecodingConfig
1.3.0rc27 fields, DecodingBaseConfig's draft_len_schedule rules, FA4, the DFlash2 capability
probe), tests/upstream/peers_speculation.json (vLLM 0.32's num_speculative_tokens_per_batch_size
and its carry-forward lookup, draft_sample_method, DFlash2 on Model Runner V2; SGLang 0.5.23's
EAGLE-only adaptive drafting and its DFlash2 block). The engines are built by the real builder
from tiny random pairs (tests/conftest.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_trt.deploy.doctor import _TRTLLM_PROBE, Environment, GpuInfo, engine_findings
from dflash_trt.engine.builder import build_engine, prepare
from dflash_trt.engine.llm_api import FORBIDDEN_KEYS, check_llm_api_options
from dflash_trt.engine.manifest import MANIFEST_NAME, load_manifest
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.trtllm_versions import min_version, requirements, table
from dflash_trt.engine.verify import verify_engine
from dflash_trt.errors import DFlashError

UPSTREAM = Path(__file__).parent / "upstream"
TRT = json.loads((UPSTREAM / "tensorrt_llm_speculation.json").read_text())
PEERS = json.loads((UPSTREAM / "peers_speculation.json").read_text())
LAUNCH_FLAGS = json.loads((Path(__file__).resolve().parents[1] / "dflash_trt/engine/launch_flags.json").read_text())
DFLASH_FIRST = table()["fields"]["speculative_config.decoding_type"]["values"]["DFlash"]


def _build(out: Path, target: Path, draft: Path, **over) -> Path:
    spec = resolve_spec(None, {"target": str(target), "draft": str(draft), "gpu": "h100", "max_seq_len": 256, **over})
    return build_engine(prepare(spec), out, progress=False)


def _yaml(engine: Path) -> dict:
    return yaml.safe_load((engine / "llm_api_options.yaml").read_text())


def _argv(script: str) -> list[str]:
    return shlex.split(next(ln for ln in script.splitlines() if ln.startswith("exec ")))[1:]


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        yield f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")


def _upstream_lookup(schedule: dict[int, int], batch: int) -> int:
    """TensorRT-LLM's rule as recorded: the value of the smallest key >= batch, 0 above the largest."""
    return next((k for b, k in sorted(schedule.items()) if batch <= b), 0)


def _vllm_lookup(ranges: list[list[int]], max_num_seqs: int, num_tokens: int) -> list[int]:
    """vLLM's dense lookup as recorded (peers_speculation.json): min(num_tokens, n) per inclusive range,
    gaps and the tail carry the previous n forward; index = batch size."""
    rules = PEERS["vllm"]["num_speculative_tokens_per_batch_size"]
    assert rules["first_range_start"] == ranges[0][0] == 1 and rules["tail_rule"] == "carry_last"
    dense, last = [0] * (max_num_seqs + 1), None
    for start, end, n in ranges:
        for b in range(start, min(end, max_num_seqs) + 1):
            dense[b] = min(num_tokens, n)
        last = n
        nxt = end + 1
    for b in range(nxt, max_num_seqs + 1):
        dense[b] = min(num_tokens, last)
    return dense


# -- the schedule through the builder -----------------------------------------------------------

@pytest.fixture(scope="module")
def derived_engine(tiny_pair_dirs, tmp_path_factory) -> Path:
    """An h100 engine whose schedule is derived from a given acceptance profile (no gate). The tiny
    target's step costs the same at every batch and k (launch costs), so it drafts K everywhere."""
    t, d = tiny_pair_dirs
    return _build(tmp_path_factory.mktemp("derived") / "e", t, d, acceptance_profile="0.8,0.6,0.45,0.3,0.2,0.1,0.05",
                  max_batch_size=64)


def test_a_derived_schedule_that_drafts_k_at_every_batch_is_recorded_not_written(derived_engine):
    """{max_batch_size: K} is what no schedule does: writing it would only raise the minimum release."""
    opts, m = _yaml(derived_engine), load_manifest(derived_engine)
    sc = opts["speculative_config"]
    K = sc["max_draft_len"]
    model = m.speculation.model
    assert [b["k"] for b in model["buckets"]] == [K] * len(model["buckets"])  # the model's verdict
    assert model["buckets"][-1]["batch"] == m.limits.max_batch_size == 64
    assert "draft_len_schedule" not in sc and m.speculation.draft_len_schedule is None
    assert m.speculation.source == "derived" and m.draft_len_schedule() is None
    assert any("no draft_len_schedule is written" in n for n in m.speculation.notes)
    assert model["acceptance"]["source"].startswith("--acceptance-profile 0.8,0.6")
    assert model["gpu"]["name"] == "h100" and model["gpu"]["peak_tflops"]["bf16"] > 0
    assert m.limits.max_draft_len == K == m.speculation.max_draft_len
    assert m.min_tensorrt_llm_version == min_version(opts)
    assert "speculative_config.draft_len_schedule" not in requirements(opts)  # the minimum is not raised by it
    assert "num_speculative_tokens_per_batch_size" not in (derived_engine / "launch/vllm.sh").read_text()
    verify_engine(derived_engine)


TRT_FIRST_SCHEDULE = table()["fields"]["speculative_config.draft_len_schedule"]["first_version"]


@pytest.mark.parametrize("pair", ["random", "rigged"])
def test_the_gate_measures_the_acceptance_the_schedule_is_derived_from(pair, request, tmp_path):
    """The derived schedule reads the gate's per-position acceptance: a random drafter's drafts are
    (almost) never accepted, drafting cannot pay and K drops to 1; a pair rigged to be accepted
    (tests/conftest.py save_rigged_pair) drafts K at every batch size (no schedule written)."""
    t, d = request.getfixturevalue("tiny_pair_dirs" if pair == "random" else "rigged_pair_dirs")
    engine = _build(tmp_path / "e", t, d, **{"gate.enabled": True, "gate.num_prompts": 2, "gate.max_new_tokens": 12,
                                             "gate.min_tau": 1.0})
    m = load_manifest(engine)
    before = m.acceptance["before"]
    assert len(before["per_position_acceptance"]) == len(before["position_drafted"]) == 7
    model = m.speculation.model
    assert model["acceptance"]["source"].startswith("acceptance gate: 2 prompts x 12 tokens")
    measured = model["acceptance"]["per_position_acceptance"]
    assert 0 < len(measured) <= 7 and measured == before["per_position_acceptance"][: len(measured)]
    if pair == "random":
        # a random drafter's drafts are (almost) never accepted: drafting cannot pay, K drops to 1; the
        # model would draft 0 above batch 1, TensorRT-LLM's floor drafts 1 there: 1 everywhere, no schedule
        assert max(before["per_position_acceptance"]) < 0.05
        assert m.speculation.draft_len_schedule is None and m.limits.max_draft_len == 1
        assert m.speculation.floor["before"] == {"1": 1} and m.speculation.floor["zero_batches"] == [[2, 8]]
        assert any("drafting loses to plain decoding" in n for n in m.speculation.notes)
    else:
        assert min(before["per_position_acceptance"]) > 0.5
        assert [b["k"] for b in model["buckets"]] == [7] * len(model["buckets"])
        assert m.speculation.draft_len_schedule is None and m.limits.max_draft_len == 7
        assert any("no draft_len_schedule is written" in n for n in m.speculation.notes)


def test_off_writes_no_schedule_and_keeps_the_first_dflash_release(tiny_pair_dirs, tmp_path):
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="off", tensorrt_llm_release=DFLASH_FIRST)
    opts, m = _yaml(engine), load_manifest(engine)
    assert "draft_len_schedule" not in opts["speculative_config"] and m.speculation.draft_len_schedule is None
    assert opts["speculative_config"]["max_draft_len"] == 7 == m.limits.max_draft_len  # B - 1, untouched
    assert m.min_tensorrt_llm_version == DFLASH_FIRST == m.tensorrt_llm_release
    assert "num_speculative_tokens_per_batch_size" not in (engine / "launch/vllm.sh").read_text()


def test_a_given_schedule_reaches_trtllm_vllm_and_sglang_alike(tiny_pair_dirs, tmp_path):
    """2:5,4:3 on an engine serving 8: TensorRT-LLM would draft 0 at 5-8, so its schedule is floored
    at 1 there (PR 16888); vLLM 0.33 keeps DFlash's context at 0 drafts, so its ranges keep the 0."""
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="2:5,4:3")
    opts, m = _yaml(engine), load_manifest(engine)
    schedule = opts["speculative_config"]["draft_len_schedule"]
    assert schedule == {2: 5, 4: 3, 8: 1} and all(type(b) is int and type(k) is int for b, k in schedule.items())
    assert "draft_len_schedule: {2: 5, 4: 3, 8: 1}" in (engine / "llm_api_options.yaml").read_text()  # int keys
    assert opts["speculative_config"]["max_draft_len"] == m.limits.max_draft_len == 5  # K follows the smallest key
    assert m.speculation.source == "given" and m.speculation.draft_len_schedule == schedule
    assert m.speculation.floor["before"] == {"2": 5, "4": 3} and m.speculation.floor["zero_batches"] == [[5, 8]]
    assert m.draft_len_schedule().to_mapping() == schedule
    assert m.min_tensorrt_llm_version == min_version(opts) and "speculative_config.draft_len_schedule" in requirements(opts)
    verify_engine(engine)
    max_num_seqs = m.limits.max_batch_size
    assert [_upstream_lookup(schedule, b) for b in range(1, max_num_seqs + 1)] == [5, 5, 3, 3, 1, 1, 1, 1]
    vllm = (engine / "launch/vllm.sh").read_text()
    argv = _argv(vllm)
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert set(cfg) <= set(LAUNCH_FLAGS["vllm"]["speculative_config_keys"])
    assert int(argv[argv.index("--max-num-seqs") + 1]) == max_num_seqs
    dense = _vllm_lookup(cfg["num_speculative_tokens_per_batch_size"], max_num_seqs, cfg["num_speculative_tokens"])
    # vLLM drafts the schedule before the floor: 0 at 5-8, where its DFlash context is kept anyway
    assert dense[1:] == [_upstream_lookup({2: 5, 4: 3}, b) for b in range(1, max_num_seqs + 1)]
    assert PEERS["vllm_0_33"]["zero_range"]["keeps_dflash_context"] is True
    assert "A 0 range is safe here" in vllm
    sgl = (engine / "launch/sglang.sh").read_text()
    assert "no per-batch-size draft length for DFLASH" in sgl and "{2: 5, 4: 3, 8: 1}" in sgl
    assert PEERS["sglang"]["dflash_batch_size_schedule"] is False and LAUNCH_FLAGS["sglang"]["dflash_batch_size_schedule"] is None
    for script in ("launch/vllm.sh", "launch/sglang.sh"):
        subprocess.run(["bash", "-n", str(engine / script)], check=True, timeout=30)


@pytest.mark.parametrize("over, match", [
    ({"draft_len_schedule": "2:5,4:3", "max_draft_len": 7}, "must map to max_draft_len=7"),
    ({"draft_len_schedule": "2:9"}, r"must lie in 1\.\.7"),
    ({"acceptance_rate_window": 32}, "come together"),
    ({"acceptance_profile": "0.2,0.5"}, "cannot rise"),
])
def test_schedule_settings_that_cannot_be_written_are_refused_before_any_work(tiny_pair_dirs, over, match):
    t, d = tiny_pair_dirs
    with pytest.raises(DFlashError, match=match) as e:
        prepare(resolve_spec(None, {"target": str(t), "draft": str(d), "gpu": "h100", "max_seq_len": 256, **over}))
    assert "\n" not in str(e.value)


def test_rejection_sampling_and_the_acceptance_floor_are_written_only_when_asked(tiny_pair_dirs, tmp_path):
    t, d = tiny_pair_dirs
    plain = _build(tmp_path / "plain", t, d, draft_len_schedule="off")
    assert not {"use_rejection_sampling", "acceptance_rate_window_size", "acceptance_rate_threshold"} & set(
        _yaml(plain)["speculative_config"])
    assert "draft_sample_method" not in (plain / "launch/vllm.sh").read_text()
    asked = _build(tmp_path / "asked", t, d, draft_len_schedule="off", rejection_sampling=True,
                   acceptance_rate_window=64, acceptance_rate_threshold=0.25)
    sc, m = _yaml(asked)["speculative_config"], load_manifest(asked)
    assert (sc["use_rejection_sampling"], sc["acceptance_rate_window_size"], sc["acceptance_rate_threshold"]) == (
        True, 64, 0.25)
    need = requirements(_yaml(asked))
    fields = table()["fields"]
    assert need["speculative_config.use_rejection_sampling"] == fields["speculative_config.use_rejection_sampling"][
        "first_version"]
    assert m.min_tensorrt_llm_version == max(fields["speculative_config.use_rejection_sampling"]["first_version"],
                                             fields["speculative_config.acceptance_rate_window_size"]["first_version"])
    assert (m.speculation.rejection_sampling, m.speculation.acceptance_rate_window) == (True, 64)
    argv = _argv((asked / "launch/vllm.sh").read_text())
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert cfg["draft_sample_method"] == "probabilistic" in PEERS["vllm"]["draft_sample_method"]["values"]
    assert "no such floor" in (asked / "launch/vllm.sh").read_text()
    verify_engine(asked)


def test_new_fields_have_a_recorded_first_release_that_lists_them():
    fields = table()["fields"]
    rc27 = set(TRT["DFlashDecodingConfig_1.3.0rc27"]["fields"])
    for key in ("draft_len_schedule", "use_rejection_sampling", "acceptance_rate_window_size",
                "acceptance_rate_threshold", "max_concurrency"):
        entry = fields[f"speculative_config.{key}"]
        assert key in rc27 and entry["first_version"] == "1.3.0rc27", key
    assert fields["speculative_config.use_rejection_sampling"]["default"] is False
    assert fields["speculative_config.attention_backend"]["values"]["FA4"] == "1.3.0rc27"
    assert set(TRT["DFlashDecodingConfig_1.3.0rc27"]["attention_backend"]) == set(
        fields["speculative_config.attention_backend"]["values"])
    # a schedule is one value: its batch sizes are not keys of the file
    needs = requirements({"speculative_config": {"decoding_type": "DFlash", "draft_len_schedule": {4: 7, 16: 3}}})
    assert not [k for k in needs if k.startswith("speculative_config.draft_len_schedule.")]


# -- what verify checks -------------------------------------------------------------------------

def _opts(max_batch_size: int = 16, **spec_over) -> dict:
    sc = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "./draft", **spec_over}
    return {"max_batch_size": max_batch_size, "speculative_config": sc}


@pytest.mark.parametrize("spec_over, match", [
    ({"draft_len_schedule": {"4": 7}}, "must map int batch sizes"),
    ({"draft_len_schedule": {4: 5, 16: 3}}, "must map to max_draft_len=7"),
    ({"draft_len_schedule": {4: 7, 16: 9}}, "exceed max_draft_len=7"),
    ({"max_concurrency": 8}, "max_concurrency must not be written: TensorRT-LLM implements max_concurrency as a "
                             "draft_len_schedule that drafts 0 above it"),
    ({"draft_len_schedule": {4: 7, 8: 3}}, r"drafts 0 at batch sizes 9-16 \(max_batch_size 16\).*PR 16888.*"
                                           r"floors the schedule at 1 up to max_batch_size \(\{4: 7, 8: 3, 16: 1\}\)"),
    ({"draft_len_schedule": {4: 7, 8: 0, 16: 3}}, "drafts 0 at batch sizes 5-8 "),
    ({"moe_backend": "CUTLASS"}, "DFlash drafters are dense"),
    ({"acceptance_rate_window_size": 16}, "only one of"),
    ({"acceptance_rate_window_size": 16, "acceptance_rate_threshold": 1.5}, "threshold in \\[0, 1\\]"),
    ({"spec_dec_variant": 3}, "must not be written"),
])
def test_the_yaml_check_applies_upstreams_speculation_rules(spec_over, match):
    with pytest.raises(DFlashError, match=match) as e:
        check_llm_api_options(_opts(**spec_over))
    assert "\n" not in str(e.value)
    check_llm_api_options(_opts(draft_len_schedule={4: 7, 16: 3}, acceptance_rate_window_size=16,
                                acceptance_rate_threshold=0.3))


@pytest.mark.parametrize("section, key, value, match", [
    ("speculation", "draft_len_schedule", {"1": 3}, "speculation.draft_len_schedule"),
    ("speculation", "rejection_sampling", True, "speculation.rejection_sampling"),
    ("speculation", "max_draft_len", 2, "speculation.max_draft_len"),
    ("draft", "family", "dflash2", "draft.family"),
])
def test_verify_refuses_a_manifest_whose_speculation_differs_from_the_files(derived_engine, tmp_path, section, key,
                                                                            value, match):
    import shutil

    engine = tmp_path / "e"
    shutil.copytree(derived_engine, engine)
    path = engine / MANIFEST_NAME
    data = json.loads(path.read_text())
    data[section][key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(DFlashError, match=match) as e:
        verify_engine(engine)
    assert "\n" not in str(e.value)


# -- DFlash2 on the node ------------------------------------------------------------------------

def _dflash2_drafter(root: Path, target_config, **cfg_over) -> Path:
    """A DFlash2 drafter in z-lab's released layout with non-causal sliding layers (as the released
    Qwen3.8 DFlash2 ones)."""
    from dflash_trt.runtime.drafters.dflash2 import DFlash2DraftModel
    from dflash_trt.runtime.drafters.dflash import make_draft_config
    from dflash_trt.runtime.tiny import TINY_DFLASH2_RECIPE

    cfg = make_draft_config(target_config, dflash_fields={**TINY_DFLASH2_RECIPE, "block_size": 8})
    cfg.update(architectures=["DFlash2DraftModel"], layer_types=["sliding_attention"], sliding_window=64,
               use_sliding_window=True, is_causal=False, **cfg_over)
    del cfg["block_size"]
    model = DFlash2DraftModel(cfg)
    model.reset_parameters(seed=0)
    model.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def dflash2_pair(tiny_pair_dirs, tmp_path_factory) -> tuple[Path, Path]:
    from transformers import AutoConfig

    t, _ = tiny_pair_dirs
    return t, _dflash2_drafter(tmp_path_factory.mktemp("d2") / "draft", AutoConfig.from_pretrained(t))


def test_a_dflash2_engine_is_decoding_type_dflash_with_vanilla_attention_and_no_variant(dflash2_pair, tmp_path):
    t, d = dflash2_pair
    engine = _build(tmp_path / "e", t, d, gpu="b300")  # Blackwell would default to TRTLLM attention
    opts, m = _yaml(engine), load_manifest(engine)
    sc = opts["speculative_config"]
    assert sc["decoding_type"] == TRT["DFlash2"]["decoding_type"] == "DFlash"
    assert not any(k.endswith("spec_dec_variant") for k in _walk(opts))  # never written (the guard below)
    assert sc.get("attention_backend", "VANILLA") == "VANILLA"  # upstream's default: left out
    assert m.draft.family == "dflash2"
    vllm = (engine / "launch/vllm.sh").read_text()
    assert f"export {PEERS['vllm']['dflash2_needs_model_runner_v2']['env']}=1" in vllm
    cfg = json.loads(_argv(vllm)[_argv(vllm).index("--speculative-config") + 1])
    assert cfg["num_speculative_tokens"] == 7  # block_size - 1: the conv's block in vLLM
    assert set(cfg) <= set(LAUNCH_FLAGS["vllm"]["speculative_config_keys"])
    assert LAUNCH_FLAGS["vllm"]["env"] == [PEERS["vllm"]["dflash2_needs_model_runner_v2"]["env"]]
    sgl = (engine / "launch/sglang.sh").read_text()
    assert "DFlash2DraftModel" in sgl and "--speculative-num-draft-tokens 8" in sgl  # the trained block
    verify_engine(engine)


def test_a_dflash2_engine_below_its_block_drafts_its_k_on_vllm_at_every_batch(dflash2_pair, tmp_path):
    """vLLM's DFlash2 convolution runs on 1 + num_speculative_tokens slots, so the script keeps the
    trained block there and hands the engine's lower K over as a per-batch-size range."""
    t, d = dflash2_pair
    engine = _build(tmp_path / "e", t, d, max_draft_len=3, draft_len_schedule="off")
    assert _yaml(engine)["speculative_config"]["max_draft_len"] == 3
    vllm = (engine / "launch/vllm.sh").read_text()
    argv = _argv(vllm)
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    max_num_seqs = int(argv[argv.index("--max-num-seqs") + 1])
    assert cfg["num_speculative_tokens"] == 7
    dense = _vllm_lookup(cfg["num_speculative_tokens_per_batch_size"], max_num_seqs, cfg["num_speculative_tokens"])
    assert dense[1:] == [3] * max_num_seqs
    assert "max_draft_len 3 at every batch size" in vllm and "draft_len_schedule" not in vllm
    assert "--speculative-num-draft-tokens 8" in (engine / "launch/sglang.sh").read_text()


@pytest.mark.parametrize("gpu, backend, match", [
    ("b300", "TRTLLM", "refuses drafters with non-causal sliding-window layers"),
    ("b300", "FA4", "FA4 runs on SM90"),
])
def test_attention_backends_that_refuse_such_a_drafter_are_refused_in_one_line(dflash2_pair, gpu, backend, match):
    t, d = dflash2_pair
    with pytest.raises(DFlashError, match=match) as e:
        prepare(resolve_spec(None, {"target": str(t), "draft": str(d), "gpu": gpu,
                                    "max_seq_len": 256, "dflash_attention_backend": backend}))
    assert "\n" not in str(e.value)
    assert TRT["DFlash2"]["non_causal_sliding"].startswith("PR 19159 rejects attention_backend TRTLLM")


def test_fa4_is_written_for_such_a_drafter_on_hopper(dflash2_pair, tmp_path):
    t, d = dflash2_pair
    engine = _build(tmp_path / "e", t, d, gpu="h200", dflash_attention_backend="FA4")
    assert _yaml(engine)["speculative_config"]["attention_backend"] == "FA4" in TRT["FA4"]["backends"]
    assert load_manifest(engine).min_tensorrt_llm_version == table()["fields"][
        "speculative_config.attention_backend"]["values"]["FA4"]


def test_spec_dec_variant_is_refused_with_the_reason_not_as_an_unknown_key():
    assert "spec_dec_variant" in TRT["DFlashDecodingConfig_1.4.0rc1"]["adds"]  # a real upstream field...
    why = FORBIDDEN_KEYS[("speculative_config", "spec_dec_variant")]
    with pytest.raises(DFlashError) as e:  # ...that DFlash2 does not use: the check says why
        check_llm_api_options(_opts(spec_dec_variant=3))
    assert why.split(";")[0][:60] in str(e.value) and "unknown key" not in str(e.value)


@pytest.mark.parametrize("how, match", [("vocab_file", "draft_vocab.json beside a DFlash2 drafter"),
                                        ("draft_vocab_size", "draft_vocab_size=64 below vocab_size"),
                                        ("d2t", "weights hold d2t")])
def test_a_dflash2_drafter_with_a_reduced_vocabulary_is_refused(tiny_pair_dirs, tmp_path, how, match):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    t, _ = tiny_pair_dirs
    d = _dflash2_drafter(tmp_path / "draft", AutoConfig.from_pretrained(t))
    if how == "vocab_file":
        (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 2, 3]}))
    elif how == "draft_vocab_size":
        cfg = json.loads((d / "config.json").read_text())
        cfg["draft_vocab_size"] = 64
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        import torch

        state = load_file(str(d / "model.safetensors"))
        save_file({**state, "d2t": torch.zeros(4, dtype=torch.long)}, str(d / "model.safetensors"))
    with pytest.raises(DFlashError, match=match) as e:
        prepare(resolve_spec(None, {"target": str(t), "draft": str(d), "gpu": "h100", "max_seq_len": 256}))
    assert "\n" not in str(e.value)
    assert "NotImplementedError" in str(e.value)  # what TensorRT-LLM would raise, said before the build


# -- doctor: does the node's TensorRT-LLM have DFlash2? -----------------------------------------

H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559, (9, 0))


def _env(dflash2: bool | None, **over) -> Environment:
    base = dict(python="3.12.3", torch="2.9.0", tensorrt_llm="1.4.0rc1",
                dflash_fields=TRT["DFlashDecodingConfig_1.3.0rc27"]["fields"],
                dflash_attention_backends=TRT["DFlashDecodingConfig_1.3.0rc27"]["attention_backend"],
                llm_args_fields=None, gpus=[H100], flash_attn="2.8.3", flashinfer="0.6.4", flash_attn_cute=True,
                dflash2=dflash2)
    return Environment(**{**base, **over})


def test_doctor_refuses_a_dflash2_engine_where_tensorrt_llm_has_no_dflash2(dflash2_pair, tmp_path):
    t, d = dflash2_pair
    engine = _build(tmp_path / "e", t, d)
    m, opts = load_manifest(engine), _yaml(engine)
    missing = [f for f in engine_findings(_env(False), m, opts, "trtllm") if not f.ok]
    assert len(missing) == 1 and "DFlash2CandidateSelector" in missing[0].line() and "; fix: " in missing[0].line()
    assert all(f.ok for f in engine_findings(_env(True), m, opts, "trtllm"))
    # a DFlash v1 engine does not need it
    v1 = m.model_copy(update={"draft": m.draft.model_copy(update={"family": "dflash"})})
    assert all(f.ok for f in engine_findings(_env(False), v1, opts, "trtllm"))


def test_doctor_checks_what_fa4_loads(tmp_path):
    """FA4 imports flash_attn.cute and FlashInfer's paged append and runs on SM90 only
    (tensorrt_llm_speculation.json FA4)."""
    from dflash_trt.deploy.doctor import load_engine
    from dflash_trt.engine.llm_api import llm_api_options
    from tests.deploy_engines import manifest_engine

    spec = resolve_spec(None, {"gpu": "h100", "dflash_attention_backend": "FA4"})
    opts = llm_api_options(spec, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1,
                           target_layer_ids=[1])
    m, _ = load_engine(manifest_engine(tmp_path / "e", 1, 1))
    m = m.model_copy(update={"gpu": "h100", "quantization": m.quantization.model_copy(
        update={"weights": "none", "kv_cache": "none"})})
    ok = [f for f in engine_findings(_env(True, flash_attn_cute=True), m, opts, "trtllm") if "is FA4" in f.what]
    assert len(ok) == 1 and ok[0].ok
    b200 = GpuInfo(0, "NVIDIA B200", 183359, (10, 0))
    bad = [f for f in engine_findings(_env(True, flash_attn_cute=False, gpus=[b200]), m, opts, "trtllm")
           if "is FA4" in f.what]
    assert not bad[0].ok and "flash_attn.cute not importable" in bad[0].what and "sm_100" in bad[0].what
    assert tuple(TRT["FA4"]["sm"]) == (9, 0)


def _stand_in_tensorrt_llm(root: Path, with_dflash2: bool) -> Path:
    """A package named tensorrt_llm holding only the names the probe reads (recorded upstream:
    DFlashDecodingConfig's 1.3.0rc27 fields, modeling_dflash's DFlash2CandidateSelector)."""
    pkg = root / "tensorrt_llm"
    (pkg / "llmapi").mkdir(parents=True)
    (pkg / "_torch" / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "1.4.0rc1"\n')
    (pkg / "_torch" / "__init__.py").write_text("")
    (pkg / "_torch" / "models" / "__init__.py").write_text("")
    fields = TRT["DFlashDecodingConfig_1.3.0rc27"]["fields"]
    (pkg / "llmapi" / "__init__.py").write_text("")
    # PR 16888's floor as its tests show it: a min_runtime_draft_len property of the decoding config
    floor = TRT["draft_len_schedule_floor"]["capability_probe"]["attribute"]
    (pkg / "llmapi" / "llm_args.py").write_text(
        "import typing\nclass _F:\n    def __init__(self, a=None): self.annotation = a\n"
        f"class DFlashDecodingConfig:\n    model_fields = {{k: _F() for k in {fields!r}}}\n"
        "    model_fields['attention_backend'] = _F(typing.Literal['VANILLA', 'TRTLLM', 'FA4'])\n"
        + (f"    @property\n    def {floor}(self): return 1\n" if with_dflash2 else "")
        + "class TorchLlmArgs:\n    model_fields = {'speculative_config': None}\n")
    probe = TRT["DFlash2"]["capability_probe"]
    assert probe["module"] == "tensorrt_llm._torch.models.modeling_dflash"
    (pkg / "_torch" / "models" / "modeling_dflash.py").write_text(
        f"class {probe['attribute']}: pass\n" if with_dflash2 else "class DFlashForCausalLM: pass\n")
    # SpeculativeDecodingMode as recorded: DFLASH in the enum, support_dynamic_draft_len() with or
    # without is_dflash() (tensorrt_llm_speculation.json support_dynamic_draft_len)
    dyn = TRT["support_dynamic_draft_len"]["capability_probe"]
    overlap = TRT["support_overlap_scheduler"]["capability_probe"]
    assert (overlap["module"], overlap["enum"], overlap["member"]) == (dyn["module"], dyn["enum"], dyn["member"])
    (pkg / "_torch" / "speculative").mkdir()
    (pkg / "_torch" / "speculative" / "__init__.py").write_text("")
    supports = "self.is_eagle3_one_model() or self.is_dflash()" if with_dflash2 else "self.is_eagle3_one_model()"
    (pkg / "_torch" / "speculative" / f"{dyn['module'].rsplit('.', 1)[1]}.py").write_text(
        f"from enum import IntEnum, auto\nclass {dyn['enum']}(IntEnum):\n    EAGLE3_ONE_MODEL = auto()\n"
        f"    {dyn['member']} = auto()\n    def is_eagle3_one_model(self): return self.name == 'EAGLE3_ONE_MODEL'\n"
        f"    def is_dflash(self): return self.name == 'DFLASH'\n    def {dyn['method']}(self): return {supports}\n"
        # support_overlap_scheduler() as recorded: DFLASH is an external (parallel-draft) drafter
        f"    def is_external_drafter(self): return self.is_dflash()\n"
        f"    def {overlap['method']}(self): return self.is_eagle3_one_model() or self.is_external_drafter()\n")
    dist = root / "tensorrt_llm-1.4.0rc1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.4.0rc1\n")
    return root


@pytest.mark.parametrize("with_dflash2", [True, False])
def test_the_dflash2_probe_reads_the_installed_module(tmp_path, monkeypatch, with_dflash2):
    """The real probe (a child process importing tensorrt_llm), against a stand-in package."""
    root = _stand_in_tensorrt_llm(tmp_path, with_dflash2)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", f"{root}:{Path(__file__).resolve().parents[1]}")
    from dflash_trt.deploy.doctor import _probe_trtllm

    env = Environment(python="3.11")
    _probe_trtllm(env)
    assert env.tensorrt_llm_error is None, env.tensorrt_llm_error
    assert env.dflash2 is with_dflash2 and "FA4" in env.dflash_attention_backends
    assert env.dflash_dynamic_draft_len is with_dflash2  # the newer release applies schedules to DFlash too
    assert env.dflash_overlap_scheduler is True  # DFlash overlaps in both
    assert env.dflash_zero_draft_safe is with_dflash2  # only the stand-in with PR 16888's property floors 0
    assert TRT["DFlash2"]["capability_probe"]["attribute"] in _TRTLLM_PROBE


def test_doctor_refuses_a_schedule_the_installed_dflash_would_skip(tiny_pair_dirs, tmp_path):
    """draft_len_schedule is a DecodingBaseConfig field older than DFlash, so every DFlash release
    lists it; releases whose SpeculativeDecodingMode.DFLASH.support_dynamic_draft_len() is False skip
    it without a word (tensorrt_llm_speculation.json support_dynamic_draft_len)."""
    assert "return None" in TRT["support_dynamic_draft_len"]["when_unsupported"]
    assert "DFLASH" in TRT["support_dynamic_draft_len"]["dflash_but_eagle3_only"]
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="2:5,4:3")
    m, opts = load_manifest(engine), _yaml(engine)
    v1 = m.model_copy(update={"draft": m.draft.model_copy(update={"family": "dflash"})})
    skipped = [f for f in engine_findings(_env(True, dflash_dynamic_draft_len=False), v1, opts, "trtllm") if not f.ok]
    assert len(skipped) == 1 and "would be ignored" in skipped[0].line()  # though 1.4.0rc1 >= the first release
    assert "--draft-len-schedule off" in skipped[0].line()
    assert all(f.ok for f in engine_findings(_env(True, dflash_dynamic_draft_len=True), v1, opts, "trtllm"))
    # not probed: the recorded first release decides; a probe that shows it applied waives the version
    assert all(f.ok for f in engine_findings(_env(True, dflash_dynamic_draft_len=None), v1, opts, "trtllm"))
    older = [f for f in engine_findings(_env(True, dflash_dynamic_draft_len=None, tensorrt_llm="1.3.0rc20"), v1,
                                        opts, "trtllm") if not f.ok]
    assert len(older) == 1 and "lacks speculative_config.draft_len_schedule" in older[0].what
    assert TRT_FIRST_SCHEDULE in older[0].what
    assert all(f.ok for f in engine_findings(_env(True, dflash_dynamic_draft_len=True, tensorrt_llm="1.3.0rc20"), v1,
                                             opts, "trtllm"))



# -- never a 0 draft length for TensorRT-LLM, the overlap scheduler, the 1.4 fields (issue 58) ----

def _zero_drafting(engine: Path) -> dict:
    """The engine's options as an older dflash-trt wrote them: a schedule drafting 0 above its largest key."""
    opts = _yaml(engine)
    opts["speculative_config"]["draft_len_schedule"] = {2: 5, 4: 3}  # max_batch_size 8: 5-8 draft 0
    return opts


def test_doctor_and_verify_name_an_engine_that_drafts_0_where_it_serves(tiny_pair_dirs, tmp_path):
    """PR 16888 (open, tensorrt_llm_speculation.json draft_len_schedule_floor): at 0 drafts a one-model
    DFlash worker stops refreshing its context buffers. Both commands refuse such options in one line
    with the fix; a release whose DFlashDecodingConfig has min_runtime_draft_len floors it itself."""
    assert TRT["draft_len_schedule_floor"]["capability_probe"]["attribute"] == "min_runtime_draft_len"
    assert table()["behaviours"]["dflash_zero_draft_len_safe"]["first_version"] is None  # no release has it
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="2:5,4:3")
    m, opts = load_manifest(engine), _zero_drafting(engine)
    v1 = m.model_copy(update={"draft": m.draft.model_copy(update={"family": "dflash"})})
    env = dict(dflash_dynamic_draft_len=True)
    bad = [f for f in engine_findings(_env(True, dflash_zero_draft_safe=False, **env), v1, opts, "trtllm") if not f.ok]
    assert len(bad) == 1 and "drafts 0 at batch sizes 5-8 (max_batch_size 8)" in bad[0].what
    assert bad[0].fix.startswith("rebuild the engine with this dflash-trt") and "{2: 5, 4: 3, 8: 1}" in bad[0].fix
    assert all(f.ok for f in engine_findings(_env(True, dflash_zero_draft_safe=True, **env), v1, opts, "trtllm"))
    # the floored options the build wrote are fine wherever
    assert all(f.ok for f in engine_findings(_env(True, dflash_zero_draft_safe=False, **env), v1, _yaml(engine),
                                             "trtllm"))
    # verify: the same refusal, one line
    (engine / "llm_api_options.yaml").write_text(yaml.safe_dump(opts))
    with pytest.raises(DFlashError, match=r"drafts 0 at batch sizes 5-8 .*rebuild the engine") as e:
        check_llm_api_options(opts)
    assert "\n" not in str(e.value)


def test_max_concurrency_is_read_as_the_schedule_upstream_makes_of_it():
    """{max_concurrency: max_draft_len} (draft_len_schedule_rules): 0 above it."""
    from dflash_trt.engine.trtllm_versions import zero_draft_batches

    assert "{max_concurrency: max_draft_len}" in TRT["draft_len_schedule_rules"]["max_concurrency"]
    opts = {"max_batch_size": 64, "speculative_config": {"max_draft_len": 7, "max_concurrency": 16}}
    assert zero_draft_batches(opts) == [(17, 64)]
    assert zero_draft_batches({"speculative_config": {"max_draft_len": 7, "draft_len_schedule": {4: 7}}}) == [
        (5, 2048)]  # max_batch_size left out: upstream's default
    assert zero_draft_batches({**opts, "speculative_config": {"max_draft_len": 7, "max_concurrency": 64}}) == []


def test_the_overlap_scheduler_is_never_turned_off(tiny_pair_dirs, tmp_path):
    """TensorRT-LLM: support_overlap_scheduler() covers DFlash (a parallel-draft, external-drafter mode);
    the file never sets disable_overlap_scheduler, verify refuses it set, doctor warns where the
    installed release turns it off. vLLM's async scheduling and SGLang's overlap stay at their
    defaults (peers_speculation.json)."""
    assert "is_external_drafter()" in TRT["support_overlap_scheduler"]["text"]
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, pp=2, gpus_per_node=2)
    opts, m = _yaml(engine), load_manifest(engine)
    assert "disable_overlap_scheduler" not in opts and table()["fields"]["disable_overlap_scheduler"]["default"] is False
    with pytest.raises(DFlashError, match="disable_overlap_scheduler: true turns off what one-model DFlash runs with"):
        check_llm_api_options({**opts, "disable_overlap_scheduler": True})
    check_llm_api_options({**opts, "disable_overlap_scheduler": False})  # upstream's default, harmless
    off = engine_findings(_env(True, dflash_overlap_scheduler=False, gpus=[H100] * 2), m, opts, "trtllm")
    warned = [f for f in off if f.warn]
    assert all(f.ok for f in off) and len(warned) == 1 and warned[0].line().startswith("WARN     ")
    assert "support_overlap_scheduler() is False" in warned[0].line() and "; fix: " in warned[0].line()
    assert not any(f.warn for f in engine_findings(_env(True, dflash_overlap_scheduler=True, gpus=[H100] * 2), m, opts,
                                                   "trtllm"))
    vllm, sgl = (engine / "launch/vllm.sh").read_text(), (engine / "launch/sglang.sh").read_text()
    async_flag = PEERS["vllm_0_33"]["async_scheduling"]["flag"]
    assert async_flag not in _argv(vllm) and "--no-" + async_flag[2:] not in _argv(vllm)
    assert "Async scheduling" in vllm and "off on Model Runner V1 with pipeline parallel" in vllm  # pp 2
    assert PEERS["sglang"]["overlap_schedule"]["default_on_for_dflash"] is True
    assert PEERS["sglang"]["overlap_schedule"]["flag"] not in sgl


def _measurement(tmp_path: Path, **over) -> Path:
    """A context_recompute_tail measurement in the agreed form, written for the test (not a real one)."""
    data = {"about": "test", "commit": "0000000", "command": "bench ...", "pair": "tiny", "interval_halfwidth": 0.05,
            "tau_by_tail": {"0": 2.1, "16": 2.6, "64": 2.9, "256": 3.0, "all": 3.0}, "recommended": 64,
            "why": "64 tokens recover tau within the interval", **over}
    path = tmp_path / "context_recompute_tail.json"
    path.write_text(json.dumps(data))
    return path


def test_context_recompute_tail_comes_from_the_measurement_on_releases_that_have_it(tmp_path):
    from dflash_trt.engine.llm_api import llm_api_options, speculative_fields
    from dflash_trt.engine.recompute_tail import MEASUREMENT_FILE, load_measurement

    tail_first = table()["fields"]["speculative_config.context_recompute_tail"]["first_version"]
    assert "context_recompute_tail" in TRT["DFlashDecodingConfig_1.4.0rc1"]["adds"] and tail_first == "1.4.0rc1"
    assert TRT["DFlashDecodingConfig_1.4.0rc1"]["types"]["context_recompute_tail"] == "int | None = 0"
    measured = load_measurement(_measurement(tmp_path))
    assert load_measurement(tmp_path / "absent.json") is None
    assert MEASUREMENT_FILE.name == "context_recompute_tail.json"

    def written(release: str, measurement, **over):
        spec = resolve_spec(None, {"gpu": "h100", "tensorrt_llm_release": release, **over})
        fields = speculative_fields(spec, release, head_dim=64, measurement=measurement)
        opts = llm_api_options(spec, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=1,
                               target_layer_ids=[1], release=release, fields=fields)
        why = next(f.why for f in fields if f.key == "context_recompute_tail")
        return opts["speculative_config"].get("context_recompute_tail"), why, min_version(opts)

    value, why, need = written(tail_first, measured)
    assert value == 64 and "measured on tiny at 0000000" in why and need == tail_first
    assert written("1.3.0rc27", measured)[:2] == (None, "TensorRT-LLM 1.3.0rc27 has no such field (first: 1.4.0rc1)")
    assert written(tail_first, None)[1].startswith("not measured")
    assert written(tail_first, load_measurement(_measurement(tmp_path, recommended=0)))[0] is None
    # where prefix caching is off there is no cache hit to recompute after
    from dflash_trt.engine.release_fields import release_fields

    off = release_fields(resolve_spec(None, {"gpu": "h100"}), tail_first, block_reuse=False, measurement=measured)
    assert next(f for f in off if f.key == "context_recompute_tail").value is None


@pytest.mark.parametrize("over, match", [
    ({"recommended": -1}, "recommended"),
    ({"tau_by_tail": {"0": 2.0, "16": 2.5}}, "exactly the tails"),
    ({"extra": 1}, "unknown key 'extra'"),
])
def test_a_bad_measurement_file_is_one_line(tmp_path, over, match):
    from dflash_trt.engine.recompute_tail import load_measurement

    with pytest.raises(DFlashError, match=match) as e:
        load_measurement(_measurement(tmp_path, **over))
    assert "\n" not in str(e.value)


def test_the_build_records_why_each_field_is_or_is_not_written(tiny_pair_dirs, tmp_path, monkeypatch):
    """The manifest's speculation.fields: each DFlashDecodingConfig field beyond the drafter's, with its
    reason; an engine for 1.4.0rc1 carries the measured tail, one for the container's release not."""
    from dflash_trt.engine import recompute_tail

    t, d = tiny_pair_dirs
    m = load_manifest(_build(tmp_path / "now", t, d))
    assert m.tensorrt_llm_release == "1.3.0rc27" and m.speculation.fields["context_recompute_tail"]["written"] is None
    assert m.speculation.fields["context_recompute_tail"]["why"].startswith("TensorRT-LLM 1.3.0rc27 has no such field")
    assert m.speculation.fields["attention_backend"]["written"] == "FA4"  # h100, a head_dim FA4 takes
    monkeypatch.setattr(recompute_tail, "MEASUREMENT_FILE", _measurement(tmp_path))
    engine = _build(tmp_path / "14", t, d, tensorrt_llm_release="1.4.0rc1")
    m = load_manifest(engine)
    assert _yaml(engine)["speculative_config"]["context_recompute_tail"] == 64
    assert m.speculation.fields["context_recompute_tail"]["written"] == 64 and m.tensorrt_llm_release == "1.4.0rc1"
    assert m.min_tensorrt_llm_version == "1.4.0rc1"
    assert {"moe_backend", "skip_ctx_buffer_budget_check", "spec_dec_variant"} <= set(m.speculation.fields)
    verify_engine(engine)


def test_fa4_is_chosen_only_for_a_head_dim_it_takes_on_sm90():
    from dflash_trt.engine.release_fields import dflash_attention_backend, fa4_takes

    lo, hi = TRT["FA4"]["head_dim_range"]
    assert [fa4_takes(h) for h in (lo - 8, lo, 100, 128, hi, hi + 8)] == [False, True, False, True, True, False]
    spec = resolve_spec(None, {"gpu": "h200"})
    assert dflash_attention_backend(spec, head_dim=128, release="1.3.0rc27") == "FA4"
    assert dflash_attention_backend(spec, head_dim=100, release="1.3.0rc27") == "VANILLA"
    assert dflash_attention_backend(spec, head_dim=128, release=DFLASH_FIRST) == "VANILLA"  # no FA4 there
    with pytest.raises(DFlashError, match="FA4 takes head_dim 8..256") as e:
        dflash_attention_backend(resolve_spec(None, {"gpu": "h200", "dflash_attention_backend": "FA4"}), head_dim=100)
    assert "\n" not in str(e.value)
