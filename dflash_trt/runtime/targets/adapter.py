"""A thin adapter over any Hugging Face causal LM (Llama, Qwen3, GptOss, ...) for DFlash.

It gives the decoding loop exactly four things: the target's token embedding, its lm_head, a
forward that also returns the hidden states of ``target_layer_ids``, and KV-cache rollback.

Layer indexing (the classic silent bug): the feature of "layer l" is the OUTPUT of decoder layer
l (after its residual add), i.e. HF ``output_hidden_states[l + 1]``; index 0 would be the
embedding. This matches z-lab and TensorRT-LLM. vLLM and SGLang capture the state ENTERING a
layer and therefore add 1 to the ids. An off-by-one keeps the output lossless and silently
destroys acceptance, so tests/test_target_layers.py pins it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from dflash_trt.checkpoints.placement import home_device
from dflash_trt.runtime.targets.gqa_attention import use_grouped_attention
from dflash_trt.runtime.targets.lean_forward import LeanForward, lean_module, lean_unsupported


class TargetAdapter:
    """Wraps a frozen HF causal LM. Captures decoder-layer outputs with forward hooks."""

    def __init__(self, model: nn.Module) -> None:
        if isinstance(model, TargetAdapter):  # idempotent wrapping
            model = model.model
        self.model = model.eval()
        self.config = model.config
        self._decoder_layers = find_decoder_layers(model)
        # Hooks are registered once per model and shared by every adapter over it; adapters are
        # created per request, and re-registering would pile up hooks on the layers.
        state = model.__dict__.get("_dflash_capture")
        if state is None:
            state = _CaptureState()
            for idx, layer in enumerate(self._decoder_layers):
                layer.register_forward_hook(state.hook(idx))
            model.__dict__["_dflash_capture"] = state
            head = model.get_output_embeddings()
            if head is not None:
                head.register_forward_pre_hook(standard_strides_input)
            # SDPA models attend to the KV cache as it is instead of copying it per query head
            # (dflash_trt/runtime/targets/gqa_attention.py): the batched runtime always passes a mask,
            # which sends transformers' own SDPA path through repeat_kv
            use_grouped_attention(model)
        self._state: _CaptureState = state
        # Passes with an explicit mask (the batched runtime's) take the lean forward where it
        # computes exactly what transformers' does (runtime/targets/lean_forward.py); None: why not.
        self.lean_unsupported = lean_unsupported(model, self._decoder_layers)
        self._lean = lean_module(model, self._decoder_layers) if self.lean_unsupported is None else None

    # -- facts --------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._decoder_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def lean(self) -> LeanForward | None:
        """The model's lean pass (None where it does not apply: :attr:`lean_unsupported` says why)."""
        return self._lean

    # -- pieces the drafter borrows -------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # [B, S] -> [B, S, H]; raw embedding rows (no model-specific scaling)
        return self.model.get_input_embeddings()(ids)  # the embedding sits on the home device

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        # [B, S, H] -> [B, S, V]; on a device map the lm_head may sit on the last GPU
        return self.model.get_output_embeddings()(hidden).to(home_device(self.model))

    # -- forward with hidden-state capture ------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        # A plain DynamicCache keeps every position in every layer (also sliding-window ones, whose
        # masks still restrict attention), so it can always be cropped back after a rejection.
        return DynamicCache()

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        position_ids: torch.Tensor,  # [B, S]
        cache: Any,  # DynamicCache, or any transformers Cache (the batched runtime's own)
        capture_layer_ids: tuple[int, ...] | list[int] = (),
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,  # [B, 1, S, K] additive; None = causal over the cache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns logits [B, S', V] (S' = logits_to_keep or S) and ctx features [B, S, n*H]."""
        if attention_mask is not None and self._lean is not None:
            logits, captured = self._lean(input_ids, position_ids, cache, tuple(capture_layer_ids), logits_to_keep,
                                          attention_mask)
            feats = torch.cat([captured[i] for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
            return logits, feats
        state = self._state
        state.layer_ids, state.captured = tuple(capture_layer_ids), {}
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        finally:
            captured, state.captured, state.layer_ids = state.captured, {}, ()
        home = home_device(self.model)  # layers of a device-mapped target sit on different GPUs
        feats = torch.cat([captured[i].to(home) for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
        return out.logits.to(home), feats

    def pass_modules(self) -> tuple[nn.Module, ...]:
        """The modules whose forward is a target pass: transformers' model, and its lean pass where
        that applies (what bench/phases.py times as "target")."""
        return (self.model,) if self._lean is None else (self.model, self._lean)

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Roll the KV cache back to its first `length` positions (after a rejection)."""
        cache.crop(length)



class _CaptureState:
    """What the layer hooks of one model record during the current forward."""

    def __init__(self) -> None:
        self.layer_ids: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}

    def hook(self, idx: int):
        def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if idx in self.layer_ids:  # [B, S, H], the layer's output after its residual add
                self.captured[idx] = output[0] if isinstance(output, (tuple, list)) else output
        return record


def standard_strides_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook of the lm_head: give it its rows with standard strides.

    The lm_head mostly sees slices: transformers' `hidden[:, -logits_to_keep:]`, the loop's
    `hidden[:, 1:K+1]`; their batch stride is the full sequence's. On a CPU in bfloat16 (torch 2.13)
    F.linear sends such a 3D input through bmm, which first copies the whole weight transposed: for
    the embedded target's 49152 x 576 head 171 ms instead of 7 ms a call, plus a transient as large
    as the head. The same values viewed with standard strides take the mm path, with the same bits
    (a view when the rows are dense, as these slices are; a copy of the few rows otherwise)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.stride() == _standard_strides(x.shape):
        return None
    # contiguous() keeps the odd stride of a size-1 dim; reshape + view re-strides it without a copy
    dense = x.reshape(-1, x.shape[-1]).view(x.shape) if x.is_contiguous() else x.contiguous()
    return (dense, *args[1:])


def _standard_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (Llama-style `model.layers`, GPT-style `transformer.h`)."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
