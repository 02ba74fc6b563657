"""`DraftLenSchedule`: the draft length a step may verify at each batch size, TensorRT-LLM's way.

TensorRT-LLM's ``DecodingBaseConfig.draft_len_schedule`` (llmapi/llm_args.py at NVIDIA/TensorRT-LLM
ad8349f6 and 0004396; first documented in 1.3.0rc27) maps **active batch-size thresholds** to
draft lengths. A batch of b requests uses the value of the smallest key >= b; above the largest key
the draft length is 0 (speculation off). Its validator requires keys >= 1, values >= 0, every value
<= ``max_draft_len``, and the value at the smallest key EQUAL to ``max_draft_len``; the dict is
stored sorted, with int keys in YAML. Example ``{4: 4, 8: 2, 32: 1}``: 1-4 rows draft 4, 5-8 draft
2, 9-32 draft 1, 33 and more draft 0.

This module is the one owner of that rule: `build` derives a schedule for the engine's GPU and
writes it into ``llm_api_options.yaml``, `verify` checks it, the batched runtime's ``schedule``
policy follows it (runtime/batched/policy.py), and vLLM's ``num_speculative_tokens_per_batch_size`` (a list
of inclusive ``(start, end, n)`` ranges) is written from it.

The text form (``--draft-len-schedule``) is ``4:4,8:2,32:1``; ``off`` means no schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trt.errors import DFlashError

FLAG = "--draft-len-schedule"


@dataclass(frozen=True)
class DraftLenSchedule:
    """Sorted (batch-size threshold, draft length) pairs; see the module docstring."""

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise DFlashError(f"{FLAG}: a schedule needs at least one batch-size threshold, e.g. 4:7,16:3 (or 'off')")
        keys = [b for b, _ in self.steps]
        if keys != sorted(set(keys)):
            raise DFlashError(f"{FLAG}: batch-size thresholds {keys} must be distinct and ascending")
        for b, k in self.steps:
            if b < 1 or k < 0:
                raise DFlashError(f"{FLAG}: {b}:{k} needs a batch size >= 1 and a draft length >= 0")

    @classmethod
    def from_mapping(cls, mapping: dict[Any, Any]) -> "DraftLenSchedule":
        """From a YAML/JSON mapping (string keys of JSON accepted); bad entries are one line."""
        try:
            pairs = sorted((int(b), int(k)) for b, k in mapping.items())
        except (TypeError, ValueError):
            raise DFlashError(f"{FLAG}: {mapping!r} is not a mapping of batch sizes to draft lengths") from None
        return cls(tuple(pairs))

    @classmethod
    def parse(cls, text: str) -> "DraftLenSchedule | None":
        """``4:4,8:2,32:1`` -> a schedule; ``off`` -> None."""
        text = text.strip()
        if text.lower() in ("off", "none", ""):
            return None
        pairs = []
        for item in text.split(","):
            b, sep, k = item.strip().partition(":")
            if not sep or not b.strip().isdigit() or not k.strip().isdigit():
                raise DFlashError(f"{FLAG} {text!r}: {item.strip()!r} is not BATCH:DRAFT_LEN; write e.g. 4:7,16:3,64:1 "
                                  "(batch sizes up to 4 draft 7, ... above 64 none) or 'off'")
            pairs.append((int(b), int(k)))
        return cls(tuple(sorted(pairs)))

    def draft_len(self, batch: int) -> int:
        """The draft length for `batch` active requests: the value of the smallest key >= batch, 0
        above the largest key."""
        for b, k in self.steps:
            if batch <= b:
                return k
        return 0

    @property
    def max_draft_len(self) -> int:
        """The value at the smallest key: upstream requires it to equal max_draft_len."""
        return self.steps[0][1]

    def check_against(self, max_draft_len: int) -> None:
        """Upstream's validator: the smallest key maps to K, no value exceeds it."""
        first_b, first_k = self.steps[0]
        if first_k != max_draft_len:
            raise DFlashError(f"{FLAG}: the smallest batch size ({first_b}) maps to {first_k} but must map to "
                              f"max_draft_len={max_draft_len} (TensorRT-LLM's rule); start the schedule with "
                              f"{first_b}:{max_draft_len}")
        over = [f"{b}:{k}" for b, k in self.steps if k > max_draft_len]
        if over:
            raise DFlashError(f"{FLAG}: {', '.join(over)} exceed max_draft_len={max_draft_len}; every draft length "
                              f"must be <= {max_draft_len}")

    def capped(self, max_draft_len: int) -> "DraftLenSchedule":
        """Every value at most `max_draft_len` (a run that lowers K below the schedule's own): the
        smallest key, which maps to the old K >= the new one, then maps to the new K, as upstream's
        rule requires; equal neighbours are left as they are (still a valid schedule)."""
        return DraftLenSchedule(tuple((b, min(k, max_draft_len)) for b, k in self.steps))

    def zero_ranges(self, max_batch_size: int) -> list[tuple[int, int]]:
        """The inclusive batch-size ranges in 1..max_batch_size that draft 0 as TensorRT-LLM reads the
        schedule (an explicit 0, or above the largest key)."""
        out: list[tuple[int, int]] = []
        start = 1
        for b, k in self.steps:
            if start > max_batch_size:
                break
            if k == 0:
                out.append((start, min(b, max_batch_size)))
            start = b + 1
        if start <= max_batch_size:
            out.append((start, max_batch_size))
        merged: list[tuple[int, int]] = []
        for lo, hi in out:
            if merged and merged[-1][1] + 1 == lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        return merged

    def floored(self, max_batch_size: int, floor: int = 1) -> "DraftLenSchedule":
        """Every batch size up to max_batch_size drafts at least `floor`: a 0 becomes `floor`, and
        the batches above the largest key (0 upstream) get a last key at max_batch_size; equal
        neighbours merge into the larger key (the same draft lengths, fewer keys)."""
        steps = [(b, max(k, floor)) for b, k in self.steps]
        if steps[-1][0] < max_batch_size:
            steps.append((max_batch_size, floor))
        merged: list[tuple[int, int]] = []
        for b, k in steps:
            if merged and merged[-1][1] == k:
                merged[-1] = (b, k)
            else:
                merged.append((b, k))
        return DraftLenSchedule(tuple(merged))

    def to_mapping(self) -> dict[int, int]:
        """Int keys in ascending order, as TensorRT-LLM's YAML wants them."""
        return dict(self.steps)

    def to_text(self) -> str:
        return ",".join(f"{b}:{k}" for b, k in self.steps)

    def vllm_ranges(self, max_batch_size: int | None = None) -> list[tuple[int, int, int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size``: inclusive (start, end, n) ranges.

        vLLM carries the LAST range's n forward to every batch size above it (vllm 0.32
        v1/spec_decode/dynamic/utils.py build_dynamic_sd_schedule_lookup), where TensorRT-LLM drafts
        0: with `max_batch_size` (vLLM's max_num_seqs) above the largest key, a last range of 0 up to
        it keeps the two engines alike."""
        out, start = [], 1
        for b, k in self.steps:
            out.append((start, b, k))
            start = b + 1
        if max_batch_size is not None and max_batch_size >= start and out[-1][2] != 0:
            out.append((start, max_batch_size, 0))
        return out
