"""The shapes a batched step runs in, and with static shapes the finite set a configuration replays.

A decoding step runs two passes over N rows: the drafter's over a context of C positions and the
block of B, and the target's verification over k+1 tokens a row; each attends over W cache
positions (the mask width). With eager passes the shapes follow the step: N = the running rows, W
the longest row's length rounded up a little (fewer distinct shapes for the CPU's kernel caches).

With static shapes (CUDA graphs) every pass must have a shape captured before serving, so the
shapes come from small fixed sets, as TensorRT-LLM's ``cuda_graph_config.batch_sizes`` and vLLM's
capture sizes fix the batch sizes a graph exists for:

- rows N: the running rows padded up to the next row bucket (powers of two, and max_batch itself);
  padding rows sit on free cache slots and write only to the dump index;
- mask width W: 128 x a power of two, capped at the cache's last position (the dump index):
  at most 2x the keys a row needs, all of them masked, for a handful of widths per max_seq_len;
- draft length k: the policy's candidates (:meth:`SpeculationPolicy.draft_lengths`);
- the drafter's context C: k + 1, what a steady drafting step consumes (a step after a longer
  backlog, a prompt or plain steps' commits, runs its draft pass eagerly).

``keys`` lists every (pass, N, k, W) a configuration can replay: the runtime captures exactly those
at start-up, and a step meets no other (tests/test_batched_graphs.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Static mask widths are this times a power of two
GRAPH_WIDTH_BASE = 128
# Eager mask widths are rounded up to this (a few shapes per sequence, not one per token)
EAGER_WIDTH_MULTIPLE = 16

DRAFT, VERIFY = "draft", "verify"


def round_up(x: int, m: int, cap: int) -> int:
    """x rounded up to a multiple of m, at most cap."""
    return min(cap, -(-x // m) * m)


def row_buckets(max_batch: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The row counts static passes run with: `sizes` (each <= max_batch), else the powers of two
    below max_batch; max_batch itself always (every running batch fits one)."""
    if sizes is None:
        sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    bad = [s for s in sizes if not 1 <= s <= max_batch]
    if bad:
        raise ValueError(f"graph batch sizes must lie in 1..max_batch={max_batch}, got {bad[0]}")
    return tuple(sorted({*sizes, max_batch}))


@dataclass(frozen=True)
class StepShapes:
    """Shapes of one runtime's passes (see the module doc). `cap` is the cache's dump index: no mask
    is wider. `block_size` is B (1 without a drafter)."""

    max_batch: int
    max_seq_len: int
    block_size: int
    cap: int
    static: bool
    rows_buckets: tuple[int, ...] = ()

    @staticmethod
    def make(max_batch: int, max_seq_len: int, block_size: int, cap: int, static: bool,
             batch_sizes: Sequence[int] | None = None) -> "StepShapes":
        buckets = row_buckets(max_batch, batch_sizes) if static else ()
        return StepShapes(max_batch, max_seq_len, block_size, cap, static, buckets)

    def rows(self, n: int) -> int:
        """Rows a decoding pass runs with for n running rows (static: the smallest bucket >= n)."""
        if not self.static:
            return n
        return next(b for b in self.rows_buckets if b >= n)

    def width(self, length: int) -> int:
        """Mask width for a pass whose longest row reaches `length` positions (its last key < length)."""
        if not self.static:
            return round_up(length, EAGER_WIDTH_MULTIPLE, self.cap)
        w = GRAPH_WIDTH_BASE
        while w < length and w < self.cap:
            w *= 2
        return min(w, self.cap)

    def draft_width(self, longest_start: int) -> int:
        """The drafter's mask: every row's context and its own block (keys < start + B)."""
        return self.width(longest_start + self.block_size)

    def verify_width(self, longest_start: int, k: int) -> int:
        """The target's mask: every row's committed positions and its k+1 new ones."""
        return self.width(longest_start + k + 1)

    def widths(self) -> list[int]:
        """Every static mask width a decoding step can use. A decoding row has start <= max_seq_len - 2
        (prompt + output - 1, output shorter than its budget), so no pass reaches past
        max_seq_len - 2 + B positions."""
        out = {self.width(1)}
        w = GRAPH_WIDTH_BASE
        longest = self.max_seq_len - 2 + self.block_size
        while w < longest and w < self.cap:
            w *= 2
            out.add(min(w, self.cap))
        return sorted(out)

    def keys(self, draft_lengths: Iterable[int]) -> list[tuple[str, int, int, int]]:
        """Every (pass, rows, k, width) a static step can replay, for the policy's draft lengths: the
        drafter's pass for each k > 0, the target's for each k (k = 0: plain decoding)."""
        ks = sorted(set(draft_lengths))
        out = []
        for n in self.rows_buckets:
            for w in self.widths():
                out += [(DRAFT, n, k, w) for k in ks if k > 0]
                out += [(VERIFY, n, k, w) for k in ks]
        return out
