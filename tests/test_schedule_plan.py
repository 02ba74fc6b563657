"""The engine's draft-length schedule (dflash_trt/engine/schedule_plan.py) and the acceptance profile
it is derived from (engine/acceptance_profile.py).

The rules it must keep are TensorRT-LLM's, recorded with their source in
tests/upstream/tensorrt_llm_speculation.json (llm_args.py DecodingBaseConfig: keys are inclusive
upper bounds, the smallest maps to max_draft_len, no value above it, 0 above the largest key). The
choice of k per bucket is checked against a brute-force search over the same cost model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from dflash_trt.draft_len_schedule import DraftLenSchedule
from dflash_trt.engine.acceptance_profile import DEFAULT_SOURCE, DEFAULT_TAU, AcceptanceProfile
from dflash_trt.engine.archs import resolve_arch
from dflash_trt.engine.plan import DraftShape
from dflash_trt.engine.schedule_plan import TOLERANCE, bucket_sizes, choose_k, compress, decide, derive
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.step_cost import ModelDims, step_cost
from dflash_trt.engine.trtllm_versions import dflash_first_release, table
from dflash_trt.errors import DFlashError

RULES = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_speculation.json").read_text())[
    "draft_len_schedule_rules"]
GPTOSS = resolve_arch("gpt-oss-120b")[0]
QWEN = resolve_arch("qwen3-8b")[0]
DFLASH_FIRST = dflash_first_release()


def _gptoss(k_max: int = 15, **over):
    target = ModelDims.from_arch(GPTOSS, "none", None, "none", expert_format="mxfp4")
    draft = ModelDims.from_draft(DraftShape.estimate(GPTOSS, 5), GPTOSS.vocab_size, 16)
    args = dict(gpu="b300", target=target, draft=draft, tp=8, ep=8, max_batch_size=256, max_draft_len=k_max,
                k_given=False, profile=AcceptanceProfile.default(15))
    return derive(**{**args, **over})


def _upstream_valid(schedule: DraftLenSchedule, K: int) -> None:
    """TensorRT-LLM's validator, as recorded: keys >= 1, values >= 0, smallest key -> K, none above K."""
    keys = [b for b, _ in schedule.steps]
    assert keys == sorted(set(keys)) and keys[0] >= 1
    assert schedule.steps[0][1] == K and all(0 <= k <= K for _, k in schedule.steps)
    assert all(isinstance(b, int) and isinstance(k, int) for b, k in schedule.to_mapping().items())


# -- the acceptance profile ---------------------------------------------------------------------

def test_expected_tokens_is_one_plus_the_survival_sum():
    p = AcceptanceProfile((0.6, 0.3, 0.1), "test")
    assert [p.expected_tokens(k) for k in range(5)] == pytest.approx([1.0, 1.6, 1.9, 2.0, 2.0])


def test_the_default_profile_reproduces_the_papers_lowest_tau_and_says_where_it_comes_from():
    p = AcceptanceProfile.default(15)
    assert p.expected_tokens(15) == pytest.approx(DEFAULT_TAU, abs=1e-6)
    assert p.source == DEFAULT_SOURCE and "Alpaca" in p.source and "3.16" in p.source
    ratios = [b / a for a, b in zip(p.survival, p.survival[1:])]
    assert max(ratios) - min(ratios) < 1e-9  # geometric
    assert AcceptanceProfile.default(7).survival == p.survival[:7]  # the same per-position rates, fewer slots


@pytest.mark.parametrize("text, match", [("0.5,0.7", "cannot rise"), ("1.2", "not a probability"),
                                         ("tau:0.5", r"lies in \[1, 16\]"), ("a,b", "P\\(a >= 1\\)"),
                                         ("tau:x", "tau:X"), ("", "at least one position")])
def test_bad_profiles_are_one_line_errors(text, match):
    with pytest.raises(DFlashError, match=match) as e:
        AcceptanceProfile.parse(text, 15)
    assert "\n" not in str(e.value)


def test_a_measured_profile_comes_from_the_gates_per_slot_counts():
    p = AcceptanceProfile.measured([20, 18, 16, 0], [10, 4, 8, 0], "gate")
    # slot 3's 8/16 cannot exceed slot 2's 4/18: a step reaches slot 3 only through slot 2
    assert p.survival == pytest.approx((0.5, 4 / 18, 4 / 18))
    assert AcceptanceProfile.measured([0, 0], [0, 0], "gate") is None


# -- deriving the schedule ----------------------------------------------------------------------

def test_buckets_are_powers_of_two_up_to_the_max_batch():
    assert bucket_sizes(1) == [1] and bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_compress_keeps_the_upper_bound_of_each_run_and_drops_a_trailing_off_run():
    s = compress([1, 2, 4, 8, 16, 32], [7, 7, 5, 5, 0, 0])
    assert s.to_mapping() == {2: 7, 8: 5}
    assert [s.draft_len(b) for b in (1, 2, 3, 8, 9, 32)] == [7, 7, 5, 5, 0, 0]
    assert compress([1, 2], [3, 3]).to_mapping() == {2: 3}


def test_each_bucket_drafts_the_smallest_k_within_tolerance_of_the_best_throughput():
    target = ModelDims.from_arch(QWEN, "fp8", "mlp-only", "fp8")
    draft = ModelDims.from_draft(DraftShape.estimate(QWEN, 5), QWEN.vocab_size, 16)
    profile = AcceptanceProfile.default(15)
    for batch in (1, 16, 256):
        c = choose_k("h100", target, draft, 1, 1, batch, 15, profile)
        rates = [batch * profile.expected_tokens(k) / step_cost("h100", target, 1, 1, batch, k, draft).seconds
                 for k in range(16)]
        assert rates[c.k] >= max(rates) * (1 - TOLERANCE)
        assert all(r < max(rates) * (1 - TOLERANCE) for r in rates[:c.k])
        assert c.tokens_per_s >= c.plain_tokens_per_s  # never a loss against plain decoding, by the model


def test_the_gpt_oss_schedule_on_b300_keeps_upstreams_rules():
    d = _gptoss()
    _upstream_valid(d.schedule, d.max_draft_len)
    ks = [b.k for b in d.buckets]
    assert ks == sorted(ks, reverse=True)  # a bigger batch never drafts more
    assert all(b.tokens_per_s >= b.plain_tokens_per_s for b in d.buckets)
    # every bucket's batch gets the bucket's k from the written schedule
    for b in d.buckets:
        assert d.schedule.draft_len(b.batch) == min(b.k, d.max_draft_len)
    assert d.to_record()["draft_len_schedule"] == d.schedule.to_mapping()
    assert d.to_record()["model"]["acceptance"]["source"] == DEFAULT_SOURCE


def test_k_left_to_its_default_follows_the_schedule_and_a_given_k_is_kept():
    lowered = _gptoss()
    assert lowered.buckets[0].k < 15 and lowered.max_draft_len == lowered.buckets[0].k
    assert any("max_draft_len 15 ->" in n for n in lowered.notes)
    kept = _gptoss(k_given=True)
    assert kept.max_draft_len == 15 and kept.schedule.steps[0][1] == 15
    _upstream_valid(kept.schedule, 15)
    assert any("drafts the given max_draft_len 15" in n for n in kept.notes)


def _weak_on_qwen(floor_zero: bool = True):
    target = ModelDims.from_arch(QWEN, "none", None, "none")
    draft = ModelDims.from_draft(DraftShape.estimate(QWEN, 5), QWEN.vocab_size, 16)
    weak = AcceptanceProfile((0.3, 0.1, 0.03), "weak")
    return target, draft, weak, derive("h100", target, draft, 1, 1, 1024, 15, False, weak, floor_zero=floor_zero)


def test_drafting_is_switched_off_where_it_loses_and_tensorrt_llm_gets_the_floor():
    """A weak drafter on a compute-heavy dense target: big batches lose and the model switches them
    off (the peers' schedule leaves them above its largest key), but TensorRT-LLM's schedule drafts
    1 there up to max_batch_size (PR 16888: 0 drafts starve DFlash's context buffers), and the
    manifest records what that costs by the same model."""
    target, draft, weak, d = _weak_on_qwen()
    off = [b for b in d.buckets if b.k == 0]
    assert off and off[-1].batch == 1024 and d.buckets[0].k > 0
    peers = d.peers
    assert max(b for b, _ in peers.steps) < off[0].batch and peers.draft_len(1024) == 0
    for b in off:  # drafting even one token would have lost there
        assert choose_k("h100", target, draft, 1, 1, b.batch, 1, weak).k == 0
    # TensorRT-LLM's: never 0 up to the served maximum, the model's value wherever it drafts
    assert min(d.schedule.draft_len(b) for b in range(1, 1025)) == 1
    assert all(d.schedule.draft_len(b.batch) == max(b.k, 1) for b in d.buckets)
    _upstream_valid(d.schedule, d.max_draft_len)
    floor = d.to_record()["floor"]
    assert DraftLenSchedule.from_mapping(floor["before"]) == peers and floor["zero_batches"] == [[max(peers.to_mapping()) + 1, 1024]]
    top = next(c for c in floor["cost"] if c["batch"] == 1024)
    one, none = step_cost("h100", target, 1, 1, 1024, 1, draft), step_cost("h100", target, 1, 1, 1024, 0, draft)
    assert top["change"] == pytest.approx((1 + 0.3) / one.seconds * none.seconds - 1, abs=1e-4) and top["change"] < 0
    assert any("floored at 1 up to max_batch_size 1024" in n and f"{top['change']:+.1%}" in n for n in d.notes)


def test_the_floor_follows_a_release_recorded_with_the_fix():
    *_, d = _weak_on_qwen(floor_zero=False)
    assert d.schedule == d.peers and d.schedule.draft_len(1024) == 0 and d.floor is None


def test_a_given_schedule_that_drafts_0_is_floored_too():
    d = _decide(draft_len_schedule="4:7,16:3", max_batch_size=64)
    assert d.schedule.to_mapping() == {4: 7, 16: 3, 64: 1} and d.peers.to_mapping() == {4: 7, 16: 3}
    assert d.floor["zero_batches"] == [[17, 64]] and {c["batch"] for c in d.floor["cost"]} == {17, 64}
    zero_in_the_middle = _decide(draft_len_schedule="4:7,8:0,16:3", max_batch_size=16)
    assert zero_in_the_middle.schedule.to_mapping() == {4: 7, 8: 1, 16: 3}


def test_a_schedule_that_drafts_k_at_every_served_batch_is_not_written():
    """{max_batch_size: K} is what TensorRT-LLM does with no schedule: none is written (the minimum
    release stays DFlash's), the buckets stay on record; a wider engine gets a real schedule."""
    narrow = _gptoss(max_batch_size=1)
    assert [b.k for b in narrow.buckets] == [narrow.max_draft_len] and narrow.schedule is None
    assert narrow.to_record()["draft_len_schedule"] is None and narrow.to_record()["model"]["buckets"]
    assert any("no draft_len_schedule is written" in n for n in narrow.notes)
    wide = _gptoss()
    assert wide.schedule is not None and wide.schedule.max_draft_len == wide.max_draft_len == narrow.max_draft_len


def test_a_drafter_that_never_pays_still_meets_upstreams_rule_and_says_so():
    """K 1 at batch 1 (upstream's rule) and, floored, at every batch: no schedule to write; the peers'
    switches drafting off above batch 1."""
    d = _gptoss(profile=AcceptanceProfile((0.001,), "useless"))
    assert d.schedule is None and d.max_draft_len == 1 and d.peers.to_mapping() == {1: 1}
    assert any("drafting loses to plain decoding at every batch size" in n for n in d.notes)


def test_upstreams_recorded_rules_are_the_ones_checked():
    assert "smallest key] must equal max_draft_len" in " ".join(RULES["validator"])
    s = DraftLenSchedule.parse("4:4,8:2,32:1")  # upstream's own example
    assert [s.draft_len(b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    with pytest.raises(DFlashError, match="must map to max_draft_len=5"):
        s.check_against(5)


# -- from the build spec ------------------------------------------------------------------------

def _decide(**over):
    spec = resolve_spec(None, {"gpu": "h100", **over})
    return decide(spec, QWEN, DraftShape.estimate(QWEN, 5), 16, spec.max_draft_len or 15)


def test_off_given_and_cpu_engines():
    assert _decide(draft_len_schedule="off").schedule is None
    given = _decide(draft_len_schedule="4:7,16:3")
    assert given.source == "given" and given.schedule.to_mapping() == {4: 7, 16: 3} and given.max_draft_len == 7
    cpu = _decide(gpu="cpu")
    assert cpu.schedule is None and cpu.source == "none" and "CPU engine" in cpu.notes[0]
    assert _decide().source == "derived"


def test_a_release_without_draft_len_schedule_gets_none():
    """1.3.0rc16 (the first DFlash release) predates the field (trtllm_fields.json): a derived schedule
    stays on record for the peers, a given one is refused in one line."""
    first = table()["fields"]["speculative_config.draft_len_schedule"]["first_version"]
    old = _decide(tensorrt_llm_release=DFLASH_FIRST, max_batch_size=1024)
    new = _decide(tensorrt_llm_release=first, max_batch_size=1024)
    assert Version(DFLASH_FIRST) < Version(first)
    assert old.schedule is None and new.schedule is not None and old.peers == new.peers
    assert any(f"TensorRT-LLM {DFLASH_FIRST} has no draft_len_schedule" in n for n in old.notes)
    with pytest.raises(DFlashError, match=f"TensorRT-LLM {DFLASH_FIRST} has no draft_len_schedule") as e:
        _decide(tensorrt_llm_release=DFLASH_FIRST, draft_len_schedule="4:7,16:3")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over, match", [
    ({"draft_len_schedule": "4:7,16:3", "max_draft_len": 5}, "must map to max_draft_len=5"),
    ({"draft_len_schedule": "4:16"}, r"must lie in 1\.\.15"),
    ({"draft_len_schedule": "4:0,8:0"}, r"must lie in 1\.\.15"),
    ({"acceptance_profile": "0.9,0.95"}, "cannot rise"),
])
def test_a_given_schedule_or_profile_that_cannot_be_written_is_refused_in_one_line(over, match):
    with pytest.raises(DFlashError, match=match) as e:
        _decide(**over)
    assert "\n" not in str(e.value)


def test_a_given_profile_drives_the_derivation():
    strong = _decide(acceptance_profile="tau:8")
    weak = _decide(acceptance_profile="0.4,0.1")
    assert strong.profile.source.startswith("--acceptance-profile tau:8")
    assert weak.max_draft_len <= 2 < strong.max_draft_len


# -- through the CLI ------------------------------------------------------------------------------

def _plan_cli(*extra: str) -> tuple[dict, str]:
    from click.testing import CliRunner

    from dflash_trt.cli import main

    r = CliRunner().invoke(main, ["plan", "--target", "gpt-oss-120b", "--tp", "8", "--gpu", "b300", "--json", *extra])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_plan_shows_the_schedule_for_gpt_oss_on_8_b300s_and_the_flag_overrides_or_turns_it_off():
    out, err = _plan_cli()
    record = out["speculation"]
    schedule = DraftLenSchedule.from_mapping(record["draft_len_schedule"])
    _upstream_valid(schedule, out["max_draft_len"])
    assert record["source"] == "derived" and out["max_draft_len"] == record["max_draft_len"]
    assert f"draft_len_schedule (derived): {schedule.to_mapping()}  max_draft_len {out['max_draft_len']}" in err
    assert "Draft length by batch size on b300 x8" in err
    assert "from the default acceptance profile: a build whose acceptance gate runs" in err  # which one is final
    assert [b["batch"] for b in record["model"]["buckets"]] == bucket_sizes(8)  # the spec's max_batch_size
    given, err = _plan_cli("--draft-len-schedule", "4:7,16:3")
    assert given["speculation"]["draft_len_schedule"] == {"4": 7, "16": 3} and given["max_draft_len"] == 7
    assert "draft_len_schedule (given): {4: 7, 16: 3}" in err
    off, err = _plan_cli("--draft-len-schedule", "off", "--max-draft-len", "9")
    assert off["speculation"]["draft_len_schedule"] is None and off["max_draft_len"] == 9
    assert "draft_len_schedule (off): none" in err


def test_plan_shows_what_each_release_gets(tmp_path):
    """gpt-oss-120b tp 8 on b300 serving 2048: every release from DFlash's first gets a file it accepts;
    the first has no draft_len_schedule (none written), the later ones the floored schedule; a setting
    a release lacks shows that release's refusal instead of failing the plan."""
    out, err = _plan_cli("--max-batch-size", "2048")
    rows = {r["release"]: r for r in out["by_release"]}
    first, container = DFLASH_FIRST, out["tensorrt_llm_release"]
    assert list(rows) == sorted(rows, key=Version) and {first, container, "1.4.0rc1"} <= set(rows)
    assert "container" in rows[container]["roles"] and "first DFlash" in rows[first]["roles"]
    assert rows[first]["written"] == {} and rows[first]["min_tensorrt_llm_version"] == first
    later = DraftLenSchedule.from_mapping(rows[container]["written"]["draft_len_schedule"])
    assert later == DraftLenSchedule.from_mapping(out["speculation"]["draft_len_schedule"])
    assert later.steps[-1][0] == 2048 and min(k for _, k in later.steps) == 1 and not later.zero_ranges(2048)
    assert rows[container]["written"]["attention_backend"] == "TRTLLM"
    assert "What each TensorRT-LLM release gets" in err
    (tmp_path / "s.yaml").write_text("dflash_attention_backend: TRTLLM\n")
    refused, _ = _plan_cli("--spec", str(tmp_path / "s.yaml"))
    row = next(r for r in refused["by_release"] if r["release"] == first)
    assert row["written"] is None and f"TensorRT-LLM {first} refuses" in row["refusal"]
