"""Grouped-query attention without copying the KV cache per query head.

Transformers' SDPA path expands K and V from the model's KV heads to all query heads
(``repeat_kv``) whenever an attention mask is given, which the batched runtime always gives. At
64 rows x 350 cached positions that is ~100 MB of copies per layer per step: profiled, it was 40%
of a train-draft data-generation step on CPU and the cause of a third of its time in the kernel
(page faults). Folding the query heads of each KV group into the query-length axis computes the
same attention against the cache as it is:

    q [b, kvh*rep, q, d] -> [b, kvh, rep*q, d]   (head g*rep + r reads KV head g, as repeat_kv)
    mask [b, 1, q, k]    -> [b, 1, rep*q, k]     (the same rows for every head of a group)

Every query row is still softmax(q k^T * scale + mask) v over the same keys, so the result is
the same up to floating-point summation order (tests/test_gqa_attention.py checks it against
the expanded form). :func:`use_grouped_attention` switches a transformers model to it; anything
unusual (no mask, per-head masks, dropout, attention sinks) goes to transformers' own SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# no "flash" in the name: transformers treats any such name as a flash-attention kernel request
ATTN_IMPLEMENTATION = "sdpa_grouped_kv"


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None) -> torch.Tensor:
    """q [b, h, s, d], k/v [b, kvh, n, d], mask [b or 1, 1, s, n] or [.., 1, n] -> [b, h, s, d]."""
    b, h, s, d = q.shape
    kvh = k.shape[1]
    rep = h // kvh
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    qf = q.reshape(b, kvh, rep * s, d)  # [b, kvh, rep*s, d]
    if mask is not None and mask.shape[-2] == s and s > 1:
        mask = mask.repeat(1, 1, rep, 1)  # [b, 1, rep*s, n]: row r*s + i is query row i
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)  # [b, kvh, rep*s, d]
    return out.reshape(b, h, s, d)


def _hf_grouped_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention-interface signature; returns ([b, s, h, d], None) like its SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    special = (attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
               or dropout or kwargs.get("s_aux") is not None or kwargs.get("sliding_window") or query.dtype != key.dtype
               or query.shape[1] % key.shape[1])
    if special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    out = grouped_attention(query, key, value, mask, scaling)  # [b, h, s, d]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_grouped_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)  # same masks as "sdpa"


def use_grouped_attention(model: Any) -> bool:
    """Switch a transformers model that runs SDPA attention to the grouped form (in place).
    Returns whether it now uses it; models on other attention implementations are left alone."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == ATTN_IMPLEMENTATION:
        return True
    if impl != "sdpa":
        return False
    _register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model.config._attn_implementation == ATTN_IMPLEMENTATION
