"""A lean forward pass for Llama-family targets (Llama, Mistral, Qwen2, Qwen3) over an explicit mask.

transformers' modeling code spends, per decoder layer, several Python frames of dispatch around
the arithmetic: keyword plumbing through the decoder layer and the attention module, the
attention-interface lookup, the grouped-SDPA adapter's checks, and a forward hook per layer for
the captured features. On this project's CPU that is a measurable share of a decoding step (a
SmolLM2-135M plain step: ~7 ms of 65 at one row with the linear layers stubbed out).

This pass runs the SAME modules and weights through the same operations in the same order --
the model's own norms, projections, rotary embedding and MLP, transformers' RMSNorm and rotary
formulas, the grouped SDPA of gqa_attention.py over the caller's KV cache -- with the decoder
loop, the attention and the feature capture written out once. Its logits and features therefore
equal transformers' bit for bit (tests/test_lean_forward.py), so every runtime that uses it stays
token for token the reference loop's.

A layer is two functions around its KV-cache write and attention (:func:`attention_inputs`,
:func:`layer_output`): on a GPU, runtime/gpu/compiled_layers.py hands those two to torch.compile once
for all layers, which fuses each half's elementwise work into few kernels (no longer bit for bit
transformers', see there).

Scope: what the batched runtime runs (an explicit 4D additive mask, explicit positions, a cache
with ``update(k, v, layer_idx)``). Anything else -- other architectures, sliding-window layers,
attention implementations other than the grouped SDPA, no mask -- stays on transformers' forward
(:func:`lean_unsupported` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from dflash_trt.runtime.targets.gqa_attention import ATTN_IMPLEMENTATION as GROUPED_SDPA
from dflash_trt.runtime.targets.gqa_attention import grouped_attention

# Decoders whose layers are Llama's (pre-norm attention + SwiGLU MLP, RMSNorm, rotary on q and k);
# Qwen3 adds per-head q_norm / k_norm, Qwen2 biases on q/k/v (the projections carry them).
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def lean_unsupported(model: nn.Module, layers: nn.ModuleList) -> str | None:
    """None when :func:`lean_forward` computes exactly what `model`'s own forward does, else why not."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if getattr(cfg, "_attn_implementation", None) != GROUPED_SDPA:
        return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r} (the lean pass is {GROUPED_SDPA})"
    if model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        return "Mistral with a sliding window"
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        return f"the model is spread over {len(devices)} devices (transformers' forward moves activations between them)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens") or not hasattr(base, "norm"):
        return "no model.rotary_emb / embed_tokens / norm"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention layers"
        if not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return f"{type(layer.input_layernorm).__name__} is not an RMSNorm"
    return None


def attention_inputs(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to its attention: x [B, S, H] -> q [B, nh, S, hd], k and v [B, nkv, S, hd]
    (input norm, projections, Qwen3's per-head norms, rotary), as transformers' Llama/Qwen3 attention."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    b, s, _ = h.shape
    hd = attn.head_dim
    q = attn.q_proj(h).view(b, s, -1, hd)  # [B, S, nh, hd]
    k = attn.k_proj(h).view(b, s, -1, hd)  # [B, S, nkv, hd]
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head, before the transpose
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, hd]
    v = attn.v_proj(h).view(b, s, -1, hd).transpose(1, 2)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    return q, k, v


def layer_output(layer: nn.Module, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer: x [B, S, H] and its attention's output [B, nh, S, hd] -> the
    layer's output [B, S, H] (output projection, residual, post-attention norm, MLP, residual)."""
    b, s, _ = x.shape
    out = attended.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()
    x = x + layer.self_attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


class LayerFunctions(NamedTuple):
    """The two halves of a decoder layer around its KV-cache write and attention (the target's here,
    the drafter's in runtime/drafters/dflash.py), eager or compiled (runtime/gpu/compiled_layers.py)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    layer_output: Callable[..., torch.Tensor]


EAGER = LayerFunctions(attention_inputs, layer_output)


class LeanForward(nn.Module):
    """The lean pass of one model, as a module: hooks that time "the target's forward pass"
    (bench/phases.py) see it as they see transformers' forward. One per model (:func:`lean_module`);
    it holds the model without registering it, so the model's own modules and state are unchanged."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        super().__init__()
        object.__setattr__(self, "target", model)
        object.__setattr__(self, "layers", layers)
        # eager, or torch.compile'd per layer (runtime/gpu/compiled_layers.py): the same code either way
        object.__setattr__(self, "functions", EAGER)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                capture_layer_ids: tuple[int, ...], logits_to_keep: int,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [B, S', V] (S' = logits_to_keep or S) and the outputs of `capture_layer_ids`
        ([B, S, H] each, after the layer's residual add), for input_ids/position_ids [B, S] and an
        additive mask [B, 1, S, W] over `cache`."""
        base = self.target.model
        x = base.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = base.rotary_emb(x, position_ids=position_ids)  # [B, S, hd] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, hd]: broadcast over heads
        captured: dict[int, torch.Tensor] = {}
        fns = self.functions
        for i, layer in enumerate(self.layers):
            q, k, v = fns.attention_inputs(layer, x, cos, sin)
            k, v = cache.update(k, v, i)  # [B, nkv, W, hd]: the cache's view up to the mask width
            attended = grouped_attention(q, k, v, attention_mask[:, :, :, : k.shape[-2]],
                                         layer.self_attn.scaling)  # [B, nh, S, hd]
            x = fns.layer_output(layer, x, attended)
            if i in capture_layer_ids:
                captured[i] = x
        x = base.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.target.lm_head(x), captured


def lean_module(model: nn.Module, layers: nn.ModuleList) -> LeanForward:
    """`model`'s LeanForward, made on first use (kept in the model's __dict__, not as a submodule)."""
    lean = model.__dict__.get("_dflash_lean")
    if lean is None:
        lean = model.__dict__["_dflash_lean"] = LeanForward(model, layers)
    return lean
