"""The DFlash training objective on ONE sequence, many blocks in one drafter forward.

For a sequence of T tokens with precomputed target features ``feats [T, n*H]`` and anchors
``a_1..a_A`` inside the response:

    block i   = [ids[a_i], MASK x (B-1)]           at positions a_i .. a_i+B-1
    queries   = the A*B block tokens, concatenated
    keys      = the T context positions, then the A*B block tokens
    visible   = (key is context AND key position < a_i)  OR  (key is in block i)
    label     = slot k of block i predicts ids[a_i + k]  (k = 1..B-1; no shift, as at inference)
    loss      = sum_k w_k CE_k / sum_k w_k,   w_k = exp(-(k-1)/gamma)

This reproduces exactly what a block sees at inference: the draft KV cache holds the context
K/V of every committed position before the block's first token, and the block attends to
itself bidirectionally. Early slots get more weight because a block is only accepted up to its
first miss, so slot 1 matters in every step and slot 15 only in the best ones.

A DFlash2 drafter (runtime/drafters/dflash2.py) proposes by its candidate selector's walk, so its loss
adds the selector's objective, as speculators 0.9.0 trains it (``models/dflash2/metrics.py``):
a teacher-forced K-way cross-entropy over the runtime's own candidate set. For slot k of block i,
with h its final hidden state, U = its draft logits and y = its label:

    C         = top-K ids of U (the candidates the walk sees; no gradient through the choice),
                with y put in place of the weakest when it is missing (y then sits at rank K)
    prev      = ids[a_i + k - 1]     (the anchor for k = 1: the TRUE previous token)
    s_c       = U_c + sum_r A[prev, r] * g_r * Bc[c, r],   g = hidden_projection(h),  c in C
    sel_k     = -log softmax(s)_y    (cross-entropy over the K candidates)
    loss      = block loss + alpha * sum_k w_k sel_k / sum_k w_k      (alpha: selector_loss_weight)

The gradient reaches the codebooks A, Bc, the projection, and through U_c and h the drafter's
body too (as in speculators: U is not detached). Teacher forcing is exact for what matters: the
walk's step k only counts while slots 1..k-1 were accepted, i.e. while its predecessor IS the
true previous token. Hard labels: the labels are the target's greedy answers (its argmax), the
hard target speculators takes as well (``targets.argmax``). The figures then follow the walk:
slot k is a hit when y is among the top-K and wins the selector's scores, so tau_est is the
expected acceptance length of the walk's proposals (speculators' ``eal``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_trt.runtime.drafters.dflash import DFlashDraftModel


def default_gamma(block_size: int) -> float:
    """The DFlash paper's loss decay: 7 for B=16, 4 for B=8 (in between: interpolated)."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0))


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `num_anchors` distinct anchor positions in [prompt_len, seq_len-2], sorted. [A]

    An anchor at p means: the token at p is known (the last committed token, not yet verified),
    context is positions < p. p = prompt_len is the first step after prefill.
    """
    lo, hi = prompt_len, seq_len - 2  # the last anchor still has one label at seq_len-1
    n = hi - lo + 1
    if n <= 0:
        return torch.empty(0, dtype=torch.long)
    pick = torch.randperm(n, generator=generator)[: min(num_anchors, n)]
    return (pick + lo).sort().values


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block tokens, positions, labels and label validity for anchors. Shapes: [A, B] each."""
    lens = torch.tensor([ids.shape[0]], device=ids.device)
    return tuple(t[0] for t in batch_block_inputs(ids[None], lens, anchors[None], None, block_size, mask_token_id))


def batch_block_inputs(ids: torch.Tensor, lens: torch.Tensor, anchors: torch.Tensor,
                       anchor_ok: torch.Tensor | None, block_size: int, mask_token_id: int):
    """`block_inputs` for S right-padded sequences: ids [S, T], lens [S], anchors [S, A] (rows
    with fewer anchors are padded; `anchor_ok` [S, A] marks the real ones). Returns [S, A, B] each."""
    T = ids.shape[1]
    offs = torch.arange(block_size, device=ids.device)
    pos = anchors[..., None] + offs  # [S, A, B]
    tokens = torch.full_like(pos, mask_token_id)
    tokens[..., 0] = ids.gather(1, anchors)
    valid = pos < lens[:, None, None]
    if anchor_ok is not None:
        valid &= anchor_ok[..., None]
    labels = torch.where(valid, ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos), torch.zeros_like(pos))
    valid[..., 0] = False  # slot 0 is the given anchor, not a prediction
    return tokens, pos, labels, valid


def attention_mask(seq_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [1, 1, A*B, T + A*B]: context strictly before the anchor, plus the query's own block."""
    return batch_attention_mask(seq_len, anchors[None], block_size)


def batch_attention_mask(ctx_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [S, 1, A*B, C + A*B] for anchors [S, A]. Padded context columns (>= a row's own
    length) are never visible: every anchor lies inside its row, and context must precede it."""
    S, A = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [S, A*B]
    ctx_vis = torch.arange(ctx_len, device=dev)[None, None, :] < q_anchor[:, :, None]  # [S, A*B, C]
    q_block = torch.arange(A, device=dev).repeat_interleave(block_size)  # [A*B]
    blk_vis = (q_block[:, None] == q_block[None, :]).expand(S, -1, -1)  # [S, A*B, A*B]
    return torch.cat([ctx_vis, blk_vis], dim=2)[:, None]


def dflash_loss(
    draft: DFlashDraftModel,
    embed: torch.nn.Module,  # target's token embedding (frozen)
    lm_head: torch.nn.Module,  # target's output head (frozen)
    ids: torch.Tensor,  # [T] prompt + response
    feats: torch.Tensor,  # [C, n*H] target features of positions 0..C-1 (C >= T-1: the last token is never context)
    anchors: torch.Tensor,  # [A]
    gamma: float,
    label_map: torch.Tensor | None = None,  # [V] full id -> column of lm_head's output (-1: not there)
    column_ids: torch.Tensor | None = None,  # [V'] token id of each column (with label_map)
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted CE of one sequence's blocks, plus per-slot accuracy figures for logging.

    With `label_map`, `lm_head` scores only a subset of the vocabulary (a sampled softmax) and
    labels are translated into that subset; a label outside it is dropped from the loss.
    """
    lens = torch.tensor([ids.shape[0]], device=ids.device)
    return dflash_loss_batch(draft, embed, lm_head, ids[None], lens, feats[None], anchors[None], None, gamma, label_map,
                             column_ids)


def dflash_loss_batch(
    draft: DFlashDraftModel,
    embed: torch.nn.Module,
    lm_head: torch.nn.Module,
    ids: torch.Tensor,  # [S, T] right-padded
    lens: torch.Tensor,  # [S] real lengths
    feats: torch.Tensor,  # [S, C, n*H] (rows padded past their own length; never visible there)
    anchors: torch.Tensor,  # [S, A] (padded rows: any in-range position, with anchor_ok False)
    anchor_ok: torch.Tensor | None,  # [S, A] bool, or None when every anchor is real
    gamma: float,
    label_map: torch.Tensor | None = None,
    column_ids: torch.Tensor | None = None,  # [V'] token id of each column of lm_head's output (sampled head)
    selector_weight: float = 1.0,  # DFlash2: alpha of the selector's loss (module docstring)
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`dflash_loss` over S sequences in ONE drafter forward (the GPU trainer's step).

    Every label of every sequence weighs the same: the loss is the weighted mean over all of them.
    A DFlash2 drafter adds its selector's loss (:func:`selector_loss`).
    """
    B, C, dev = draft.block_size, feats.shape[1], feats.device
    S = ids.shape[0]
    tokens, pos, labels, valid = batch_block_inputs(ids, lens, anchors, anchor_ok, B, draft.mask_token_id)
    position_ids = torch.cat([torch.arange(C, device=dev).expand(S, -1), pos.flatten(1)], dim=1)  # [S, C + A*B]
    mask = batch_attention_mask(C, anchors, B)
    with torch.no_grad():
        noise = embed(tokens.flatten(1))  # [S, A*B, H]
    hidden = draft(feats.float(), noise, position_ids, None, mask)  # [S, A*B, H]
    sel = valid.reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1])[sel]  # [N, H]: only masked slots pay for the big head
    logits = draft.compute_logits(h, lm_head)  # [N, V] as the runtime's proposals see them
    target = labels.reshape(-1)[sel]
    # the true previous token of each slot: the anchor for slot 1 (labels[..., 0] is the anchor), else slot k-1's label
    prev = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).reshape(-1)[sel]  # [N]
    k = torch.arange(B, device=dev).expand_as(valid).reshape(-1)[sel]  # slot index 1..B-1
    if label_map is not None:
        target = label_map[target]
        keep = target >= 0
        logits, target, k, h, prev = logits[keep], target[keep], k[keep], h[keep], prev[keep]
        valid = valid.masked_scatter(valid, keep)  # the dropped labels count as misses in the stats below
    w = torch.exp(-(k - 1).float() / gamma)
    ce = F.cross_entropy(logits.float(), target, reduction="none")
    loss = (w * ce).sum() / w.sum()
    selector = getattr(draft, "candidate_selector", None)
    figures: dict[str, float] = {}
    if selector is None:
        with torch.no_grad():
            hit = logits.argmax(-1) == target
    else:
        sel_ce, hit = selector_loss(selector, h, logits, target, prev, column_ids)
        sel_loss = (w * sel_ce).sum() / w.sum()
        loss = loss + selector_weight * sel_loss
        figures["selector_loss"] = float(sel_loss.detach())
    with torch.no_grad():
        hit = hit.float()
        # expected accepted length under "accept until first miss" for these blocks
        hits = torch.zeros_like(valid, dtype=torch.float)
        hits[valid] = hit
        run = torch.cumprod(torch.where(valid, hits, torch.zeros_like(hits))[..., 1:], dim=-1).sum(-1)  # [S, A]
        real = anchor_ok if anchor_ok is not None else torch.ones_like(run, dtype=torch.bool)
        stats = {"acc1": float(hit[k == 1].mean()) if (k == 1).any() else math.nan,
                 "tau_est": float(1 + run[real].mean()), **figures}
    return loss, stats


def selector_loss(
    selector: torch.nn.Module,  # runtime/drafters/dflash2.CandidateSelector
    hidden: torch.Tensor,  # [N, H] the slots' final hidden states
    logits: torch.Tensor,  # [N, V'] their draft logits (V' columns: the whole vocabulary or a sample)
    target: torch.Tensor,  # [N] the labels, as columns of `logits`
    prev: torch.Tensor,  # [N] token id of each slot's true previous token
    column_ids: torch.Tensor | None,  # [V'] token id of each column; None: column = token id
) -> tuple[torch.Tensor, torch.Tensor]:  # cross-entropy over the candidates [N], the walk's hits [N] bool
    """The selector's teacher-forced K-way cross-entropy (the module docstring's sel_k), and
    whether the walk, from the true previous token, would propose the label."""
    K = selector.top_k
    cand = logits.detach().topk(K, dim=-1).indices  # [N, K], strongest first: the weakest sits at rank K
    match = cand == target[:, None]
    present = match.any(-1)  # [N] the label is among the candidates the walk sees at run time
    cand[:, -1] = torch.where(present, cand[:, -1], target)
    position = torch.where(present, match.long().argmax(-1), K - 1)  # [N] the label's column in cand
    tokens = cand if column_ids is None else column_ids[cand]  # [N, K] token ids, for the codebooks
    g = selector.hidden_projection(hidden)  # [N, r]
    context = selector.predecessor_codebook[prev] * g  # [N, r]
    transition = torch.einsum("nr,nkr->nk", context, selector.successor_codebook[tokens])  # [N, K]
    scores = logits.gather(-1, cand).float() + transition.float()  # [N, K]
    ce = F.cross_entropy(scores, position, reduction="none")
    with torch.no_grad():
        hit = present & (scores.argmax(-1) == position)
    return ce, hit
