"""Throughput while the batch is full: total tokens/s over the time all C requests were decoding.

A run's total tokens/s divides its tokens by its wall time, and with one request per user that
wall time ends with a drain: under DFlash the rows accept differently and finish on different
steps (at C = 8 on one core, 43 to 77 steps where plain decoding takes 127 for every row), and the
last rows run alone at a small batch's poor efficiency. That measures a batch job's makespan. A
server with steady traffic never drains, so its throughput is this figure instead: the tokens
committed while C requests decoded at once (after the last of them got its first token, before the
first of them finished), over that time.

Counted from each record's per-step progress (RequestRecord.progress: the batched runtime's
sides record it), never spread pro rata over a request's decode time: under DFlash a row's pace
is not steady -- its steps are slower while the batch is full and faster once rows have left --
so a pro-rata count credits the full batch with the tail's pace (fixed:3 at C = 16 on one core
read 1.01x that way and 0.86x over the whole run, where its full-batch steps cost 2.4 plain steps
for tau 2.16).

None when a record carries no progress (an endpoint, the vLLM peer) or the run never had C
requests decoding at once (a level whose requests did not overlap).
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
    """Total tokens/s over :func:`full_batch_windows`: the tokens of every step (each record's
    progress) that committed inside a window, over the windows' length."""
    if not records or any(r.progress is None for r in records):
        return None
    windows = full_batch_windows(records, concurrency)
    span = sum(hi - lo for lo, hi in windows)
    if span <= 0:
        return None
    tokens = 0
    for r in records:
        before = 0
        for t, so_far in r.progress:  # (run clock, tokens so far), one entry a step
            if any(lo < t <= hi for lo, hi in windows):
                tokens += so_far - before
            before = so_far
    return tokens / span
