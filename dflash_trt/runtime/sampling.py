"""Token sampling shared by every decoding path (so DFlash and plain decoding sample identically)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflash_trt.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax at `temperature`, restricted to the nucleus of mass `top_p`. [..., V] -> [..., V]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass BEFORE it is < top_p (the top token is always kept)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_checked(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [...], ok [...]
    """`sample` for a batch whose rows may not all have a distribution: a valid SamplingParams can
    still give none (a temperature so small that logits / temperature overflow to inf, then NaN
    after the softmax), and torch.multinomial would then fail every row of the call. Rows without
    one draw from a uniform stand-in and come back with ok False, on the device (no host sync), so
    the caller fails those rows alone."""
    probs = sampling_probs(logits, temperature, top_p)
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # [...]
    probs = torch.where(ok[..., None], probs, torch.ones_like(probs))
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1]), ok


def sample(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...]
    """Greedy at temperature 0, else a draw from the tempered nucleus distribution."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_rows(
    logits: torch.Tensor,  # [n, S, V]
    params: Sequence["SamplingParams"],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [n, S], bad [n] | None
    """Tokens for a batch of rows with their own sampling parameters, and which rows had no
    distribution to sample from (None when every row is greedy). No host sync.

    Greedy rows: one argmax. Seeded rows: one by one, each with its own generator, consumed exactly
    as the reference loop does (S draws a step). Unseeded sampled rows: one draw per (temperature,
    top_p) group from the global generator; per-row calls cost ~10 kernel launches each, which at
    hundreds of sampled rows on a GPU took longer than the target's forward."""
    tokens = logits.argmax(-1)
    bad: torch.Tensor | None = None
    groups: dict[tuple[float, float], list[int]] = {}
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        if bad is None:
            bad = torch.zeros(len(params), dtype=torch.bool, device=logits.device)
        if gen is None:
            groups.setdefault((p.temperature, p.top_p), []).append(i)
            continue
        tokens[i], ok = sample_checked(logits[i], p.temperature, p.top_p, gen)
        bad[i] = ~ok.all()
    for (temperature, top_p), idx in groups.items():
        rows = torch.tensor(idx, device=logits.device)
        tokens[rows], ok = sample_checked(logits[rows], temperature, top_p)  # [m, S]
        bad[rows] = ~ok.all(dim=-1)
    return tokens, bad
