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
    assert m.min_tensorrt_llm_version == min_version(opts) == DFLASH_FIRST
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
        assert max(before["per_position_acceptance"]) < 0.05
        assert m.speculation.draft_len_schedule == {1: 1} and m.limits.max_draft_len == 1
        assert any("drafting loses to plain decoding" in n for n in m.speculation.notes)
    else:
        assert min(before["per_position_acceptance"]) > 0.5
        assert [b["k"] for b in model["buckets"]] == [7] * len(model["buckets"])
        assert m.speculation.draft_len_schedule is None and m.limits.max_draft_len == 7
        assert any("no draft_len_schedule is written" in n for n in m.speculation.notes)


def test_off_writes_no_schedule_and_keeps_the_first_dflash_release(tiny_pair_dirs, tmp_path):
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="off")
    opts, m = _yaml(engine), load_manifest(engine)
    assert "draft_len_schedule" not in opts["speculative_config"] and m.speculation.draft_len_schedule is None
    assert opts["speculative_config"]["max_draft_len"] == 7 == m.limits.max_draft_len  # B - 1, untouched
    assert m.min_tensorrt_llm_version == DFLASH_FIRST
    assert "num_speculative_tokens_per_batch_size" not in (engine / "launch/vllm.sh").read_text()


def test_a_given_schedule_reaches_trtllm_vllm_and_sglang_alike(tiny_pair_dirs, tmp_path):
    t, d = tiny_pair_dirs
    engine = _build(tmp_path / "e", t, d, draft_len_schedule="2:5,4:3")
    opts, m = _yaml(engine), load_manifest(engine)
    schedule = opts["speculative_config"]["draft_len_schedule"]
    assert schedule == {2: 5, 4: 3} and all(type(b) is int and type(k) is int for b, k in schedule.items())
    assert "draft_len_schedule: {2: 5, 4: 3}" in (engine / "llm_api_options.yaml").read_text()  # int keys, unquoted
    assert opts["speculative_config"]["max_draft_len"] == m.limits.max_draft_len == 5  # K follows the smallest key
    assert m.speculation.source == "given" and m.speculation.draft_len_schedule == schedule
    assert m.draft_len_schedule().to_mapping() == schedule
    assert m.min_tensorrt_llm_version == min_version(opts) == TRT_FIRST_SCHEDULE
    verify_engine(engine)
    argv = _argv((engine / "launch/vllm.sh").read_text())
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert set(cfg) <= set(LAUNCH_FLAGS["vllm"]["speculative_config_keys"])
    max_num_seqs = int(argv[argv.index("--max-num-seqs") + 1])
    dense = _vllm_lookup(cfg["num_speculative_tokens_per_batch_size"], max_num_seqs, cfg["num_speculative_tokens"])
    # every batch size the engine serves drafts the same on vLLM as on TensorRT-LLM
    assert dense[1:] == [_upstream_lookup({2: 5, 4: 3}, b) for b in range(1, max_num_seqs + 1)]
    sgl = (engine / "launch/sglang.sh").read_text()
    assert "no per-batch-size draft length for DFLASH" in sgl and "{2: 5, 4: 3}" in sgl
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

def _opts(**spec_over) -> dict:
    sc = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "./draft", **spec_over}
    return {"speculative_config": sc}


@pytest.mark.parametrize("spec_over, match", [
    ({"draft_len_schedule": {"4": 7}}, "must map int batch sizes"),
    ({"draft_len_schedule": {4: 5, 16: 3}}, "must map to max_draft_len=7"),
    ({"draft_len_schedule": {4: 7, 16: 9}}, "exceed max_draft_len=7"),
    ({"draft_len_schedule": {4: 7}, "max_concurrency": 8}, "mutually exclusive"),
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
    from dflash_trt.runtime.dflash2 import DFlash2DraftModel
    from dflash_trt.runtime.draft_model import make_draft_config
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
                llm_args_fields=None, gpus=[H100], flash_attn="2.8.3", flashinfer="0.6.4", dflash2=dflash2)
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
    (pkg / "llmapi" / "llm_args.py").write_text(
        "import typing\nclass _F:\n    def __init__(self, a=None): self.annotation = a\n"
        f"class DFlashDecodingConfig:\n    model_fields = {{k: _F() for k in {fields!r}}}\n"
        "    model_fields['attention_backend'] = _F(typing.Literal['VANILLA', 'TRTLLM', 'FA4'])\n"
        "class TorchLlmArgs:\n    model_fields = {'speculative_config': None}\n")
    probe = TRT["DFlash2"]["capability_probe"]
    assert probe["module"] == "tensorrt_llm._torch.models.modeling_dflash"
    (pkg / "_torch" / "models" / "modeling_dflash.py").write_text(
        f"class {probe['attribute']}: pass\n" if with_dflash2 else "class DFlashForCausalLM: pass\n")
    # SpeculativeDecodingMode as recorded: DFLASH in the enum, support_dynamic_draft_len() with or
    # without is_dflash() (tensorrt_llm_speculation.json support_dynamic_draft_len)
    dyn = TRT["support_dynamic_draft_len"]["capability_probe"]
    (pkg / "_torch" / "speculative").mkdir()
    (pkg / "_torch" / "speculative" / "__init__.py").write_text("")
    supports = "self.is_eagle3_one_model() or self.is_dflash()" if with_dflash2 else "self.is_eagle3_one_model()"
    (pkg / "_torch" / "speculative" / f"{dyn['module'].rsplit('.', 1)[1]}.py").write_text(
        f"from enum import IntEnum, auto\nclass {dyn['enum']}(IntEnum):\n    EAGLE3_ONE_MODEL = auto()\n"
        f"    {dyn['member']} = auto()\n    def is_eagle3_one_model(self): return self.name == 'EAGLE3_ONE_MODEL'\n"
        f"    def is_dflash(self): return self.name == 'DFLASH'\n    def {dyn['method']}(self): return {supports}\n")
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

