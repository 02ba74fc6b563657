"""The tokenizer contract: text <-> token ids for one target, the same on every path.

`generate`, `bench`, the serving backends, the engine's calibration and the training data all
turn text into the ids the target sees through :class:`TextCodec`, so a prompt is encoded the
same way wherever it runs (an in-process benchmark and a server answer the same ids):

- :meth:`TextCodec.encode`: one user turn, with the tokenizer's chat template applied (``raw``:
  the bare text, no template);
- :meth:`TextCodec.encode_messages`: a conversation, a list of ``{"role": ..., "content": ...}``
  (OpenAI's chat messages), through the chat template with the assistant's turn opened;
  ``encode(text)`` == ``encode_messages([{"role": "user", "content": text}])``;
- :attr:`TextCodec.stop_token_ids`: the ids that end a turn (the model config's and the
  tokenizer's ``eos_token_id``, and a generation config's);
- :meth:`TextCodec.decode`: ids -> text, special tokens skipped.

Every prompt is validated here, so `generate`, `serve` and `bench` refuse the same inputs the same
way: malformed messages, an empty prompt, text that is not valid UTF-8 (a lone surrogate, as
Python decodes a command-line argument of invalid bytes), a prompt that encodes to nothing, and,
when the codec knows the engine's ``max_seq_len``, a prompt that leaves no room for one output
token (:meth:`TextCodec.check_room` also counts the output budget). Each raises
``InvalidRequest`` (servers answer 400; the CLI prints one line). A pair without a tokenizer (the tiny random test pairs) folds UTF-8 bytes into the
vocabulary and decodes ids as numbers, so every path still runs end to end.

Thread-safe: HF fast tokenizers are Rust objects that raise "Already borrowed" when two threads
use one at once (a server encodes requests on its threads while the runtime decodes), so every
call holds the codec's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflash_trt.errors import InvalidRequest

ChatMessage = Mapping[str, str]  # {"role": "user" | "assistant" | "system" | ..., "content": "..."}


def stop_token_ids_of(tokenizer: Any, model_config: Any) -> list[int]:
    """End-of-turn ids: the model config's and the tokenizer's eos_token_id (int or list), plus a
    generation config's when the loader recorded one (``model_config._generation_eos``)."""
    ids: set[int] = set()
    for src in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    gen_cfg = getattr(model_config, "_generation_eos", None)
    if gen_cfg:
        ids.update(gen_cfg)
    return sorted(ids)


def check_text(text: Any, what: str = "the prompt") -> str:
    """`text` if it is a non-empty str that encodes as UTF-8; InvalidRequest otherwise."""
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} must be text, got {type(text).__name__}")
    if not text:
        raise InvalidRequest(f"{what} is empty; send non-empty text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise InvalidRequest(f"{what} is not valid UTF-8 ({shown} at character {e.start}); send UTF-8 text "
                             "(check the terminal's or the file's encoding)") from None
    return text


def check_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} string dicts; InvalidRequest otherwise."""
    hint = 'send a list like [{"role": "user", "content": "..."}]'
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise InvalidRequest(f"messages must be a list of chat messages, got {type(messages).__name__}; {hint}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}] needs string \"role\" and \"content\"; {hint}")
        if not m["role"]:
            raise InvalidRequest(f"messages[{i}] has an empty role; {hint}")
        check_text(m["content"], f"messages[{i}].content") if m["content"] else None  # "" allowed in a turn
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise InvalidRequest(f"messages is empty; {hint}")
    return out


class TextCodec:
    """The tokenizer contract of one target (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 max_seq_len: int | None = None) -> None:
        self.tokenizer = tokenizer  # a HF tokenizer, or None (bytes folded into the vocabulary)
        self.vocab_size = int(vocab_size)
        self.stop_token_ids: tuple[int, ...] = tuple(int(i) for i in stop_token_ids)
        self.max_seq_len = max_seq_len  # the engine's prompt + output limit; None: unbounded here
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, tokenizer: Any, model_config: Any, max_seq_len: int | None = None) -> "TextCodec":
        """The codec of a target: its vocabulary size and end-of-turn ids come from its config."""
        return cls(tokenizer, int(model_config.vocab_size), stop_token_ids_of(tokenizer, model_config), max_seq_len)

    @classmethod
    def of_pair(cls, pair: Any, max_seq_len: int | None = None) -> "TextCodec":
        """The codec of a loaded pair (anything with .tokenizer and .target); `max_seq_len`: the
        engine's limit, when the pair came from one."""
        return cls.for_model(pair.tokenizer, pair.target.config, max_seq_len)

    def check_room(self, ids: Sequence[int], max_tokens: int | None = None) -> None:
        """InvalidRequest unless `ids` plus `max_tokens` output tokens (None: at least one) fit the
        engine's max_seq_len."""
        if self.max_seq_len is None:
            return
        if max_tokens is None and len(ids) >= self.max_seq_len:
            raise InvalidRequest(f"the prompt is {len(ids)} tokens, the engine's max_seq_len={self.max_seq_len} "
                                 f"(prompt + output); shorten the prompt to under {self.max_seq_len} tokens")
        if max_tokens is not None and len(ids) + max_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"the prompt is {len(ids)} tokens and {max_tokens} more are asked for, over the engine's "
                f"max_seq_len={self.max_seq_len}; shorten the prompt (at most {self.max_seq_len - max_tokens} "
                "tokens) or ask for fewer tokens")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # -- text -> ids -----------------------------------------------------------------------------
    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Ids of one user turn: the chat template applied unless `raw` (or there is none)."""
        check_text(prompt)
        if raw or not self.has_chat_template:
            return self._checked(self._plain(prompt), "the prompt")
        return self.encode_messages([{"role": "user", "content": prompt}])

    def encode_messages(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Ids of a conversation through the chat template, the assistant's turn opened. Without
        a template the contents are joined by newlines and encoded as plain text."""
        msgs = check_messages(messages)
        if not self.has_chat_template:
            return self._checked(self._plain("\n".join(m["content"] for m in msgs)), "the messages")
        with self._lock:
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return self._checked([int(i) for i in ids], "the messages")

    def _plain(self, text: str) -> list[int]:
        if self.tokenizer is None:  # tiny random pair: bytes folded into the vocabulary
            return [b % self.vocab_size for b in text.encode("utf-8")] or [0]
        with self._lock:
            return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def _checked(self, ids: list[int], what: str) -> list[int]:
        if not ids:
            raise InvalidRequest(f"{what} encoded to no tokens; send non-empty text")
        self.check_room(ids)
        return ids

    # -- ids -> text -----------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped (ids as numbers when there is no tokenizer)."""
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
