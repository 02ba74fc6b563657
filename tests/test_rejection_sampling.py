"""Rejection sampling (runtime/decoding/rejection.py) is lossless for every kind of draft distribution q, and
the reference loop is lossless with every draft method of both drafter families.

Statistics. A chi-square goodness-of-fit test compares the empirical distribution of the first
tokens with the target's exact one (cells with expected counts below 5 pooled), at significance
ALPHA = 1e-4 per test: with a correct implementation, a random draw of seeds fails a test with
probability 1e-4 (about 1e-3 over this file). The seeds are fixed, so each verdict is
deterministic, never flaky; the mutants of the report (accepting with u < p instead of u * q < p,
drawing the residual without subtracting q, taking the residual after a full accept) fail them.

1. ``rejection_sample`` alone, on a toy target (a bigram table over 6 tokens: the target's
   distribution of the next token given the last) and three toy drafters -- argmax drafts (one-hot
   q), slots drawn independently from their own tables (DFlash v1), a walk drawn from the top-3 of
   a table given the previous draft (DFlash2: q zero off the candidates) -- two drafts a step,
   over 100k sequences decoded in parallel: the joint distribution of the first three tokens (a
   full accept's bonus among them) must be the target chain's.
2. ``dflash_generate`` end to end (marked slow: 1000 runs per case), tiny target over 8 tokens, an
   oracle-like drafter whose q puts about half its mass on the target's greedy token (so both the
   accept and the reject branch run), for draft_method match, greedy and probabilistic and both
   families: the joint distribution of the 2nd and 3rd tokens must be the target's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.drafters.dflash2 import DFlash2DraftModel
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel, make_draft_config
from dflash_trt.runtime.decoding.rejection import one_hot_q, rejection_sample
from dflash_trt.runtime.decoding.sampling import sampling_probs
from dflash_trt.runtime.tiny import TINY_DFLASH2_RECIPE, tiny_target
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DRAFT_METHODS, SpeculationSettings

ALPHA = 1e-4


def gof_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts `observed` against cell probabilities `probs` (same shape)."""
    observed, probs = observed.flatten().double(), probs.flatten().double()
    assert observed[probs == 0].sum() == 0, "a sequence the target cannot produce"
    keep = probs > 0
    expected = probs[keep] * observed.sum()
    obs = observed[keep]
    small = expected < 5  # pooled into one cell, as the test's validity requires
    obs = torch.cat([obs[~small], obs[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


# -- 1. the test alone, on toy distributions --------------------------------------------------------

V, K, ROWS, FIRST = 6, 2, 100_000, 3  # a full accept's bonus is the third token


def _table(gen: torch.Generator, spread: float) -> torch.Tensor:
    return torch.softmax(torch.randn(V, V, generator=gen, dtype=torch.float64) * spread, -1).float()  # [V, V]


def _draft(kind: str, last: torch.Tensor, tables: torch.Tensor, gen: torch.Generator):
    """Drafts [n, K] and their q [n, K, V] from `last` [n] (see the module docstring)."""
    n, drafts, qs, prev = last.shape[0], [], [], last
    for j in range(K):
        if kind == "argmax":
            x = tables[0][prev].argmax(-1)
            q = None
        elif kind == "independent":  # v1: slot j's q depends on the anchor only
            q = tables[j][last]
            x = torch.multinomial(q, 1, generator=gen)[:, 0]
        else:  # "walk": q over the top-3 of the table row of the previous draft
            row = tables[0][prev]
            top = row.topk(3, -1)
            cand_q = torch.softmax(top.values.log() * 1.5, -1)
            q = torch.zeros(n, V).scatter(-1, top.indices, cand_q)
            x = torch.multinomial(q, 1, generator=gen)[:, 0]
        drafts.append(x)
        qs.append(q)
        prev = x
    d = torch.stack(drafts, 1)
    return d, (one_hot_q(d, V) if kind == "argmax" else torch.stack(qs, 1))


@pytest.mark.parametrize("kind", ["argmax", "independent", "walk"])
def test_rejection_sampling_emits_the_targets_distribution(kind):
    gen = torch.Generator().manual_seed(7)
    target = _table(gen, 1.0)  # target[t] = p(next | t)
    tables = torch.stack([_table(gen, 1.5) for _ in range(K)])  # the drafter's, unrelated to the target
    last = torch.zeros(ROWS, dtype=torch.long)  # every sequence starts after token 0
    out = torch.full((ROWS, FIRST + K + 1), -1)
    length = torch.zeros(ROWS, dtype=torch.long)
    rows = torch.arange(ROWS)
    accepted_total = 0
    while (length < FIRST).any():
        drafts, q = _draft(kind, last, tables, gen)
        p = target[torch.cat([last[:, None], drafts], 1)]  # [n, K+1, V]: p_j = p(. | block[j])
        accepted, nxt = rejection_sample(drafts, p, q, gen)
        accepted_total += int(accepted.sum())
        for j in range(K + 1):  # commit drafts[:a] then the next token
            tok = torch.where(j < accepted, drafts[:, min(j, K - 1)], nxt)
            write = (j <= accepted) & (length + j < out.shape[1])
            out[rows[write], (length + j)[write]] = tok[write]
        length = length + accepted + 1
        last = nxt
    counts = torch.zeros(V, V, V)
    for a, b, c in itertools.product(range(V), repeat=3):
        counts[a, b, c] = ((out[:, 0] == a) & (out[:, 1] == b) & (out[:, 2] == c)).sum()
    exact = target[0][:, None, None] * target[:, :, None] * target[None, :, :]  # [V, V, V]
    assert 0.1 * ROWS < accepted_total  # the accept branch ran (and, below 2 a step, the reject one)
    assert gof_pvalue(counts, exact) > ALPHA


def test_a_full_accept_draws_the_bonus_from_the_last_row_and_a_residual_never_repeats_the_draft():
    ones = torch.ones(4000, 1, dtype=torch.long)
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.5, 0.5]]]).expand(4000, 2, 3)  # 1 always, then 1 or 2
    accepted, nxt = rejection_sample(ones, p, one_hot_q(ones, 3), torch.Generator().manual_seed(0))
    assert (accepted == 1).all() and 1500 < int((nxt == 1).sum()) < 2500  # the bonus from p_1 (1 too)
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]).expand(4000, 2, 3)
    accepted, nxt = rejection_sample(torch.ones(4000, 1, dtype=torch.long), p, one_hot_q(torch.ones(4000, 1,
                                     dtype=torch.long), 3), torch.Generator().manual_seed(0))
    assert (nxt[accepted == 0] == 0).all() and 1500 < int((accepted == 0).sum()) < 2500


# -- 2. the reference loop, every method, both families ---------------------------------------------

VOCAB, T, TOP_P, RUNS = 8, 1.0, 0.95, 1000
PROMPT = [1, 2, 3]


def _oracle_class(base: type) -> type:
    class Oracle(base):
        """Its hidden states give logits `strength` at the target's greedy continuation, 0 elsewhere
        (hidden = pinv(W_lm) @ onehot): q of about 1/2 there at T = 1; DFlash2's selector still walks."""

        def __init__(self, config, lm_head_weight, sequence, strength=2.0):
            super().__init__(config)
            self.sequence, self.strength = sequence, strength
            self.pinv = torch.linalg.pinv(lm_head_weight.double())  # [H, V]

        def forward(self, target_hidden, noise_embedding, position_ids, cache=None, attn_mask=None, outputs=None):
            n, s = noise_embedding.shape[:2]  # every row of a batched pass too (padding rows included)
            onehot = torch.zeros(n, s, self.pinv.shape[1], dtype=torch.float64)
            for i in range(n):
                for j, pos in enumerate(position_ids[i, -s:].tolist()):
                    onehot[i, j, self.sequence[pos] if pos < len(self.sequence) else 0] = self.strength
            hidden = (onehot @ self.pinv.T).to(noise_embedding.dtype)  # [n, s, H]
            return hidden if outputs is None else hidden[:, outputs]

    return Oracle


def _next_probs(target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return sampling_probs(target(torch.tensor([ids])).logits[0, -1], T, TOP_P).double()


def oracle_pair(family: str):
    """(target, drafter) of part 2: the softened tiny target and the oracle-like drafter of `family`."""
    from dflash_trt.runtime import autoregressive_generate

    target = tiny_target("llama", seed=11, vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1)
    with torch.no_grad():  # soften the tiny model's logits so several tokens are likely
        target.get_output_embeddings().weight.mul_(0.1)
    greedy = PROMPT + autoregressive_generate(target, PROMPT, SamplingParams(max_tokens=8)).output_ids
    fields = {**TINY_DFLASH2_RECIPE, "conv_group_size": 8, "selector_top_k": 3} if family == "dflash2" else {}
    cfg = make_draft_config(target.config, block_size=4, dflash_fields=fields)
    base = DFlash2DraftModel if family == "dflash2" else DFlashDraftModel
    cfg["architectures"] = ["DFlash2DraftModel" if family == "dflash2" else "DFlashDraftModel"]
    draft = _oracle_class(base)(cfg, target.get_output_embeddings().weight.detach(), greedy)
    draft.reset_parameters(seed=1)
    return target, draft


def second_and_third(target) -> torch.Tensor:
    """The target's exact joint distribution [V, V] of the 2nd and 3rd tokens after PROMPT."""
    exact = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = _next_probs(target, PROMPT)
    for a in range(VOCAB):
        if p1[a] > 0:
            p2 = _next_probs(target, PROMPT + [a])
            for b in range(VOCAB):
                if p2[b] > 0:
                    exact[b] += p1[a] * p2[b] * _next_probs(target, PROMPT + [a, b])
    return exact


@pytest.mark.slow
@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_every_draft_method_keeps_the_targets_distribution(family, method):
    target, draft = oracle_pair(family)
    spec = SpeculationSettings.for_block(4, draft_method=method)
    exact = second_and_third(target)
    counts = torch.zeros(VOCAB, VOCAB)
    accepted_third = 0
    for seed in range(RUNS):
        r = dflash_generate(draft, target, PROMPT, SamplingParams(max_tokens=3, temperature=T, top_p=TOP_P, seed=seed),
                            spec)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted_third += r.stats.acceptance_lengths[0] >= 2
    assert 0.05 * RUNS < accepted_third < 0.95 * RUNS, "both accept and reject paths must be exercised"
    assert gof_pvalue(counts, exact) > ALPHA
