"""The DFlash2 proposer: DFlash's pass (dflash_proposer.py), the candidate selector's walk for drafts.

The pass is v1's: a DFlash2 drafter's layers carry their convolutions inside (runtime/drafters/dflash2.py),
over the block's slots only -- a row's context reaches the drafter through K/V, never as slots
-- so the taps never cross from the context, or from another row, into a block. What differs is
how the slots' hidden states become drafts: the selector walks slots 1..k from the anchor (the
row's pending token), each slot choosing among the top-k of its logits by the candidate scores
given the previous choice (:meth:`CandidateSelector.walk`).

- greedy: every row walks the argmax of its scores (what z-lab 0.1.0 and the reference loop do
  at temperature 0);
- sampled (draft method probabilistic): each sampled row draws its walk from softmax(scores / T)
  over the candidates (no top-p on q, as z-lab), a seeded row with its own generator slot after
  slot (the reference loop's draws for it), unseeded rows of one temperature together; the q rows
  go to the rejection test, zero off each slot's candidates.

The walk runs on the device, k small steps of a few kernels each, and reads nothing back: the
step's one device-to-host read (runtime/batched/runtime.py) stays its only sync, and with static shapes
the walk is part of the captured draft pass. A DFlash2 drafter ranks its whole vocabulary (the
codebooks have a row per token), so it never drafts over a draft_vocab.json subset
(runtime/drafters/loading.py refuses one beside it).
"""

from __future__ import annotations

import torch

from dflash_trt.runtime.drafters.dflash2 import DFlash2DraftModel, argmax_choice, scatter_q
from dflash_trt.runtime.batched.dflash_proposer import DFlashProposer, DraftReader, Proposal
from dflash_trt.runtime.decoding.sampling import StepSampling, checked_probs, draw, greedy
from dflash_trt.runtime.targets.adapter import TargetAdapter


class DFlash2Proposer(DFlashProposer):
    draft: DFlash2DraftModel

    def __init__(self, draft: DFlash2DraftModel, target: TargetAdapter, max_batch: int, capacity: int,
                 use_draft_vocab: bool = True) -> None:
        super().__init__(draft, target, max_batch, capacity, use_draft_vocab=False)  # the walk ranks every token

    def reader(self, hidden: torch.Tensor, anchor: torch.Tensor) -> DraftReader:
        """The whole walk at once (each slot depends on the one before), read as far as a caller gets."""
        path = self.greedy(hidden, anchor)  # [n, k]
        return lambda rows, lo, hi: path[rows, lo:hi]

    def greedy(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """[N, k, H] and the anchors [N] -> the argmax walk [N, k]."""
        return self.draft.candidate_selector.walk(hidden, self.logits(hidden), anchor, argmax_choice)[0]

    def sampled(self, hidden: torch.Tensor, anchor: torch.Tensor, sampling: StepSampling) -> Proposal:
        """The walk with each sampled row drawing its choices (see the module doc)."""
        logits = self.logits(hidden)  # [N, k, V]
        bad = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        q_slots: list[list[torch.Tensor]] = [[] for _ in sampling.groups]  # per group, per slot: [m, K]

        def choose(scores: torch.Tensor) -> tuple[torch.Tensor, None]:  # scores [N, K]
            index = greedy(scores)  # greedy rows
            for i, g in enumerate(sampling):
                q, ok = checked_probs(scores[g.rows], g.temperature)  # [m, K]
                index[g.rows] = draw(q, g.generator)
                bad[g.rows] |= ~ok
                q_slots[i].append(q)
            return index, None

        path, candidates, _ = self.draft.candidate_selector.walk(hidden, logits, anchor, choose)
        V = logits.shape[-1]
        probs = tuple(scatter_q(torch.stack(q, 1), candidates[g.rows], V) for q, g in zip(q_slots, sampling))
        return Proposal(path, probs, bad)
