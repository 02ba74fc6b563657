"""The DFlash drafter (z-lab checkpoint format, ``architectures: ["DFlashDraftModel"]``).

A stack of Qwen3-style decoder layers with no embedding and no lm_head of its own: the block's
token embeddings and the output head are the TARGET's. The target's hidden states from
``target_layer_ids`` are fused once per position, ``ctx = hidden_norm(fc(concat(h_l)))``, and
injected into the K/V of every layer: ``k = k_norm(k_proj([ctx ; x]))``, ``v = v_proj([ctx ; x])``,
``q = q_norm(q_proj(x))``. Attention inside the block is bidirectional. Context K/V live in the
draft KV cache; the block's own K/V are dropped after each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.decoding.sampling import draw, greedy, sampling_probs
from dflash_trt.runtime.drafters.config import check_drafter_config, check_number, draft_value
from dflash_trt.runtime.drafters.families import FAMILIES, detect_family
from dflash_trt.runtime.drafters.speculators_format import zlab_config
from dflash_trt.runtime.targets.gqa_attention import grouped_attention
from dflash_trt.runtime.targets.lean_forward import LayerFunctions
from dflash_trt.runtime_options import dtype_name

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: which target layers feed the drafter (Qwen3-8B, 36, 5 -> [1,9,17,25,33])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashSettings:
    """The DFlash fields of a drafter config, wherever the checkpoint put them: each is read as
    z-lab 0.1.0 reads it (``dflash_config`` first, then the top level; config.draft_value).

    The last three are the newer fields of z-lab's Gemma-family drafters, read by both families:
    ``input_embedding_scale`` multiplies the target's raw embedding of every block slot (the anchor
    too) before the drafter sees it; ``output_multiplier`` multiplies the draft logits, then
    ``final_logit_softcapping`` c (None or <= 0: off) maps them to tanh(l / c) * c."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # None: not recorded (a speculators checkpoint); ids are explicit then
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @staticmethod
    def from_config_dict(cfg: dict[str, Any], where: str = "config.json") -> "DFlashSettings":
        cfg = zlab_config(cfg, where)  # a speculators config reads as its z-lab equivalent
        check_drafter_config(cfg, where)  # types and ranges first: one line, never a traceback
        # block_size sits at top level in Qwen3/Llama drafters, inside dflash_config in newer ones.
        block_size = draft_value(cfg, "block_size")
        mask_token_id = draft_value(cfg, "mask_token_id")
        num_target_layers = cfg.get("num_target_layers")
        if block_size is None:
            raise DFlashError(f"{where}: no block_size (top level or dflash_config); add e.g. \"block_size\": 16")
        if mask_token_id is None:
            raise DFlashError(f"{where}: no dflash_config.mask_token_id; set it to a token id the target never emits")
        layer_ids = draft_value(cfg, "target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DFlashError(f"{where}: no num_target_layers and no dflash_config.target_layer_ids; set "
                                  "num_target_layers to the target's num_hidden_layers")
            layer_ids = build_target_layer_ids(int(num_target_layers), int(cfg.get("num_hidden_layers", 1)))
        scale = draft_value(cfg, "input_embedding_scale", 1.0)
        multiplier = draft_value(cfg, "output_multiplier", 1.0)
        softcap = draft_value(cfg, "final_logit_softcapping")
        if softcap is not None:
            softcap = check_number(where, "final_logit_softcapping", softcap)
        return DFlashSettings(
            int(block_size), int(mask_token_id), tuple(int(i) for i in layer_ids),
            None if num_target_layers is None else int(num_target_layers),
            check_number(where, "input_embedding_scale", scale, positive=True),
            check_number(where, "output_multiplier", multiplier, positive=True),
            softcap if softcap is not None and softcap > 0 else None,  # z-lab: <= 0 turns it off
        )


def check_is_drafter(cfg: dict[str, Any], where: Any) -> None:
    """DFlashError unless `cfg` is a drafter config of a family this project runs."""
    detect_family(cfg, where)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE where q covers only the LAST q_len positions of cos/sin and k covers all of them."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]
    q_len = q.shape[-2]
    q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k = k * cos + rotate_half(k) * sin
    return q, k


class DraftKVCache:
    """Per-layer K/V of the drafter: the context positions only, between steps."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, kv_heads, T_new, head_dim]
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def get_seq_length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-2]

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[..., :length, :]
                self.values[i] = self.values[i][..., :length, :]


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        h, hd = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = getattr(config, "sliding_window", None) if sliding else None
        # z-lab's convention: attention is bidirectional unless the config says `is_causal`; when
        # it says nothing, sliding-window layers are causal and full layers are not.
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = sliding if is_causal is None else bool(is_causal)

    def projections(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, H] (block, after input_layernorm), ctx [B, C, H], cos/sin [B, C+S, hd] -> q [B, nh,
        S, hd] and k, v [B, nkv, C+S, hd] of the new context positions and the block, roped."""
        b, s, _ = x.shape
        c = ctx.shape[1]
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, s, -1, hd)).transpose(1, 2)  # [B, nh, S, hd]
        kv_in = torch.cat([ctx, x], dim=1)  # [B, C+S, H]
        k = self.k_norm(self.k_proj(kv_in).view(b, c + s, -1, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c + s, -1, hd).transpose(1, 2)  # [B, nkv, C+S, hd]
        q, k = apply_rope(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: DraftKVCache | None,
               attn_mask: torch.Tensor | None) -> torch.Tensor:
        """The new K/V into `cache`, then every block position attends -> [B, nh, S, hd]."""
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, nkv, K, hd], K = cached + C + S
        if attn_mask is None and (self.is_causal or self.sliding_window is not None):
            attn_mask = block_attention_mask(q.shape[-2], k.shape[-2], self.is_causal, self.sliding_window, q.device)
        # Every block position queries, also when only `queries` are returned: the attention
        # kernels (PyTorch's CPU flash attention, its math path, oneDNN/MKL underneath) sum in an
        # order that follows the query count -- one query runs a GEMV, 8 a GEMM -- so attending
        # from fewer positions gives other bits (on AVX2 and AVX-512 alike). The same call as the
        # whole block's keeps the returned rows bit-identical; it costs one S-row q_proj and
        # S-query attention instead of Q-row ones, small next to the MLP that runs on Q rows.
        return grouped_attention(q, k, v, attn_mask, scale=self.head_dim**-0.5)  # no KV copy per head

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H] block hidden states after input_layernorm
        ctx: torch.Tensor,  # [B, C, H] fused target context (new positions only)
        cos: torch.Tensor,  # [B, C+S, hd]
        sin: torch.Tensor,
        cache: DraftKVCache | None,
        attn_mask: torch.Tensor | None,  # bool [B|1, 1, S, K] (True = visible) or None
        queries: slice | None = None,  # block positions whose outputs are returned (default all S)
    ) -> torch.Tensor:  # [B, S or len(queries), H]
        out = self.attend(*self.projections(x, ctx, cos, sin), cache, attn_mask)  # [B, nh, S, hd]
        return self.output(out if queries is None else out[:, :, queries])

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """[B, nh, Q, hd] -> o_proj [B, Q, H]."""
        return self.o_proj(attended.transpose(1, 2).reshape(attended.shape[0], attended.shape[2], -1))


def block_attention_mask(q_len: int, k_len: int, causal: bool, window: int | None,
                         device: torch.device) -> torch.Tensor:
    """[1, 1, Q, K] bool (True = visible). The queries are the LAST q_len of the k_len keys."""
    qpos = (k_len - q_len + torch.arange(q_len, device=device))[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= kpos <= qpos
    if window is not None:
        visible &= (qpos - kpos < window) if causal else ((qpos - kpos).abs() < window)
    return visible[None, None]


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache, attn_mask, queries: slice | None = None,
                functions: LayerFunctions | None = None):
        """`functions`: the layer's two halves around its cache write and attention (default eager;
        runtime/gpu/compiled_layers.py passes torch.compile'd ones)."""
        pre, post = functions or DRAFT_EAGER
        q, k, v = pre(self, x, ctx, cos, sin)
        attended = self.self_attn.attend(q, k, v, cache, attn_mask)  # [B, nh, S, hd]
        if queries is not None:  # views, taken here: a slice given to a compiled function is a constant
            x, attended = x[:, queries], attended[:, :, queries]
        return post(self, x, attended)


def draft_attention_inputs(layer: DFlashDecoderLayer, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft layer up to its attention: input norm, then DFlashAttention.projections."""
    return layer.self_attn.projections(layer.input_layernorm(x), ctx, cos, sin)


def draft_layer_output(layer: DFlashDecoderLayer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a draft layer for the positions it returns, x [B, Q, H] and attended [B, nh, Q, hd]:
    o_proj, residual, post-attention norm, MLP, residual -> [B, Q, H]."""
    x = x + layer.self_attn.output(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x))


DRAFT_EAGER = LayerFunctions(draft_attention_inputs, draft_layer_output)


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


class DFlashDraftModel(nn.Module):
    """DFlash block-diffusion drafter. Weights named as z-lab's: layers.*, fc, hidden_norm, norm.

    The module of the DFlash family (runtime/drafters/families.py holds its data): its layers, and how
    a step turns the draft slots' hidden states into proposals (:meth:`propose`). DFlash2
    (runtime/drafters/dflash2.py) subclasses it."""

    family = "dflash"  # runtime/drafters/families.py: the family this class runs, detected from config.json
    # its layers' two halves around their attention, eager (runtime/gpu/compiled_layers.py compiles these)
    eager_layer_functions: LayerFunctions = DRAFT_EAGER

    def __init__(self, config: Qwen3Config | dict[str, Any]) -> None:
        super().__init__()
        raw = zlab_config(config if isinstance(config, dict) else config.to_dict())
        found = detect_family(raw, "drafter config")
        if found.name != self.family:  # never run a drafter as something it is not
            raise DFlashError(f"drafter config: it describes a {found.name} drafter, not {self.family}; load it with "
                              "dflash_trt.runtime.drafters.loading.load_drafter, which picks the family")
        self.raw_config: dict[str, Any] = dict(raw)
        self.settings = DFlashSettings.from_config_dict(raw)
        self.config = config if isinstance(config, Qwen3Config) else Qwen3Config(**_qwen3_kwargs(raw))
        cfg = self.config
        n_ctx = len(self.settings.target_layer_ids)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(n_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=cfg)
        # optional frequency-ranked draft vocabulary (int64 [N]; runtime/drafters/draft_vocab.py), from
        # draft_vocab.json beside the checkpoint; None drafts over the target's whole vocabulary.
        # A buffer, so `.to(device)` moves it with the weights; not persistent: it ships as its
        # own JSON file, never in model.safetensors
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", None, persistent=False)
        # the layers' halves: eager, or torch.compile'd by a runtime (runtime/gpu/compiled_layers.py)
        self.layer_functions: LayerFunctions | None = None
        self.add_family_modules(cfg)
        self.reset_parameters()

    def make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        return DFlashDecoderLayer(config, layer_idx)

    def add_family_modules(self, config: Qwen3Config) -> None:
        """Modules a family adds beside the layers (DFlash2: its candidate selector)."""

    # -- properties used by the decoding loop ----------------------------------------------
    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def mask_token_id(self) -> int:
        return self.settings.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.settings.target_layer_ids)

    def reference_only_reason(self) -> str | None:
        """Why only the reference loop runs this drafter as it is (None: every runtime does).

        The batched runtime builds one bidirectional mask per drafter pass: a causal layer would be
        run as something it is not there."""
        if any(layer.self_attn.is_causal for layer in self.layers):
            return "the drafter has causal attention layers (the batched runtime's drafter mask is bidirectional)"
        return None

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None, std: float | None = None) -> None:
        """Random init (Qwen3's normal(0, initializer_range)); norms to 1."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = std if std is not None else float(getattr(self.config, "initializer_range", 0.02))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.zero_()

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        # [B, C, n_ctx*H] -> [B, C, H]
        return self.hidden_norm(self.fc(target_hidden))

    def scale_embedding(self, noise_embedding: torch.Tensor) -> torch.Tensor:
        """The block's target embeddings times input_embedding_scale (z-lab multiplies the raw rows)."""
        scale = self.settings.input_embedding_scale
        return noise_embedding if scale == 1.0 else noise_embedding * scale

    def forward(
        self,
        target_hidden: torch.Tensor,  # [B, C, n_ctx*H] raw target features of NEW context positions
        noise_embedding: torch.Tensor,  # [B, S, H] target embeddings of [anchor, MASK x (S-1)]
        position_ids: torch.Tensor,  # [B, C+S] context positions then block positions
        cache: DraftKVCache | None = None,
        attn_mask: torch.Tensor | None = None,  # default: every query sees every key
        outputs: slice | None = None,  # block positions the caller reads (default all S)
    ) -> torch.Tensor:  # [B, S or len(outputs), H] after the final norm
        # A step reads only the k draft slots: the LAST layer computes only those positions from
        # its attention output on (o_proj, the MLP, the norms), while the attention itself runs
        # over the whole block as before (see DFlashAttention.forward), so the outputs are those of
        # the whole block: the same bits with the CPU runtime's panel kernel (batch-invariant
        # linear layers), the same to rounding with oneDNN or on a GPU (tests/test_draft_outputs.py).
        ctx = self.fuse_context(target_hidden)
        x = self.scale_embedding(noise_embedding)
        cos, sin = self.rotary_emb(x, position_ids)  # [B, C+S, hd]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, cache, attn_mask, outputs if i == last else None, self.layer_functions)
        return self.norm(x)

    # -- proposals ------------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Draft logits [..., V] of hidden states [..., H] through the target's `head`, with the
        drafter's output_multiplier and final_logit_softcapping (z-lab's order: multiply, then cap)."""
        s = self.settings
        logits = head(hidden)
        if s.output_multiplier != 1.0:  # x * 1.0 is x: skipping it keeps the same bits
            logits = logits * s.output_multiplier
        if s.final_logit_softcapping is not None:
            c = s.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits

    def propose(
        self,
        hidden: torch.Tensor,  # [n, k, H] the draft slots 1..k after the final norm
        anchor: torch.Tensor,  # [n] the block's slot 0: the last committed token
        head: Callable[[torch.Tensor], torch.Tensor],  # the target's lm_head
        temperature: float = 0.0,  # 0: argmax drafts; > 0: drafts sampled from q
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [n, k], q [n, k, V] (sampled) or None
        """DFlash v1: each slot's argmax, or at temperature > 0 a draw from each slot's own tempered
        nucleus distribution q, slots independent (z-lab 0.1.0), returned with q for the rejection test."""
        logits = self.compute_logits(hidden, head)  # [n, k, V]
        if temperature <= 0:
            return greedy(logits), None
        q = sampling_probs(logits, temperature, top_p)  # [n, k, V]
        return draw(q.reshape(-1, q.shape[-1]), generator).view(q.shape[:-1]), q

    # -- z-lab checkpoint I/O -------------------------------------------------------------------
    def to_config_dict(self) -> dict[str, Any]:
        """config.json in z-lab's layout: every DFlash key the checkpoint had stays readable where
        z-lab reads it; the newer fields, when set, go inside dflash_config (where z-lab's MLX
        loader, vLLM and SGLang read them, and the PyTorch loader reads them first)."""
        cfg = dict(self.raw_config)
        cfg["architectures"] = [FAMILIES[self.family].architecture]
        cfg["model_type"] = "qwen3"
        cfg.pop("auto_map", None)  # we never ship remote code; the format is data
        dcfg = dict(cfg.get("dflash_config") or {})
        dcfg.update(mask_token_id=self.mask_token_id, target_layer_ids=self.target_layer_ids)
        s = self.settings
        for name, value, default in (("input_embedding_scale", s.input_embedding_scale, 1.0),
                                     ("output_multiplier", s.output_multiplier, 1.0),
                                     ("final_logit_softcapping", s.final_logit_softcapping, None)):
            cfg.pop(name, None)
            dcfg.pop(name, None)
            if value != default:
                dcfg[name] = value
        cfg["dflash_config"] = dcfg
        if "block_size" in (self.raw_config.get("dflash_config") or {}) or self.family != "dflash":
            cfg.pop("block_size", None)
            dcfg["block_size"] = self.block_size
        else:
            cfg["block_size"] = self.block_size
        return cfg

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        from dflash_trt.fsutil import write_json_atomic
        from dflash_trt.checkpoints.files import save_safetensors_atomic

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.checkpoint_state()
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        cfg = self.to_config_dict()
        cfg["dtype"] = dtype_name(dtype or next(self.parameters()).dtype)
        save_safetensors_atomic(state, directory / WEIGHTS_NAME)
        write_json_atomic(directory / CONFIG_NAME, cfg)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors of model.safetensors, named as the released checkpoints name them."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _qwen3_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3Config kwargs from a z-lab config dict (unknown keys are kept as attributes)."""
    kw = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type", "dtype", "torch_dtype")}
    # use_sliding_window is left as the config says: Qwen3Config then keeps or drops sliding_window
    # exactly as it does for z-lab 0.1.0 (config.py refuses the ambiguous combination)
    if "rope_parameters" not in kw and "rope_theta" in kw:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
    return kw


def make_draft_config(
    target_config: Any,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    dflash_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A z-lab drafter config sized for `target_config` (hidden size must equal the target's).
    `dflash_fields`: more dflash_config keys (input_embedding_scale, output_multiplier,
    final_logit_softcapping; a DFlash2 recipe, with architectures set by the caller)."""
    t = target_config
    hidden = t.hidden_size
    heads = num_attention_heads or t.num_attention_heads
    kv = num_key_value_heads or getattr(t, "num_key_value_heads", heads)
    hd = head_dim or getattr(t, "head_dim", None) or hidden // t.num_attention_heads
    n_target = t.num_hidden_layers
    rope_theta = _rope_theta(t)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or t.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(t, "rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(getattr(t, "max_position_embeddings", 4096)),
        "vocab_size": t.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id if mask_token_id is not None else t.vocab_size - 1,
            "target_layer_ids": target_layer_ids or build_target_layer_ids(n_target, num_layers),
            **(dflash_fields or {}),
        },
    }


def _rope_theta(config: Any) -> float:
    rp = getattr(config, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta else 10000.0

