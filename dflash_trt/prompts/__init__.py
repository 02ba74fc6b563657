"""Prompt sets written by this project, shipped as package data: code, math and chat.

Each ``<category>.jsonl`` row is ``{"id", "category", "split": "train"|"eval"|"gate", "prompt"}``.
Training uses only ``split == "train"``; the benchmark uses only ``split == "eval"``; the
acceptance gate decodes the held-out prompts, eval then gate (:data:`HELD_OUT`).
(Regenerate with ``python -m dflash_trt.prompts.build``.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashError

HERE = Path(__file__).resolve().parent
CATEGORIES = ("code", "math", "chat")
SPLITS = ("train", "eval", "gate")
HELD_OUT = ("eval", "gate")  # never trained on: what the acceptance gate decodes, in this order


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    split: str
    prompt: str


def load_prompts(split: str | None = None, categories: tuple[str, ...] | list[str] = CATEGORIES) -> list[Prompt]:
    """Prompts of `categories` (all by default) and `split` (both if None), in file order."""
    if split is not None and split not in SPLITS:
        raise DFlashError(f"unknown prompt split {split!r}; use one of {', '.join(SPLITS)}")
    out: list[Prompt] = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise DFlashError(f"unknown prompt category {cat!r}; use one of {', '.join(CATEGORIES)}")
        for line in (HERE / f"{cat}.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                p = Prompt(**json.loads(line))
                if split is None or p.split == split:
                    out.append(p)
    return out


def interleave(prompts: list[Prompt]) -> list[Prompt]:
    """Round-robin over categories, so a prefix (--num-prompts N) covers every category."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    queues = list(by_cat.values())
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
