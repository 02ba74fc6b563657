"""Acceptance measured without verifying: one row drafts during a plain step, and the tokens plain
decoding commits next grade its drafts.

Why. The adaptive policy learns acceptance only from drafts that are graded, so a policy that
decodes plainly (a large batch on a compute-bound device) re-explores now and then to notice that
traffic turned predictable. A re-exploration that drafts for real verifies k drafts on every row:
at 16 rows on one CPU core two k = 1 steps cost ~2.9 plain steps where plain decoding spends 2,
~1.1-1.5% of a 127-step run (bench, issue 44), to learn what the drafter would have got accepted.

Here one greedy row runs the drafter's pass alone during a plain step, and the next tokens plain
decoding commits for it grade the drafts as verification would have: slot j is accepted when
drafts 1..j equal the row's next j tokens. For a greedy row this is exact, not an estimate:
verification commits the target's greedy tokens, the same tokens plain decoding commits, and the
drafts are bit for bit those a drafting step would verify for that row (the drafter's pass covers
the whole trained block whatever k is, and the CPU's panel kernel computes each row independently
of its batch; tests/test_shadow_drafts.py checks it against real drafting steps). The pass costs
one row's drafter pass, no verification: ~0.05% of the plain steps between two of them.

The grade is known once a draft disagrees with a committed token, every draft was matched, or the
row finished (then the drafts past its end were never graded: they count as not drafted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash_trt.runtime.batched.scheduling import BatchedSequence

Observe = Callable[[int, int], None]  # (drafted, accepted): SpeculationPolicy.observe_acceptance


def accepted_prefix(drafts: Sequence[int], committed: Sequence[int]) -> int:
    """Drafts accepted by exact match: the longest prefix of `drafts` equal to `committed`'s."""
    a = 0
    for d, t in zip(drafts, committed):
        if d != t:
            break
        a += 1
    return a


@dataclass
class ShadowDraft:
    """One row's ungraded drafts: draft j (1-based) predicts ``seq.out[base + j - 1]``."""

    seq: BatchedSequence
    base: int  # len(seq.out) when the row drafted, before that step's commit
    drafts: list[int]

    def grade(self) -> tuple[int, int] | None:
        """(drafted, accepted) once the grade is known, else None."""
        committed = self.seq.out[self.base : self.base + len(self.drafts)]
        a = accepted_prefix(self.drafts, committed)
        if a < len(committed) or len(committed) == len(self.drafts):  # a disagreement, or all graded
            return len(self.drafts), a
        if self.seq.done:  # finished with every committed token matched: the rest was never graded
            return (len(committed), a) if committed else (0, 0)
        return None


class ShadowDrafts:
    """The runtime's shadow drafts (at most one row at a time) until plain decoding grades them."""

    def __init__(self) -> None:
        self.pending: list[ShadowDraft] = []
        self.drafted = 0  # shadow passes run (runtime stats)

    def row(self, seqs: Sequence[BatchedSequence]) -> BatchedSequence | None:
        """The row a shadow draft runs on now: a greedy row (its grade is exact), the one with the
        most tokens left to grade the drafts with; None while one is pending or no row is greedy."""
        if self.pending:
            return None
        greedy = [s for s in seqs if s.request.params.greedy and s.remaining > 0]
        return max(greedy, key=lambda s: s.remaining) if greedy else None

    def add(self, seq: BatchedSequence, drafts: list[int]) -> None:
        """`seq` drafted `drafts` in the step now running, before its commit."""
        self.pending.append(ShadowDraft(seq, len(seq.out), drafts))
        self.drafted += 1

    def grade(self, observe: Observe) -> None:
        """After a step's commits: report every draft whose grade is now known."""
        still = []
        for p in self.pending:
            result = p.grade()
            if result is None:
                still.append(p)
            elif result[0] > 0:
                observe(*result)
        self.pending = still
