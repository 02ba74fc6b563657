"""Drafting as a proposer: one DFlash drafter pass over a batch of rows -> k draft tokens a row.

As vLLM's v1/spec_decode keeps one proposer per file, the batched runtime asks a proposer for
drafts and verifies them elsewhere (target_passes.py). :func:`make_proposer` picks the proposer of
the drafter's family, detected from its checkpoint (runtime/drafters/families.py): this file's
:class:`DFlashProposer` for DFlash v1, runtime/batched/dflash2_proposer.py for DFlash2. The passes never
ask which family runs.

The pass is every family's (:meth:`DFlashProposer.hidden`). It covers, per row,

    context  the target features of the positions the drafter has not consumed yet (its backlog:
             the last step's commits; after a prompt or plain steps, more), padded to C columns
    block    [pending, MASK x (B-1)], the full trained block at positions start .. start+B-1

and returns the hidden states of the block's slots 1..k (slot j predicts position start+j). The
whole block stays the drafter's input, as in the reference loop, so a row's drafts do not depend
on k. A row's context and block are separate inputs of the drafter (context through K/V only), so
whatever a family computes over the block's slots (DFlash2's convolution) never sees the context.

Context K/V go into the draft cache at their positions (padding columns and padding rows write to
the dump index); the block's K/V are written too and overwritten by the next step's context, so
nothing is ever cropped. Everything is computed on the device from the step's row table, so with
static shapes (C = k + 1) the pass is captured as one CUDA graph.

Proposals (the family's part), from the drafter's logits (``compute_logits``: the target's head,
times ``output_multiplier``, soft-capped by ``final_logit_softcapping``):

- greedy (:meth:`DFlashProposer.propose`): v1 takes each slot's argmax, over the drafter's
  frequent-token subset when it ships one (lossless: verification keeps the whole vocabulary);
- sampled (:meth:`DFlashProposer.propose_sampled`, draft method probabilistic): each sampled row
  draws its slots independently from its own tempered nucleus distribution q (z-lab 0.1.0), and
  the proposal keeps q for the rejection test; greedy rows of the batch still take the argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.slot_caches import BatchedDraftCache, additive_mask
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel
from dflash_trt.runtime.drafters.draft_vocab import DraftVocabHead
from dflash_trt.runtime.decoding.sampling import StepSampling, checked_probs, draw, greedy
from dflash_trt.runtime.batched.scheduling import DRAFTED, FLOOR, LIVE, PENDING, START
from dflash_trt.runtime.targets.adapter import TargetAdapter

# drafts of slots lo+1..hi of some rows (indices into the pass's rows) -> [m, hi - lo]
DraftReader = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass
class Proposal:
    """One pass's drafts, with what the rejection test needs of how they were drawn."""

    drafts: torch.Tensor  # [N, k]
    # q [m, k, V] of each sampling group's rows (StepSampling's order), None: every draft is an argmax
    probs: tuple[torch.Tensor, ...] | None = None
    bad: torch.Tensor | None = None  # [N] rows whose draft distribution did not exist (they fail alone)


class DFlashProposer:
    """The DFlash v1 drafter of one batched runtime, with its slot cache (`max_batch` x `capacity`)."""

    def __init__(self, draft: DFlashDraftModel, target: TargetAdapter, max_batch: int, capacity: int,
                 use_draft_vocab: bool = True) -> None:
        self.draft, self.target = draft, target
        self.block_size = draft.block_size  # B
        self.cache = BatchedDraftCache(len(draft.layers), max_batch, capacity)
        self.dump = capacity - 1
        self.head: DraftVocabHead | None = None
        if use_draft_vocab and draft.draft_vocab is not None:
            if int(draft.draft_vocab.max()) >= target.vocab_size:
                raise DFlashError(f"the drafter's draft_vocab.json names token {int(draft.draft_vocab.max())}, beyond the "
                                  f"target's vocabulary ({target.vocab_size}); regenerate it with "
                                  f"`dflash-trt draft-vocab` or delete it")
            self.head = DraftVocabHead(target.model.get_output_embeddings().weight, draft.draft_vocab)

    # -- what the runtime asks for ---------------------------------------------------------------
    def propose(self, table: torch.Tensor, features: torch.Tensor, k: int, context: int, width: int,
                first_slot: int = 0) -> torch.Tensor:
        """Greedy drafts [N, k] for the N rows of the step's row table [N, 5] (slots first_slot..
        first_slot+N-1: a shadow draft runs one row of the batch), reading their context from
        `features` [slots, capacity, n*H] in `context` columns (>= every row's backlog), with a mask
        `width` keys wide (>= every row's start + B)."""
        return self.greedy(self.hidden(table, features, k, context, width, first_slot), table[:, PENDING])

    def propose_sampled(self, table: torch.Tensor, features: torch.Tensor, k: int, context: int, width: int,
                        sampling: StepSampling) -> Proposal:
        """As :meth:`propose`, with the rows `sampling` samples drawing their drafts from q."""
        return self.sampled(self.hidden(table, features, k, context, width), table[:, PENDING], sampling)

    def reader(self, hidden: torch.Tensor, anchor: torch.Tensor) -> DraftReader:
        """Greedy drafts read from the pass's hidden states [n, k, H] only as far as a caller gets
        (chunked verification): v1's slots are independent, so only the slots read are projected."""
        return lambda rows, lo, hi: self.argmax(hidden[rows, lo:hi])

    # -- the family's proposals --------------------------------------------------------------------
    def greedy(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """[N, k, H] -> each slot's argmax [N, k] (v1: the anchor plays no part)."""
        return self.argmax(hidden)

    def sampled(self, hidden: torch.Tensor, anchor: torch.Tensor, sampling: StepSampling) -> Proposal:
        """Each sampled row's slots drawn independently from q = its tempered nucleus distribution
        of the drafter's logits (z-lab 0.1.0), with q scattered over the target's vocabulary."""
        logits = self.logits(hidden)  # [N, k, N_vocab]: the draft vocabulary's or the whole one
        drafts = greedy(logits)
        bad = torch.zeros(drafts.shape[0], dtype=torch.bool, device=drafts.device)
        probs = []
        for g in sampling:
            q, ok = checked_probs(logits[g.rows], g.temperature, g.top_p)  # [m, k, N_vocab]
            drafts[g.rows] = draw(q.reshape(-1, q.shape[-1]), g.generator).view(q.shape[:-1])
            bad[g.rows] = ~ok.all(dim=-1)
            probs.append(self.over_vocabulary(q))
        return Proposal(self.vocabulary_ids(drafts), tuple(probs), bad)

    # -- the draft head ------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's logits [..., N] of hidden states [..., H]: over its draft vocabulary (N of
        them) when it ships one, else over the target's."""
        return self.draft.compute_logits(hidden, self.head.proj if self.head is not None else self.target.lm_head)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] -> the drafter's argmax token ids [...] (target ids)."""
        return self.vocabulary_ids(greedy(self.logits(hidden)))

    def vocabulary_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into :meth:`logits`' last dimension -> target token ids."""
        return self.head.token_ids[index] if self.head is not None else index

    def over_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over :meth:`logits`' entries [..., N] -> over the target's vocabulary [..., V]."""
        if self.head is None:
            return q
        full = torch.zeros(*q.shape[:-1], self.target.vocab_size, dtype=q.dtype, device=q.device)
        return full.index_copy_(-1, self.head.token_ids, q)

    # -- the pass --------------------------------------------------------------------------------------
    def hidden(self, table: torch.Tensor, features: torch.Tensor, k: int, context: int, width: int,
               first_slot: int = 0) -> torch.Tensor:
        """The drafter's pass (see the module doc) up to the hidden states of the draft slots
        [N, k, H] (index j: slot j+1), before the head; the table's rows sit in slots first_slot.."""
        dev, B = table.device, self.block_size
        N = table.shape[0]
        start, drafted, live = table[:, START], table[:, DRAFTED], table[:, LIVE]
        cols = torch.arange(context, device=dev)
        backlog = (start - drafted) * live  # [N]: padding rows have none
        ctx_ok = cols[None, :] < backlog[:, None]  # [N, C]
        # a column past a row's backlog reads the row's last committed position: finite, never written
        ctx_pos = torch.where(ctx_ok, drafted[:, None] + cols, (start[:, None] - 1).clamp(min=0))  # [N, C]
        block = torch.full((N, B), self.draft.mask_token_id, dtype=torch.long, device=dev)  # [N, B]
        block[:, 0] = table[:, PENDING]
        block_pos = start[:, None] + torch.arange(B, device=dev)  # [N, B]
        block_write = torch.where(live[:, None] > 0, block_pos, self.dump)
        draft_pos = torch.cat([ctx_pos, block_pos], dim=1)  # [N, C+B]
        write = torch.cat([torch.where(ctx_ok, ctx_pos, self.dump), block_write], dim=1)
        keys = torch.arange(width, device=dev)
        # [N, 1, 1, W]: context (from the row's floor on: 0 but for a measured blind drafter) and own block
        visible = ((keys[None, :] < (start + B)[:, None]) & (keys[None, :] >= table[:, FLOOR, None]))[:, None, None, :]
        mask = additive_mask(visible, self.target.dtype)
        self.cache.kv.prepare(slice(first_slot, first_slot + N), write, width)
        rows = (first_slot + torch.arange(N, device=dev))[:, None].expand_as(ctx_pos)  # slots [N, C]
        ctx = features[rows, ctx_pos]  # [N, C, n_ctx*H]
        # [N, k, H]: the draft slots only; the whole block is still the drafter's input
        return self.draft(ctx, self.target.embed(block), draft_pos, self.cache, mask, outputs=slice(1, k + 1))

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.kv.move_row(src, dst, length)

    def describe(self) -> dict[str, Any]:
        return {"family": self.draft.family, "block_size": self.block_size,
                "draft_vocab": self.head.size if self.head is not None else None}


def make_proposer(draft: DFlashDraftModel, target: TargetAdapter, max_batch: int, capacity: int,
                  use_draft_vocab: bool = True) -> DFlashProposer:
    """The proposer of `draft`'s family (runtime/drafters/families.py names it, from the checkpoint)."""
    from dflash_trt.runtime.drafters.families import FAMILIES

    return FAMILIES[draft.family].proposer_class()(draft, target, max_batch, capacity, use_draft_vocab)
