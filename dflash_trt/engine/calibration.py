"""Calibration prompts: a file, a list of strings, the project's prompt sets, or a built-in few."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

# Used only when the project's prompt sets (dflash_trt.prompts) are not importable.
BUILTIN_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23? Show your steps.",
    "List three differences between TCP and UDP.",
    "Summarize the plot of a story about a lighthouse keeper.",
    "Solve for x: 3x + 7 = 22.",
    "Translate 'good morning, how are you?' into French.",
    "Give me a haiku about autumn rain.",
)


def _text_of(row: Any, where: str) -> str:
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        for key in ("prompt", "text", "question", "instruction"):
            if isinstance(row.get(key), str):
                return row[key]
        turns = row.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
    raise DFlashError(f"{where}: a row is neither a string nor an object with a 'prompt' or 'text' field")


def load_calibration_prompts(source: str | list[str] | None, limit: int, split: str = "train") -> list[str]:
    """Up to `limit` prompt strings from `source` (None: the project's prompts of `split`:
    train prompts calibrate, the "held-out" ones -- eval, then gate -- feed the acceptance gate,
    so the gate does not measure tau on prompts the embedded drafter was trained on)."""
    if isinstance(source, list):
        prompts = [str(p) for p in source]
    elif source is None:
        try:
            from dflash_trt.prompts import HELD_OUT, interleave, load_prompts

            splits = HELD_OUT if split == "held-out" else (split,)
            prompts = [p.prompt for s in splits for p in interleave(load_prompts(split=s))]
        except (ImportError, DFlashError, OSError):
            prompts = list(BUILTIN_PROMPTS)
    else:
        path = Path(source)
        if not path.is_file():
            raise DFlashError(f"calibration prompts file {path} not found; pass a .jsonl/.json/.txt file")
        text = path.read_text(encoding="utf-8")
        try:
            if path.suffix == ".jsonl":
                prompts = [_text_of(json.loads(line), str(path)) for line in text.splitlines() if line.strip()]
            elif path.suffix == ".json":
                data = json.loads(text)
                if not isinstance(data, list):
                    raise DFlashError(f"{path}: expected a JSON list of prompts")
                prompts = [_text_of(r, str(path)) for r in data]
            else:
                prompts = [line for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}); fix the prompts file")
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise DFlashError(f"no calibration prompts in {source!r}; give at least one non-empty prompt")
    return prompts[:limit]


def encode_prompts(tokenizer: Any, prompts: list[str], vocab_size: int, max_length: int) -> list[list[int]]:
    """Token ids as `dflash-trt generate` would feed them (chat template when there is one)."""
    from dflash_trt.runtime.decoding.tokens import TextCodec

    codec = TextCodec(tokenizer, vocab_size)
    return [codec.encode(p)[:max_length] for p in prompts]
