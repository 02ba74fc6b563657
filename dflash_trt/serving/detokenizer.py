"""Incremental detokenization with stop strings: token ids in, text deltas out, never retracted."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dflash_trt.runtime.decoding.tokens import TextCodec

log = logging.getLogger("dflash_trt.serving")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the final text.

    Byte-level BPE can end on half a UTF-8 character (decoded as U+FFFD until the next token
    completes it), and the tail may be the start of a stop string: both are held back until
    they are settled, so a streamed answer never has to take text back. The text ends before
    the first stop string (``stopped`` turns True).
    """

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the text

    def _decode(self) -> str:
        # Whole-sequence decode each step: O(n^2) chars over a request, negligible next to a
        # forward pass at these lengths, and immune to tokenizers' context-dependent spacing.
        return self.codec.decode(self.ids)

    def _delta(self, text: str, upto: int) -> str:
        if not text.startswith(self.emitted):  # decoder rewrote already-sent text: never retract
            log.debug("detokenizer: text is not prefix-stable; continuing from the emitted length")
        n = len(self.emitted)
        delta = text[n:upto] if upto > n else ""
        self.emitted += delta
        return delta

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        text = self._decode()
        if self.stop:
            start = max(0, len(self.emitted) - max(map(len, self.stop)))
            hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.stop_hit = min(hits)
                self.stopped = True
                return self._delta(text, at)
        stable = text.rstrip("\ufffd")
        upto = len(stable)
        for s in self.stop:  # hold back a tail that could still become a stop string
            for k in range(min(len(s) - 1, len(stable)), 0, -1):
                if stable.endswith(s[:k]):
                    upto = min(upto, len(stable) - k)
                    break
        return self._delta(text, upto)

    def flush(self) -> str:
        """The rest of the text at the end of generation (nothing after a stop string)."""
        if self.stopped:
            return ""
        return self._delta(self._decode(), 1 << 62)
