"""Token sampling shared by every decoding path (so DFlash and plain decoding sample identically).

Every draw goes through :func:`draw`, the exponential race torch.multinomial itself runs for one
sample (argmax of p / E, E ~ Exp(1)): the same tokens for the same generator state, without the
distribution checks multinomial reads on the host (a device sync per call on a GPU). A batched
step's sampled rows therefore add no sync to the step's one read (runtime/batched/runtime.py); rows whose
parameters give no distribution are found on the device (:func:`checked_probs`) and fail alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
    """Each row's most likely token, the first on ties (argmax's rule). `max(-1).indices`, not
    `argmax(-1)`: the same indices, but PyTorch's CPU argmax is ~3x slower over a vocabulary
    (one thread, [16, 49152] float32: 1.03 ms against 0.36 ms), ~1% of a 16-row step."""
    return logits.max(dim=-1).indices


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per distribution: probs [..., V] -> [...]. torch.multinomial(probs, 1)'s own
    algorithm for one sample (the same exponential draws, in the same order and shape, so the same
    tokens from the same generator state: tests/test_runtime_sampling.py), minus its host-side
    checks of `probs`: the caller guarantees a distribution (:func:`checked_probs`)."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)  # [..., V] ~ Exp(1)
    return greedy(probs / race)


def checked_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # probs [..., V], ok [...]
    """sampling_probs for rows that may have no distribution: a valid SamplingParams can still give
    none (a temperature so small that logits / temperature overflow to inf, then NaN after the
    softmax). Such rows get a uniform stand-in, so a draw over them is defined, and come back with
    ok False, on the device (no host sync): the caller fails those rows alone."""
    probs = sampling_probs(logits, temperature, top_p)
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # [...]
    return torch.where(ok[..., None], probs, torch.ones_like(probs)), ok


def sample_checked(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [...], ok [...]
    """`sample` for a batch whose rows may not all have a distribution (:func:`checked_probs`)."""
    probs, ok = checked_probs(logits, temperature, top_p)
    return draw(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1]), ok


def sample(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...]
    """Greedy at temperature 0, else a draw from the tempered nucleus distribution."""
    if temperature <= 0:
        return greedy(logits)
    probs = sampling_probs(logits, temperature, top_p)
    return draw(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1])


@dataclass(frozen=True)
class RowGroup:
    """Rows of a batch that sample together: one seeded row with its own generator, or the
    unseeded rows of one (temperature, top_p), drawn at once from the global generator."""

    rows: slice | torch.Tensor  # indices into the batch's first dimension
    temperature: float
    top_p: float
    generator: torch.Generator | None


class StepSampling:
    """Who samples in one batched step, and how: greedy rows (temperature 0) take the argmax, the
    others sample in :class:`RowGroup` s. A seeded row is its own group and draws exactly what the
    reference loop draws for it (the same calls on [1, ...] shapes, its own generator); per-row
    calls cost ~10 kernel launches each, which at hundreds of sampled rows on a GPU took longer than
    the target's forward, so unseeded rows are drawn one call per (temperature, top_p) group.
    `upload`: how the groups' row indices reach the device (the runtime's counted transfers)."""

    def __init__(self, params: Sequence["SamplingParams"], generators: Sequence[torch.Generator | None],
                 device: torch.device, upload: Callable[[list[int]], torch.Tensor] | None = None) -> None:
        self.n = len(params)
        self.greedy = all(p.greedy for p in params)
        unseeded: dict[tuple[float, float], list[int]] = {}
        groups: list[RowGroup] = []
        for i, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                continue
            if gen is None:
                unseeded.setdefault((p.temperature, p.top_p), []).append(i)
            else:
                groups.append(RowGroup(slice(i, i + 1), p.temperature, p.top_p, gen))
        if unseeded:  # every unseeded group's indices in one upload
            flat = [i for idx in unseeded.values() for i in idx]
            index = upload(flat) if upload is not None else torch.tensor(flat, device=device)
            at = 0
            for (temperature, top_p), idx in unseeded.items():
                groups.append(RowGroup(index[at : at + len(idx)], temperature, top_p, None))
                at += len(idx)
        self.groups = tuple(groups)

    def __iter__(self) -> Iterator[RowGroup]:
        return iter(self.groups)


def sample_rows(
    logits: torch.Tensor,  # [n, S, V]
    sampling: StepSampling,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [n, S], bad [n] | None
    """Tokens for a batch of rows with their own sampling parameters, and which rows had no
    distribution to sample from (None when every row is greedy). No host sync. A seeded row
    consumes its generator exactly as the reference loop does (S draws)."""
    tokens = greedy(logits)
    if sampling.greedy:
        return tokens, None
    bad = torch.zeros(sampling.n, dtype=torch.bool, device=logits.device)
    for g in sampling:
        tokens[g.rows], ok = sample_checked(logits[g.rows], g.temperature, g.top_p, g.generator)  # [m, S]
        bad[g.rows] = ~ok.all(dim=-1)
    return tokens, bad
