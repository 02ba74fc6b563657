"""Benchmark prompts: the project's sets by category (eval split by default) or a user JSONL file.

A JSONL row is ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``,
optionally with ``"id"`` and ``"category"``. In process the messages are encoded through the
target's chat template by the tokenizer contract (``TextCodec.encode_messages``), which gives a
single user turn exactly the ids a server gives its ``text_input``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

JSONL_HINT = 'each line must be {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    messages: tuple[tuple[str, str], ...]  # (role, content) turns; the chat template is applied later

    @property
    def chat_messages(self) -> list[dict[str, str]]:
        """The turns as chat messages ({"role", "content"}), what TextCodec.encode_messages takes."""
        return [{"role": r, "content": c} for r, c in self.messages]

    @property
    def single_user_text(self) -> str | None:
        """The text of a one-turn user prompt (what a Triton text_input carries), else None."""
        if len(self.messages) == 1 and self.messages[0][0] == "user":
            return self.messages[0][1]
        return None


def from_categories(categories: list[str], split: str = "eval") -> list[BenchPrompt]:
    """The project's prompt sets, round-robin over categories so a prefix covers every one."""
    from dflash_trt.prompts import interleave, load_prompts

    return [BenchPrompt(p.id, p.category, (("user", p.prompt),))
            for p in interleave(load_prompts(split, tuple(categories)))]


def _messages_of(row: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DFlashError(f'{where}: "prompt" must be a non-empty string; {JSONL_HINT}')
        return (("user", row["prompt"]),)
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DFlashError(f'{where}: no "prompt" or non-empty "messages" list; {JSONL_HINT}')
    out = []
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DFlashError(f'{where}: messages[{i}] needs string "role" and "content"; {JSONL_HINT}')
        out.append((m["role"], m["content"]))
    return tuple(out)


def from_jsonl(path: str | Path) -> list[BenchPrompt]:
    """Prompts of a user JSONL file; any bad line is a one-line error naming the line."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"prompts file {path} not found; pass a JSONL file where {JSONL_HINT}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DFlashError(f"prompts file {path} is not UTF-8 text ({e.reason}); {JSONL_HINT}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); {JSONL_HINT}") from None
        if not isinstance(row, dict):
            raise DFlashError(f"{where} is a JSON {type(row).__name__}, not an object; {JSONL_HINT}")
        out.append(BenchPrompt(str(row.get("id", f"{path.stem}-{n}")), str(row.get("category", "user")),
                               _messages_of(row, where)))
    if not out:
        raise DFlashError(f"prompts file {path} has no prompts; {JSONL_HINT}")
    return out
