"""The target's passes in the batched runtime: prefill (eager) and verification (static or eager).

Both write their K/V into the slot caches at explicit indices (slot_caches.py) and, when the
drafter needs them, the target's features at the same indices into ``features`` [slots,
capacity, n*H]: the drafter reads its context from there by position.

Verification over the step's row table (scheduling.row_table: start, drafter position, pending
token, live per row) and the k drafts of each row computes positions, write indices and the
causal mask on the device, from the table alone: a captured graph reads nothing else, and the
host sends one small table per step.

    ids      = [pending, draft_1..k]                 [N, k+1]
    post[j]  = the target's token after ids[j]       [N, k+1]
    accepted = longest prefix with draft_j == post[j-1]    (exact match: lossless at temperature 0)

A step whose rows sample verifies each sampled row by exact match against its own samples (draft
method match) or by rejection sampling against the proposal's q (greedy, probabilistic;
runtime/decoding/rejection.py), whose committed tokens take the place of the posterior: drafts 1..a, then
the residual's or the bonus's draw at index a.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_trt.checkpoints.placement import home_device
from dflash_trt.runtime.batched.slot_caches import BatchedKVCache, additive_mask
from dflash_trt.runtime.gpu.host_transfers import HostTransfers
from dflash_trt.runtime.batched.dflash_proposer import DraftReader, Proposal
from dflash_trt.runtime.decoding.rejection import rejection_rows
from dflash_trt.runtime.decoding.sampling import StepSampling, greedy, sample_rows
from dflash_trt.runtime.batched.scheduling import LIVE, PENDING, START, BatchedSequence, prefill_runs
from dflash_trt.runtime.batched.step_shapes import EAGER_WIDTH_MULTIPLE, round_up
from dflash_trt.runtime.targets.adapter import TargetAdapter


def accepted_lengths(ids: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """ids, post [N, k+1] -> a [N]: drafts ids[1..a] equal the target's own tokens post[0..a-1]."""
    if ids.shape[1] == 1:
        return torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    return (ids[:, 1:] == post[:, :-1]).int().cumprod(dim=1).sum(dim=1)


class TargetPasses:
    """The target over `max_batch` slot caches of `capacity` positions (the last is the dump index)."""

    def __init__(self, target: TargetAdapter, max_batch: int, capacity: int, layer_ids: Sequence[int],
                 transfers: HostTransfers) -> None:
        self.target = target
        self.cache = BatchedKVCache(target.num_layers, max_batch, capacity)
        self.dump = capacity - 1
        self.layer_ids = tuple(layer_ids)
        self.transfers = transfers
        # [slots, capacity, n*H] target features by position, allocated once (a graph may write it)
        self.features: torch.Tensor | None = None
        if self.layer_ids:
            self.features = torch.zeros((max_batch, capacity, len(self.layer_ids) * target.hidden_size),
                                        dtype=target.dtype, device=home_device(target.model))

    def forward(self, rows: slice | torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                mask: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Target pass over slots `rows` (a slice, or slot indices): ids/positions/write [n, S], additive
        mask [n, 1, S, W] -> logits [n, S', V]. Captured features go to `features` at the write indices."""
        self.cache.kv.prepare(rows, write, mask.shape[-1])
        logits, feats = self.target.forward(ids, positions, self.cache, self.layer_ids, logits_to_keep, mask)
        if feats is not None and self.features is not None:  # [n, S, n_ctx*H]
            self.features[self.cache.kv.write_rows, write] = feats.to(self.features.dtype)
        return logits

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.kv.move_row(src, dst, length)
        if self.features is not None:
            self.features[dst, :length] = self.features[src, :length]

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, new: list[BatchedSequence], pad_limit: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The newcomers' prompts (contiguous slots, ascending length to compute: after a cached
        prefix, the rest) in one left-padded pass per run of similar lengths -> first tokens [m] and which rows had no distribution to sample
        from ([m], None when all are greedy)."""
        tokens, bads, i = [], [], 0
        for n in prefill_runs([len(s.request.prompt_ids) - s.cached for s in new], pad_limit):
            t, b = self._prefill_pass(new[i : i + n])
            tokens.append(t)
            bads.append(b if b is not None else torch.zeros(n, dtype=torch.bool, device=t.device))
            i += n
        any_sampled = any(not s.request.params.greedy for s in new)
        return torch.cat(tokens), torch.cat(bads) if any_sampled else None

    def _prefill_pass(self, new: list[BatchedSequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompts of `new` (contiguous slots) in one pass -> first tokens [m], bad [m] | None.

        A row whose first `s.cached` positions came from the prefix cache (their K/V already in its
        slot) computes only the rest, at their own positions: with every linear layer batch-invariant
        (the CPU's panel kernel) and attention per query row over the same keys, its logits, K/V and
        features are those of the whole prompt's prefill bit for bit (tests/test_prefix_cache.py)."""
        S = max(len(s.request.prompt_ids) - s.cached for s in new)
        ids, pos, write = [], [], []
        for s in new:
            prompt, c = list(s.request.prompt_ids), s.cached
            pad = S - (len(prompt) - c)
            ids.append([0] * pad + prompt[c:])
            pos.append([0] * pad + list(range(c, len(prompt))))
            write.append([self.dump] * pad + list(range(c, len(prompt))))
        ids_t, pos_t, write_t = self.transfers.upload([ids, pos, write]).unbind(0)  # [m, S] each, one upload
        W = round_up(max(len(s.request.prompt_ids) for s in new), EAGER_WIDTH_MULTIPLE, self.dump)
        keys = torch.arange(W, device=ids_t.device)
        visible = (keys[None, None, None, :] <= pos_t[:, None, :, None]) & (write_t[:, None, :, None] != self.dump)
        visible = visible | (keys == 0)  # pad queries: see something (their output is discarded)
        rows = slice(new[0].slot, new[-1].slot + 1)
        logits = self.forward(rows, ids_t, pos_t, write_t, additive_mask(visible, self.target.dtype),
                              logits_to_keep=1)  # [m, 1, V]
        sampling = StepSampling([s.request.params for s in new], [s.generator for s in new], ids_t.device)
        tokens, bad = sample_rows(logits, sampling)
        return tokens[:, -1], bad

    # -- verification ---------------------------------------------------------------------------
    def verify_logits(self, table: torch.Tensor, drafts: torch.Tensor | None, width: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the N rows of `table` [N, 5] and their drafts [N, k] (None: k = 0) with
        masks `width` keys wide -> (ids [N, k+1], logits [N, k+1, V]). Padding rows write only to the
        dump index."""
        pending = table[:, PENDING : PENDING + 1]  # [N, 1]
        ids = pending if drafts is None else torch.cat([pending, drafts], dim=1)  # [N, k+1]
        positions = table[:, START, None] + torch.arange(ids.shape[1], device=ids.device)  # [N, k+1]
        write = torch.where(table[:, LIVE, None] > 0, positions, self.dump)
        keys = torch.arange(width, device=ids.device)
        visible = keys[None, None, None, :] <= positions[:, None, :, None]  # causal, per-row offset
        mask = additive_mask(visible, self.target.dtype)  # [N, 1, k+1, W]
        return ids, self.forward(slice(0, ids.shape[0]), ids, positions, write, mask)

    def verify_greedy(self, table: torch.Tensor, drafts: torch.Tensor | None, width: int) -> torch.Tensor:
        """Greedy verification -> [N, k+2]: the posterior post [N, k+1] and the accepted count a [N]
        side by side (one tensor: one read for the host)."""
        ids, logits = self.verify_logits(table, drafts, width)
        post = greedy(logits)  # [N, k+1]
        return torch.cat([post, accepted_lengths(ids, post)[:, None]], dim=1)

    def verify_sampled(self, table: torch.Tensor, proposal: Proposal | None, width: int, sampling: StepSampling,
                       rejection: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification of a step whose rows sample (each with its own parameters) -> ([n, k+2] as
        verify_greedy, bad [n]: rows whose sampling had no distribution). Greedy rows take the argmax
        and the exact match; sampled rows the exact match against their own samples, or with
        `rejection` the rejection test against the proposal's q (one-hot where its drafts are
        argmaxes: draft method greedy). Every draw on the device: no host sync."""
        drafts = proposal.drafts if proposal is not None else None
        ids, logits = self.verify_logits(table, drafts, width)
        if not rejection or drafts is None:  # k = 0 is plain sampling, whatever the method
            post, bad = sample_rows(logits, sampling)
            accepted = accepted_lengths(ids, post)
        else:
            post = greedy(logits)  # [n, k+1]: the greedy rows'; rejection_rows fills in the sampled ones
            accepted = accepted_lengths(ids, post)
            bad = rejection_rows(drafts, logits, proposal.probs, sampling, post, accepted)
        if proposal is not None and proposal.bad is not None:  # its drafts had no distribution to come from
            bad = proposal.bad if bad is None else bad | proposal.bad
        return torch.cat([post, accepted[:, None]], dim=1), bad

    def verify_chunked(self, table: torch.Tensor, drafts: DraftReader, k: int, width: int, chunk: int) -> torch.Tensor:
        """Greedy verification as :meth:`verify_greedy`, in chunks of `chunk` positions: a row goes on
        to its next chunk only while every draft so far was accepted, and its k drafts are read
        (`drafts`: the proposer's reader over the pass's hidden states) only as far as it gets.

        For a compute-bound CPU and a long fixed k: the gate verifies K = 15 drafts a step and accepts
        ~1 (tau ~1.9 with the embedded pair), so one pass computes 16 positions a row where ~2 decide
        anything; in chunks of 4 the target and both heads compute ~5. The same tokens and counts as
        one pass: a position's logits depend only on the positions before it (causal attention over
        the cache), and the positions a row never reaches could only have been rejected or unread (the
        one-pass verify writes their K/V too; nothing ever reads it). Positions left unverified hold
        0 in the posterior, past every row's accepted prefix and bonus. Each chunk after the first
        waits for the last one's acceptance (a host sync, counted)."""
        n = table.shape[0]
        dev = table.device
        start = table[:, START]
        ids = torch.zeros((n, k + 1), dtype=torch.long, device=dev)  # [n, k+1]: pending, then drafts as needed
        ids[:, 0] = table[:, PENDING]
        post = torch.zeros((n, k + 1), dtype=torch.long, device=dev)
        accepted = torch.zeros(n, dtype=torch.long, device=dev)
        rows = torch.arange(n, device=dev)  # rows still verifying: drafts 1..lo accepted
        keys = torch.arange(width, device=dev)
        lo = 0
        while True:
            hi = min(lo + chunk, k + 1)
            if hi - 1 > lo:  # drafts of slots lo+1..hi-1 (slot lo: the pending token or a draft already accepted)
                ids[rows, lo + 1 : hi] = drafts(rows, lo, hi - 1)
            positions = start[rows, None] + torch.arange(lo, hi, device=dev)  # [m, c]
            mask = additive_mask(keys[None, None, None, :] <= positions[:, None, :, None], self.target.dtype)
            post[rows, lo:hi] = greedy(self.forward(rows, ids[rows, lo:hi], positions, positions, mask))
            got = (ids[rows, lo + 1 : hi] == post[rows, lo : hi - 1]).int().cumprod(dim=1).sum(dim=1)  # [m]
            accepted[rows] = lo + got
            if hi > k:
                break
            rows = rows[got == hi - 1 - lo]  # every draft of the chunk accepted: the next slot decides
            if rows.numel():
                ids[rows, hi] = drafts(rows, hi - 1, hi)[:, 0]
                rows = rows[ids[rows, hi] == post[rows, hi - 1]]
                accepted[rows] = hi
            self.transfers.syncs += 1  # the row count above is read on the host
            if not rows.numel():
                break
            lo = hi
        return torch.cat([post, accepted[:, None]], dim=1)

