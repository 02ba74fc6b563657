"""Token sampling shared by every decoding path (so DFlash and plain decoding sample identically)."""

from __future__ import annotations

import torch


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
