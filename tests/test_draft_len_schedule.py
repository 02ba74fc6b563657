"""The draft-length schedule (dflash_trt/draft_len_schedule.py) follows TensorRT-LLM's
``draft_len_schedule`` rules, recorded in shared/design/upstream-2026-08.md from
tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig, NVIDIA/TensorRT-LLM ad8349f6): a batch of b uses
the value of the smallest key >= b, 0 above the largest key; keys >= 1, values >= 0, the smallest
key maps to max_draft_len, no value exceeds it. TensorRT-LLM cannot run here: the rules are tested
as upstream states them, and the schedule policy against them."""

from __future__ import annotations

import pytest

from dflash_trt.draft_len_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.policy import make_policy
from dflash_trt.speculation import SpeculationSettings


def test_upstream_example_batch_sizes_map_as_documented():
    s = DraftLenSchedule.from_mapping({"32": 1, "4": 4, "8": 2})  # JSON keys are strings; stored sorted
    assert [s.draft_len(b) for b in (1, 4, 5, 8, 9, 32, 33, 1000)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert list(s.to_mapping()) == [4, 8, 32] and s.to_text() == "4:4,8:2,32:1"


def test_vllm_ranges_cover_every_batch_size_up_to_the_largest_key_once():
    s = DraftLenSchedule.parse("4:7,8:3,32:0")
    ranges = s.vllm_ranges()
    assert ranges == [(1, 4, 7), (5, 8, 3), (9, 32, 0)]
    assert all(n == s.draft_len(b) for lo, hi, n in ranges for b in range(lo, hi + 1))


@pytest.mark.parametrize("text, msg", [("4-7", "is not BATCH:DRAFT_LEN"), ("8:3,4:7,4:2", "distinct"),
                                       ("0:3", "batch size >= 1"), ("", None), ("off", None)])
def test_text_form_refusals_are_one_line(text, msg):
    if msg is None:
        assert DraftLenSchedule.parse(text) is None
        return
    with pytest.raises(DFlashError, match=msg) as e:
        DraftLenSchedule.parse(text)
    assert "\n" not in str(e.value)


def test_speculation_settings_apply_upstreams_validator():
    s = DraftLenSchedule.parse("4:7,16:3")
    assert SpeculationSettings(16, 7, "schedule", schedule=s).schedule is s
    with pytest.raises(DFlashError, match="must map to max_draft_len=5"):
        SpeculationSettings(16, 5, schedule=s)
    with pytest.raises(DFlashError, match="exceed max_draft_len=7"):
        SpeculationSettings(16, 7, schedule=DraftLenSchedule.parse("4:7,16:9"))
    with pytest.raises(DFlashError, match="--policy schedule"):
        SpeculationSettings(16, 7, "schedule")


def test_the_schedule_policy_drafts_what_the_schedule_says_at_each_batch_size():
    spec = SpeculationSettings(16, 7, "schedule", schedule=DraftLenSchedule.parse("2:7,8:3,16:1"))
    policy = make_policy(spec)
    assert [policy.choose(b, 7).k for b in (1, 2, 3, 8, 9, 16, 17)] == [7, 7, 3, 3, 1, 1, 0]
    assert policy.draft_lengths(7) == {0, 1, 3, 7}  # every k it may choose: what start-up captures
