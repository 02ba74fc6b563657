"""Drafting as a proposer: one DFlash drafter pass over a batch of rows -> k draft tokens a row.

As vLLM's v1/spec_decode keeps one proposer per file, the batched runtime asks this one for
drafts and verifies them elsewhere (target_passes.py). A pass covers, per row,

    context  the target features of the positions the drafter has not consumed yet (its backlog:
             the last step's commits; after a prompt or plain steps, more), padded to C columns
    block    [pending, MASK x (B-1)], the full trained block at positions start .. start+B-1

and returns the argmax of the block's slots 1..k (slot j predicts position start+j), over the
drafter's frequent-token subset when it ships one (lossless: verification keeps the whole
vocabulary), else over the target's lm_head. The whole block stays the drafter's input, as in the
reference loop, so a row's drafts do not depend on k.

Context K/V go into the draft cache at their positions (padding columns and padding rows write to
the dump index); the block's K/V are written too and overwritten by the next step's context, so
nothing is ever cropped. Everything is computed on the device from the step's row table, so with
static shapes (C = k + 1) the pass is captured as one CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched_cache import BatchedDraftCache, additive_mask
from dflash_trt.runtime.draft_model import DFlashDraftModel
from dflash_trt.runtime.draft_vocab import DraftVocabHead
from dflash_trt.runtime.scheduling import DRAFTED, LIVE, PENDING, START
from dflash_trt.runtime.target import TargetAdapter


class DFlashProposer:
    """The drafter of one batched runtime, with its slot cache (`max_batch` x `capacity`)."""

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

    def propose(self, table: torch.Tensor, features: torch.Tensor, k: int, context: int, width: int) -> torch.Tensor:
        """Drafts [N, k] for the N rows of the step's row table [N, 4], reading their context from
        `features` [slots, capacity, n*H] in `context` columns (>= every row's backlog), with a mask
        `width` keys wide (>= every row's start + B)."""
        return self.tokens(self.hidden(table, features, k, context, width))

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft slots' hidden states [..., H] -> their token ids [...]."""
        if self.head is not None:
            return self.head(hidden)
        return self.target.lm_head(hidden).argmax(-1)

    def hidden(self, table: torch.Tensor, features: torch.Tensor, k: int, context: int, width: int) -> torch.Tensor:
        """The drafter's pass (see :meth:`propose`) up to the hidden states of the draft slots
        [N, k, H] (index j: slot j+1), before the head."""
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
        visible = (keys[None, :] < (start + B)[:, None])[:, None, None, :]  # [N, 1, 1, W]: context and own block
        mask = additive_mask(visible, self.target.dtype)
        self.cache.kv.prepare(slice(0, N), write, width)
        rows = torch.arange(N, device=dev)[:, None].expand_as(ctx_pos)
        ctx = features[rows, ctx_pos]  # [N, C, n_ctx*H]
        # [N, k, H]: the draft slots only; the whole block is still the drafter's input
        return self.draft(ctx, self.target.embed(block), draft_pos, self.cache, mask, outputs=slice(1, k + 1))

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.kv.move_row(src, dst, length)

    def describe(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "draft_vocab": self.head.size if self.head is not None else None}
