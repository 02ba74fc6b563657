"""DFlash2 drafters (z-lab dflash 0.1.0, ``architectures: ["DFlash2DraftModel"]``).

A DFlash drafter (runtime/drafters/dflash.py) with two additions, both read from ``dflash_config``:

- a grouped dynamic causal convolution around each layer's attention and MLP
  (``conv_kernel_size`` K taps, ``conv_group_size`` channels sharing a dynamic coefficient).
  For the block's hidden states x[t] (block slots only; the context enters through K/V as in v1):
  ``d = kernel_projection(x)`` viewed [t, 2, K, G]; before the sublayer
  ``y[t, c] = sum_{o<K} (base[0][o, c] + d[t, 0, o, g(c)]) * x[t-o, c]`` with g(c) = c // group_size
  and x = 0 before slot 0; after it the same sum over the sublayer's output with base[1] and
  d[t, 1] -- coefficients from the sublayer's INPUT; the residual is added after. The taps never
  reach into another block: a block is its own sequence here, and :func:`grouped_dynamic_conv`
  also masks ``slot % block_size < tap`` when several blocks are laid end to end (vLLM's and
  TensorRT-LLM's layout).
- a low-rank candidate selector that walks the draft slots 1..k from the anchor token: slot j keeps
  the top ``selector_top_k`` logits U[j, :] of its candidates C[j, :], and scores each
  ``U[j, i] + sum_r A[prev, r] * g[j, r] * Bc[C[j, i], r]`` (A, Bc: the predecessor and successor
  codebooks [V, selector_rank], g = hidden_projection(h_j)); the chosen candidate becomes the next
  predecessor. At temperature 0 the walk takes the argmax; above it it samples from
  softmax(scores / T) over the K candidates -- no top-p/top-k on q -- and keeps those q rows for
  the rejection test (runtime/decoding/rejection.py).

Checkpoints store the codebooks as bare tensors (``candidate_selector.predecessor_codebook``, no
``.weight``): speculators trains them as parameters, and vLLM, TensorRT-LLM and z-lab's loaders
(which rename them onto nn.Embedding) read them so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.decoding.sampling import draw, greedy, sampling_probs
from dflash_trt.runtime.drafters.config import _check_int, draft_value
from dflash_trt.runtime.drafters.dflash import DFlashDecoderLayer, DFlashDraftModel, DraftKVCache
from dflash_trt.runtime.drafters.families import DFLASH2
from dflash_trt.runtime.targets.lean_forward import LayerFunctions

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
MAX_SELECTOR_RANK = 1 << 16


@dataclass(frozen=True)
class DFlash2Recipe:
    """The four DFlash2 fields of ``dflash_config``, checked against the drafter's own sizes."""

    conv_kernel_size: int  # K taps, 1..block_size
    conv_group_size: int  # channels per dynamic coefficient; divides hidden_size
    selector_rank: int  # r of the codebooks [V, r]
    selector_top_k: int  # candidates per slot, 2..vocab_size

    @staticmethod
    def from_config_dict(cfg: dict[str, Any], where: str, block_size: int) -> "DFlash2Recipe":
        dcfg = cfg.get("dflash_config") or {}
        hidden, vocab = cfg["hidden_size"], cfg.get("vocab_size")
        if vocab is None:
            raise DFlashError(f"{where}: no vocab_size; a DFlash2 drafter's codebooks have one row per token of the "
                              "target's vocabulary, add vocab_size to config.json")
        k = _check_int(where, "dflash_config.conv_kernel_size", dcfg["conv_kernel_size"], 1, block_size)
        g = _check_int(where, "dflash_config.conv_group_size", dcfg["conv_group_size"], 1, hidden)
        if hidden % g:
            raise DFlashError(f"{where}: dflash_config.conv_group_size={g} does not divide hidden_size={hidden}; "
                              f"accepted: a divisor of {hidden}, fix config.json")
        r = _check_int(where, "dflash_config.selector_rank", dcfg["selector_rank"], 1, MAX_SELECTOR_RANK)
        # one candidate leaves the walk nothing to choose (TensorRT-LLM refuses it too)
        top_k = _check_int(where, "dflash_config.selector_top_k", dcfg["selector_top_k"], 2, vocab)
        return DFlash2Recipe(k, g, r, top_k)

    def to_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in DFLASH2.recipe_keys}


# ---------------------------------------------------------------------------------------------
# The convolution
# ---------------------------------------------------------------------------------------------


def grouped_dynamic_conv(
    x: torch.Tensor,  # [n, L, H] block slots (L = block_size, or several whole blocks end to end)
    dynamic: torch.Tensor,  # [n, L, K, G] the token-dependent coefficients of each tap and group
    base: torch.Tensor,  # [K, H] the static coefficients
    group_size: int,
    block_size: int,
) -> torch.Tensor:  # [n, L, H]
    """y[t, c] = sum_{o<K} (base[o, c] + dynamic[t, o, c // group_size]) * x[t-o, c], where x[t-o] is
    0 unless slot t-o is in t's block. Summed as z-lab sums it (base term, then the dynamic term,
    tap by tap), so the bits are z-lab's."""
    n, L, H = x.shape
    G = H // group_size
    blocks = x.view(n, L, G, group_size)
    dynamic = dynamic.reshape(n, L, base.shape[0], G, 1)
    slot = torch.arange(L, device=x.device) % block_size  # [L]
    out = torch.zeros_like(blocks)
    for tap in range(base.shape[0]):
        if tap == 0:
            values = blocks
        else:
            values = F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))  # x[t - tap], zeros before slot 0
            if L > block_size:  # several blocks end to end: a tap never reads the previous block
                values = torch.where((slot >= tap)[:, None, None], values, torch.zeros_like(values))
        out = out + base[tap].view(G, group_size).to(x.dtype) * values
        out = torch.addcmul(out, dynamic[:, :, tap], values)
    return out.view(n, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: :meth:`prepare` before it, :meth:`finish` after."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [2 (in, out), K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, L, H] -> (the sublayer's input [n, L, H], the output side's coefficients [n, L, K, G])."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        y = grouped_dynamic_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, self.block_size)
        return y, dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(x, dynamic, self.base_kernel[1], self.group_size, self.block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with a convolution around its attention and around its MLP."""

    def __init__(self, config: Qwen3Config, layer_idx: int, recipe: DFlash2Recipe, block_size: int) -> None:
        super().__init__(config, layer_idx)
        h = config.hidden_size
        self.attention_conv = GroupedDynamicCausalConv(h, recipe.conv_kernel_size, recipe.conv_group_size, block_size)
        self.mlp_conv = GroupedDynamicCausalConv(h, recipe.conv_kernel_size, recipe.conv_group_size, block_size)

    def forward(self, x, ctx, cos, sin, cache, attn_mask, queries: slice | None = None,
                functions: LayerFunctions | None = None):
        """`functions`: the layer's halves around its cache write and attention (default eager;
        runtime/gpu/compiled_layers.py passes torch.compile'd ones)."""
        pre, post = functions or DFLASH2_EAGER
        q, k, v, out_kernel = pre(self, x, ctx, cos, sin)
        attended = self.self_attn.attend(q, k, v, cache, attn_mask)  # [n, nh, S, hd]
        x = post(self, x, attended, out_kernel)
        # every slot is computed: the taps of slot t read the sublayers' outputs at t-1.. too
        return x if queries is None else x[:, queries]


def dflash2_attention_inputs(layer: DFlash2DecoderLayer, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DFlash2 layer up to its attention: input norm, the convolution's input side, the
    projections -> q, k, v and the output side's coefficients [n, S, K, G]."""
    h, out_kernel = layer.attention_conv.prepare(layer.input_layernorm(x))
    return (*layer.self_attn.projections(h, ctx, cos, sin), out_kernel)


def dflash2_layer_output(layer: DFlash2DecoderLayer, x: torch.Tensor, attended: torch.Tensor,
                         out_kernel: torch.Tensor) -> torch.Tensor:
    """The rest of a DFlash2 layer over every block slot: o_proj, the convolution's output side,
    residual, then the MLP inside its convolution pair, residual -> [n, S, H]."""
    x = x + layer.attention_conv.finish(layer.self_attn.output(attended), out_kernel)
    h, out_kernel = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
    return x + layer.mlp_conv.finish(layer.mlp(h), out_kernel)


DFLASH2_EAGER = LayerFunctions(dflash2_attention_inputs, dflash2_layer_output)


# ---------------------------------------------------------------------------------------------
# The candidate selector
# ---------------------------------------------------------------------------------------------


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, recipe: DFlash2Recipe) -> None:
        super().__init__()
        self.top_k = recipe.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, recipe.selector_rank))  # A [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, recipe.selector_rank))  # Bc [V, r]
        self.hidden_projection = nn.Linear(hidden_size, recipe.selector_rank, bias=False)

    def walk(
        self,
        hidden: torch.Tensor,  # [n, L, H] draft slots 1..L after the final norm
        logits: torch.Tensor,  # [n, L, V] their draft logits
        anchor: torch.Tensor,  # [n] the first predecessor: the block's slot 0
        choose: "Choice",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # path [n, L], candidates [n, L, K], q [n, L, K]
        """The walk over the slots (see the module docstring): `choose` picks each slot's candidate
        from its scores (:func:`argmax_choice`, :func:`sampled_choice`, or a batched step's rows
        each their own way); q is None when it never sampled. On the device throughout: L small
        steps, no value read by the host (a batched step's one read stays its only sync)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)  # [n, L, K] each
        g = self.hidden_projection(hidden)  # [n, L, r]
        predecessor = anchor
        path, q_rows = [], []
        for j in range(hidden.shape[1]):  # sequential: each slot's scores depend on the previous choice
            context = F.embedding(predecessor, self.predecessor_codebook) * g[:, j]  # [n, r]
            successors = F.embedding(candidates[:, j], self.successor_codebook)  # [n, K, r]
            scores = unary[:, j] + torch.einsum("br,bkr->bk", context, successors)  # [n, K]
            index, q = choose(scores)  # [n], [n, K] | None
            if q is not None:
                q_rows.append(q)
            predecessor = candidates[:, j].gather(-1, index[:, None])[:, 0]  # [n]
            path.append(predecessor)
        return torch.stack(path, 1), candidates, torch.stack(q_rows, 1) if q_rows else None


# a slot's scores [n, K] -> the chosen candidate [n] and, when drawn, the q row it was drawn from [n, K]
Choice = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]


def argmax_choice(scores: torch.Tensor) -> tuple[torch.Tensor, None]:
    return greedy(scores), None


def sampled_choice(temperature: float, generator: torch.Generator | None = None) -> Choice:
    """Draws from softmax(scores / T) over the candidates: no top-p or top-k on q (z-lab 0.1.0)."""

    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = sampling_probs(scores, temperature)  # [n, K]
        return draw(q, generator), q

    return choose


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: DFlash's layers with convolutions, and the candidate selector for its proposals."""

    family = "dflash2"
    eager_layer_functions = DFLASH2_EAGER

    @functools.cached_property
    def recipe(self) -> DFlash2Recipe:
        return DFlash2Recipe.from_config_dict(self.raw_config, "drafter config.json", self.block_size)

    def make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        return DFlash2DecoderLayer(config, layer_idx, self.recipe, self.block_size)

    def add_family_modules(self, config: Qwen3Config) -> None:
        self.candidate_selector = CandidateSelector(int(config.vocab_size), config.hidden_size, self.recipe)

    @torch.no_grad()
    def start_as_dflash(self) -> None:
        """Make this drafter propose exactly what its DFlash (v1) body proposes, the point training
        starts from (train/drafter.py): every convolution the identity (speculators' init:
        base[:, 0] = 1, the other taps 0, kernel_projection 0, so y = x on both sides of each
        sublayer) and the selector's hidden_projection 0 (g = 0: every transition score is 0, the
        walk scores each slot's top-k by its unary logits alone, and its argmax is the plain argmax).
        The codebooks keep their random values: the score is a product of three factors, and only
        with two of them non-zero does the third (the projection) get a gradient at the start."""
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        self.candidate_selector.hidden_projection.weight.zero_()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None, std: float | None = None) -> None:
        """Random init, each convolution near the identity (speculators starts it exactly there:
        base[:, 0] = 1, the rest 0), so a random DFlash2 drafter still passes its inputs on."""
        super().reset_parameters(seed, std)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] += 1.0

    def propose(
        self,
        hidden: torch.Tensor,  # [n, k, H]
        anchor: torch.Tensor,  # [n]
        head: Callable[[torch.Tensor], torch.Tensor],
        temperature: float = 0.0,
        top_p: float = 1.0,  # unused: the walk's q has no nucleus cut (z-lab 0.1.0)
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [n, k], q [n, k, V] or None
        """The selector's walk; at temperature > 0 its q rows scattered over the vocabulary (zero
        off the candidates), the draft distribution the rejection test uses."""
        logits = self.compute_logits(hidden, head)  # [n, k, V]
        choose = sampled_choice(temperature, generator) if temperature > 0 else argmax_choice
        path, candidates, q = self.candidate_selector.walk(hidden, logits, anchor, choose)
        return path, None if q is None else scatter_q(q, candidates, logits.shape[-1])

    def to_config_dict(self) -> dict[str, Any]:
        cfg = super().to_config_dict()
        for key in DFLASH2.recipe_keys:  # inside dflash_config, where every engine reads them
            cfg.pop(key, None)
        cfg["dflash_config"].update(self.recipe.to_dict())
        return cfg


def scatter_q(q: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The walk's q rows [..., K] over their candidates [..., K] as distributions over the
    vocabulary [..., V] (zero off the candidates): the q the rejection test reads."""
    return torch.zeros(*q.shape[:-1], vocab_size, dtype=q.dtype, device=q.device).scatter(-1, candidates, q)


def as_dflash2_config(cfg: dict[str, Any], recipe: dict[str, int]) -> dict[str, Any]:
    """A DFlash (v1) drafter config (runtime/drafters/dflash.make_draft_config) made DFlash2, in z-lab's
    released layout: the architecture, the recipe and block_size inside dflash_config."""
    out = {k: v for k, v in cfg.items() if k != "block_size"}
    out["architectures"] = [DFLASH2.architecture]
    out["dflash_config"] = {**(cfg.get("dflash_config") or {}), **recipe, "block_size": draft_value(cfg, "block_size")}
    return out


def rename_codebooks(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Codebooks saved with a `.weight` suffix (z-lab's nn.Embedding names) under their bare names."""
    return {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v for k, v in state.items()}


__all__ = ["CandidateSelector", "DFlash2DraftModel", "DFlash2Recipe", "DraftKVCache", "GroupedDynamicCausalConv",
           "as_dflash2_config", "grouped_dynamic_conv"]
