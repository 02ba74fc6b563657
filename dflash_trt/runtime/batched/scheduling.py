"""Admission and scheduling for the batched runtime: requests, the rows that run, and their slots.

Each running sequence owns one row ("slot") of the preallocated caches; ``rows[i].slot == i``
between steps, so the running rows are always slots 0..n-1 and a pass over them is one slice.
Newcomers are admitted from a FIFO queue into the next free slots, sorted by prompt length (so a
prefill pass over a run of similar lengths is contiguous); a finished sequence frees its slot and
the last rows move into the holes (compaction: a copy per departure, never per step).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.metrics import GenerationStats
from dflash_trt.runtime.decoding.results import GenerationResult, StepCallback, truncate_at_stop
from dflash_trt.sampling_params import GREEDY, SamplingParams


@dataclass
class SequenceRequest:
    prompt_ids: list[int]
    params: SamplingParams = GREEDY  # max_tokens None: 256; stop_token_ids end the sequence
    on_step: StepCallback | None = None  # called with each step's new tokens; True stops the sequence


@dataclass
class BatchedSequence:
    """Handle of one sequence in the runtime; `result` is set when it finishes."""

    request: SequenceRequest
    added_at: float = field(default_factory=time.perf_counter)
    order: int = 0  # its place in the order of add() calls
    result: GenerationResult | None = None
    # runtime state
    slot: int = -1
    out: list[int] = field(default_factory=list)
    start: int = 0  # positions in the target KV cache (committed tokens minus the pending one)
    draft_len: int = 0  # context positions already in the draft KV cache
    drafted_last: bool = False  # its previous step drafted: the drafter's backlog is that step's commits only
    stats: GenerationStats = field(default_factory=GenerationStats)
    t0: float = 0.0  # admission time (ttft_s and total_time_s are measured from here)
    generator: torch.Generator | None = None
    stop: frozenset[int] = frozenset()
    budget: int = 0  # tokens it may generate (its params' max_tokens, resolved)
    error: str | None = None  # why this sequence failed alone (its batch went on); set when it finished
    # with capture_layer_ids: the target's features [fed positions, n*H] (bfloat16), set at finish
    features: torch.Tensor | None = None
    # prefix caching (runtime/batched/prefix_cache.py): what the lookup at admission found (None: the runtime
    # has no prefix cache), and the blocks of this sequence already offered to the cache
    prefix: Any = None  # PrefixHit
    published: int = 0
    prompt_offered: bool = False  # its prompt's blocks went to the cache (once its drafter consumed them)
    # the drafter attends to context positions >= this (0: all of them; a TensorRT-LLM-like drafter
    # blind to a cached prefix, measured by scripts/context_recompute_tail.py, starts it later)
    context_floor: int = 0

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def queue_s(self) -> float:
        return (self.t0 - self.added_at) if self.t0 else time.perf_counter() - self.added_at

    @property
    def remaining(self) -> int:
        return self.budget - len(self.out)

    @property
    def cached(self) -> int:
        """Prompt positions copied from the prefix cache at admission (0: none, or no cache)."""
        return self.prefix.tokens if self.prefix is not None else 0

    @property
    def backlog(self) -> int:
        """Context positions the drafter has not consumed yet (>= 1 while it decodes)."""
        return self.start - self.draft_len


def commit(seq: BatchedSequence, new: list[int]) -> bool:
    """Append a step's tokens (already capped at its budget) to `seq`; True when it is finished."""
    new, stopped = truncate_at_stop(new, seq.stop)
    seq.out.extend(new)
    cb = seq.request.on_step
    if cb is not None and cb(new):
        stopped = True
    return stopped or seq.remaining <= 0


def sampling_failure(params: SamplingParams) -> str:
    """Why a row whose sampling had no distribution ended (it fails alone, nothing committed)."""
    return (f"sampling failed: temperature={params.temperature} top_p={params.top_p} gives no probability "
            f"distribution over the vocabulary (the tempered logits overflow); send a larger temperature "
            f"(or 0 for greedy decoding)")


# A prefill pass pads every prompt to its longest one. On a CPU, where a padded token costs what a
# real one does (the pass is compute-bound: the embedded pair's mixed-length prompts at C=16 padded
# 29% of its tokens), newcomers are sorted by length and split into passes wherever padding would
# pass this share of a pass's tokens. On a GPU one pass: its cost there is launches, not tokens.
CPU_PREFILL_PAD_LIMIT = 0.15


def prefill_runs(lengths: Sequence[int], pad_limit: float) -> list[int]:
    """Sizes of consecutive runs of `lengths` (ascending), one prefill pass each: a run takes the
    next prompt while its padding to that (longest) prompt stays <= `pad_limit` of its tokens."""
    runs: list[int] = []
    count = total = 0
    for L in lengths:
        if count and (count + 1) * L - (total + L) > pad_limit * (count + 1) * L:
            runs.append(count)
            count = total = 0
        count, total = count + 1, total + L
    return runs + [count] if count else runs


# The row table a decoding step sends to the device: one int64 row per pass row, these columns.
# Padding rows (static shapes: rows beyond the running ones) are all zeros: not live, so their
# passes write only to the dump index.
START, DRAFTED, PENDING, LIVE, FLOOR = range(5)
TABLE_COLUMNS = 5


def row_table(seqs: Sequence[BatchedSequence], rows: int) -> list[list[int]]:
    """[rows, 5]: each running row's start, drafter position (draft_len) and pending token (its last
    output, not yet in the target's cache), live = 1, and the first context position its drafter
    attends to (context_floor, 0 but when measuring a blind drafter); then padding rows up to `rows`."""
    table = [[s.start, s.draft_len, s.out[-1], 1, s.context_floor] for s in seqs]
    return table + [[0] * TABLE_COLUMNS] * (rows - len(seqs))


class Scheduler:
    """The waiting queue and the running rows (slots 0..n-1) of one runtime."""

    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.max_batch, self.device = max_batch, device
        self.rows: list[BatchedSequence] = []  # rows[i].slot == i
        self.waiting: deque[BatchedSequence] = deque()
        self._added = 0  # add() calls so far: BatchedSequence.order

    def queue(self, request: SequenceRequest, budget: int) -> BatchedSequence:
        seq = BatchedSequence(request, budget=budget, order=self._added)
        self._added += 1
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    def admit(self, prefill_len: Callable[[BatchedSequence], int] | None = None) -> list[BatchedSequence]:
        """Move waiting sequences into free slots (shortest prefill first); returns the newcomers.
        `prefill_len(seq)`: the prompt tokens its prefill computes (default: all of them; with a
        prefix cache, those after its cached prefix)."""
        new: list[BatchedSequence] = []
        while self.waiting and len(self.rows) + len(new) < self.max_batch:
            new.append(self.waiting.popleft())
        length = prefill_len or (lambda s: len(s.request.prompt_ids))
        new.sort(key=length)  # slots by prefill length: prefill runs are contiguous
        for seq in new:
            params = seq.request.params
            seq.slot, seq.t0 = len(self.rows), time.perf_counter()
            seq.stats = GenerationStats(num_prompt_tokens=len(seq.request.prompt_ids))
            seq.stop = frozenset(params.stop_token_ids)
            seq.generator = (torch.Generator(device=self.device).manual_seed(params.seed)
                             if params.seed is not None else None)
            self.rows.append(seq)
        return new

    def compact(self, finished: Sequence[BatchedSequence], move_row: Callable[[BatchedSequence, int], None]) -> None:
        """Drop `finished` from the rows; the last rows move into their slots (`move_row(seq, hole)`
        copies a mover's cache rows before its slot changes)."""
        gone = {id(s) for s in finished}
        keep = [s for s in self.rows if id(s) not in gone]
        holes = sorted(s.slot for s in finished if 0 <= s.slot < len(keep))
        movers = sorted((s for s in keep if s.slot >= len(keep)), key=lambda s: s.slot)
        for hole, s in zip(holes, movers):
            move_row(s, hole)
            s.slot = hole
        self.rows = sorted(keep, key=lambda s: s.slot)
        for s in finished:
            s.slot = -1
