"""Throughput while the batch is full: total tokens/s over the time all C requests were decoding.

A run's total tokens/s divides its tokens by its wall time, and with one request per user that
wall time ends with a drain: under DFlash the rows accept differently and finish on different
steps (at C = 8 on one core, 43 to 77 steps where plain decoding takes 127 for every row), and the
last rows run alone at a small batch's poor efficiency. That measures a batch job's makespan. A
server with steady traffic never drains, so its throughput is this figure instead: the time when
C requests decoded at once (after the last of them got its first token, before the first of them
finished), and the tokens each made in it, pro rata of its own decode time (its pace is steady:
TPOT varies little within a request).

None when the run never had C requests decoding at once (a level whose requests did not overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def full_batch_windows(records: Sequence[Any], concurrency: int) -> list[tuple[float, float]]:
    """The time intervals in which `concurrency` of `records` were past their first token and not
    yet finished (each record: t_first, t_end)."""
    events = sorted([(r.t_first, 1) for r in records] + [(r.t_end, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # a finish before a start at the same instant
    windows, active, opened = [], 0, None
    for t, delta in events:
        active += delta
        if active >= concurrency and opened is None:
            opened = t
        elif active < concurrency and opened is not None:
            if t > opened:
                windows.append((opened, t))
            opened = None
    return windows


def steady_tokens_per_s(records: Sequence[Any], concurrency: int) -> float | None:
    """Total tokens/s over :func:`full_batch_windows`: each record's tokens after its first, spread
    evenly over [t_first, t_end], counted where they fall in a window."""
    windows = full_batch_windows(records, concurrency)
    span = sum(hi - lo for lo, hi in windows)
    if span <= 0:
        return None
    tokens = 0.0
    for r in records:
        decode = r.t_end - r.t_first
        if decode <= 0 or r.num_output_tokens <= 1:
            continue
        inside = sum(max(0.0, min(hi, r.t_end) - max(lo, r.t_first)) for lo, hi in windows)
        tokens += (r.num_output_tokens - 1) * inside / decode
    return tokens / span
