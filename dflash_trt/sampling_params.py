"""`SamplingParams`: what to sample and when to stop, for ONE request, defined once.

Every decoding path takes this object whole: the reference loop (runtime/reference/generate.py), the
batched runtime (runtime/batched/runtime.py), the serving backends (serving/), the TensorRT-LLM backend
(which maps it onto ``tensorrt_llm.SamplingParams``, whose field names these follow), `generate`,
`bench` and the servers' request parsers. It is validated once, when it is built: a NaN, an
infinity, a value out of range or a value of the wrong type raises :class:`InvalidRequest`
(``dflash_trt.errors``), one line naming the field, the value and the fix, which servers answer
with INVALID_ARGUMENT / HTTP 400. Nothing downstream re-checks these fields.

Fields (names as in TensorRT-LLM's and vLLM's ``SamplingParams``):

- ``max_tokens``: tokens to generate, prompt excluded. ``None`` = the default of whoever runs the
  request (a serving backend: its ``default_max_tokens``; the library loops:
  :data:`DEFAULT_MAX_TOKENS`), resolved with :meth:`SamplingParams.resolve_max_tokens`.
- ``temperature``: 0 = greedy (argmax); > 0 samples from the tempered distribution.
- ``top_p``: nucleus mass in (0, 1]; 1 = the whole distribution. Ignored when greedy.
- ``seed``: a per-request generator seed (reproducible sampling, also under load); ``None`` =
  the process's global generator.
- ``stop``: stop STRINGS; the text ends before the first one (the serving detokenizer cuts it).
- ``stop_token_ids``: stop TOKENS; generation ends after the first one (it is part of the output).
  Frontends usually leave it empty and the runtime adds the tokenizer's end-of-turn ids
  (:meth:`with_stop_token_ids`, ``TextCodec.stop_token_ids``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from dflash_trt.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 256  # the library loops' budget when a request names none
MAX_SEED = 2**64 - 1  # seeds travel as UINT64 (Triton's `seed` input, TensorRT-LLM)


def _number(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidRequest(f"{name}={value!r} is not a number; {fix}")
    x = float(value)
    if not math.isfinite(x):
        raise InvalidRequest(f"{name}={x} is not a finite number; {fix}")
    return x


def _integer(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidRequest(f"{name}={value!r} is not an integer; {fix}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request; see the module docstring. Immutable: derive changed
    copies with :meth:`replace` (which validates again)."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are written once, here
        if self.max_tokens is not None:
            n = _integer("max_tokens", self.max_tokens, "send a whole number of tokens >= 1")
            if n < 1:
                raise InvalidRequest(f"max_tokens={n} must be >= 1; ask for at least one token")
            set_(self, "max_tokens", n)
        t = _number("temperature", self.temperature, "send a temperature >= 0 (0 = greedy), e.g. 0.7")
        if t < 0:
            raise InvalidRequest(f"temperature={t} must be >= 0 (0 = greedy); send e.g. 0.7")
        set_(self, "temperature", t)
        p = _number("top_p", self.top_p, "send a nucleus mass in (0, 1], e.g. 0.95")
        if not 0 < p <= 1:
            raise InvalidRequest(f"top_p={p} must be in (0, 1] (1 = no nucleus cut); send e.g. 0.95")
        set_(self, "top_p", p)
        if self.seed is not None:
            s = _integer("seed", self.seed, f"send an integer in 0..{MAX_SEED}")
            if not 0 <= s <= MAX_SEED:
                raise InvalidRequest(f"seed={s} is outside 0..{MAX_SEED}; send a non-negative 64-bit seed")
            set_(self, "seed", s)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest(f"stop={self.stop!r} must be a list of strings; send e.g. [\"\\n\\n\"]")
        set_(self, "stop", tuple(s for s in stop if s))  # an empty stop string would stop at once
        ids = self.stop_token_ids
        if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
            raise InvalidRequest(f"stop_token_ids={ids!r} must be a list of token ids; send e.g. [2]")
        checked = tuple(_integer("stop_token_ids", i, "send token ids >= 0") for i in ids)
        if any(i < 0 for i in checked):
            raise InvalidRequest(f"stop_token_ids={list(checked)} has a negative id; send token ids >= 0")
        set_(self, "stop_token_ids", tuple(dict.fromkeys(checked)))  # de-duplicated, order kept

    # -- derived ---------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolve_max_tokens(self, default: int = DEFAULT_MAX_TOKENS) -> int:
        """`max_tokens`, or `default` when the request named none."""
        return self.max_tokens if self.max_tokens is not None else default

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied, validated like a new object."""
        return dataclasses.replace(self, **changes)

    def with_stop_token_ids(self, ids: Iterable[int]) -> "SamplingParams":
        """A copy that also stops on `ids` (e.g. the tokenizer's end-of-turn tokens)."""
        return self.replace(stop_token_ids=(*self.stop_token_ids, *ids))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d


GREEDY = SamplingParams()
