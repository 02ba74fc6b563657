"""Rejection sampling of a block of drafts (speculative sampling: Leviathan et al. 2023, Chen et
al. 2023), for n rows at once.

A step drafted x_0..x_{k-1} from the drafter's distributions q_0..q_{k-1} and ran the target over
[anchor, x_0..x_{k-1}], which gives p_0..p_k: p_j is the target's (tempered, nucleus) distribution
of the token after the first j drafts. Then, slot by slot:

    accept x_j with probability min(1, p_j(x_j) / q_j(x_j))        (u_j ~ U(0, 1): u_j * q_j < p_j)

and at the first rejection a draw from the residual ``max(0, p_j - q_j)`` normalised; after k
accepts a draw from p_k (the bonus). Why the output is exactly the target's: the token emitted at
slot j is x_j with probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), or, after a rejection
(probability 1 - sum_x min(q(x), p(x))), a draw from the residual, whose mass at x is
(p(x) - min(q(x), p(x))) / (1 - sum min(q, p)); the two add up to p(x). The drafts need not come
from the argmax or from any particular q: only q must be the distribution they WERE drawn from.

q comes in one of three shapes (speculation.py, ``draft_method``):
- argmax drafts: q is one-hot at x (accept with probability p(x); the residual is p without x),
  which step by step is the distribution of exact-match acceptance;
- DFlash v1's sampled drafts: each slot's tempered nucleus distribution;
- DFlash2's sampled walk: softmax(scores / T) over the slot's K candidates, zero elsewhere.

z-lab dflash 0.1.0's ``_rejection_sample`` does this for one row; here every row of a batch at
once, with its random numbers drawn in the same order and shapes, so that at n = 1 with the same
generator state it draws the same tokens (tests/test_zlab_oracle.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_trt.runtime.decoding.sampling import StepSampling, checked_probs, draw


def one_hot_q(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of argmax drafts [n, k] -> [n, k, V] (float32, as z-lab's probabilities)."""
    return torch.zeros(*drafts.shape, vocab_size, device=drafts.device).scatter_(-1, drafts[..., None], 1.0)


def rejection_sample(
    drafts: torch.Tensor,  # [n, k] x_0..x_{k-1}
    target_probs: torch.Tensor,  # [n, k+1, V] p_0..p_k (temperature and nucleus applied)
    draft_probs: torch.Tensor,  # [n, k, V] q_0..q_{k-1}
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [n] (0..k), next token [n]
    """The drafts each row keeps and the token after them (the residual draw or the bonus)."""
    n, k = drafts.shape
    p = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [n, k] p_j(x_j)
    q = draft_probs.gather(-1, drafts[..., None])[..., 0]  # [n, k] q_j(x_j) > 0: x_j was drawn from q_j
    u = torch.rand(q.shape, dtype=q.dtype, device=q.device, generator=generator)  # [n, k]
    accepted = (u * q < p).to(torch.int32).cumprod(-1).sum(-1)  # [n]: leading accepts (u < p / q)
    rows = torch.arange(n, device=drafts.device)
    p_a = target_probs[rows, accepted]  # [n, V]: the target's distribution at the first rejection (or p_k)
    q_a = draft_probs[rows, accepted.clamp(max=k - 1)]  # [n, V]
    residual = (p_a - q_a).clamp_min(0)  # max(0, p - q)
    total = residual.sum(-1, keepdim=True)  # [n, 1]
    # Where p <= q everywhere but the mass still rejected (only by rounding), draw from p itself.
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p_a)
    final = torch.where((accepted == k)[:, None], p_a, residual)  # all accepted: the bonus from p_k
    return accepted, draw(final, generator)  # [n]


def committed_tokens(drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[n, k+1]: each row's drafts with its next token at index a (drafts[0..a-1] and the token
    after them are what the row commits; what follows index a is never read)."""
    tokens = torch.cat([drafts, next_token[:, None]], dim=1)  # [n, k+1]
    return tokens.scatter(1, accepted[:, None], next_token[:, None])


def rejection_rows(
    drafts: torch.Tensor,  # [n, k]
    logits: torch.Tensor,  # [n, k+1, V] the target's verification logits
    draft_probs: Sequence[torch.Tensor] | None,  # q [m, k, V] of each sampling group; None: argmax drafts
    sampling: StepSampling,
    tokens: torch.Tensor,  # [n, k+1] the greedy rows' posterior (argmax), overwritten for sampled rows
    accepted: torch.Tensor,  # [n] the greedy rows' exact-match counts, overwritten likewise
) -> torch.Tensor:  # bad [n]: rows whose target distribution did not exist (they fail alone)
    """The rejection test for every sampled row of a batched step, group by group (each seeded row
    alone with its generator: the reference loop's draws for it, in the same order and shapes), into
    `tokens` and `accepted` in place. No host sync."""
    bad = torch.zeros(drafts.shape[0], dtype=torch.bool, device=drafts.device)
    for i, g in enumerate(sampling):
        p, ok = checked_probs(logits[g.rows], g.temperature, g.top_p)  # [m, k+1, V]
        x = drafts[g.rows]
        q = one_hot_q(x, p.shape[-1]) if draft_probs is None else draft_probs[i]  # one-hot: draft method greedy
        a, nxt = rejection_sample(x, p, q, g.generator)
        tokens[g.rows] = committed_tokens(x, a, nxt)
        accepted[g.rows] = a.to(accepted.dtype)
        bad[g.rows] = ~ok.all(dim=-1)
    return bad
