"""The drafter a training run starts from: its shape, its mask token, its initial weights.

The target is frozen; its embedding and lm_head are shared with the drafter (which has none), so
the drafter's config is the target's plus the DFlash settings (block size, the target layers it
reads, the mask token). A bad layer id or mask id is refused BEFORE the long data generation,
with the pair loader's own checks (runtime/validate.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.train import log
from dflash_trt.train.config import TrainConfig

MASK_TOKEN_NOTE = (
    "The target has no spare embedding row, so the DFlash mask is a reserved special token of its tokenizer "
    "that the instruct model never emits (the first added special token that is not bos/eos/pad/unk or a chat "
    "token, and never occurs in the target's own responses; SmolLM2: a StarCoder-style code-metadata token). "
    "It is an ordinary row of the target's embedding, so TensorRT-LLM, vLLM and SGLang load it as-is."
)


def choose_mask_token(tokenizer: Any | None, vocab_size: int, never_seen: set[int] | None = None) -> int:
    """A token id the target never emits, usable by every runtime (an existing embedding row).

    SmolLM2 (like most targets) has no spare embedding row, so the mask is a RESERVED special
    token: the first added special token that is not a chat/control token (bos/eos/pad/unk,
    <|im_start|>, <|im_end|>) and never occurs in the training data. For SmolLM2 this is id 3,
    ``<repo_name>``, one of the StarCoder-style code-metadata tokens (ids 3..16) an instruct
    model never writes. Without a tokenizer (tiny random pairs) the last vocabulary id is used.
    """
    never_seen = never_seen or set()
    if tokenizer is None:
        return vocab_size - 1
    control = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    control |= {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid in sorted(decoder):
        tok = decoder[tid]
        if getattr(tok, "special", False) and tid not in control and tid not in never_seen and tid < vocab_size:
            return int(tid)
    raise DFlashError("the tokenizer has no reserved special token to use as the DFlash mask; pass --mask-token-id")


def feature_layer_ids(cfg: TrainConfig, target_config: Any) -> list[int]:
    """The target layers feeding the drafter: `cfg.target_layer_ids`, else z-lab's spread over the
    depth (30 layers, 3 features -> [1, 14, 27]; shallow targets dedupe)."""
    from dflash_trt.runtime.draft_model import build_target_layer_ids

    n_layers = int(target_config.num_hidden_layers)
    return cfg.target_layer_ids or sorted(set(build_target_layer_ids(n_layers, cfg.num_target_features)))


def drafter_config(cfg: TrainConfig, target_config: Any, layer_ids: list[int], mask_id: int | None = None) -> Any:
    """The drafter's config, checked against the target (`mask_id` None: a placeholder, to
    check the shape before the mask token is known)."""
    from dflash_trt.runtime.draft_model import make_draft_config
    from dflash_trt.runtime.validate import validate_pair

    mask = mask_id if mask_id is not None else int(target_config.vocab_size) - 1
    dcfg = make_draft_config(target_config, mask_token_id=mask, num_layers=cfg.num_layers,
                             block_size=cfg.block_size, target_layer_ids=layer_ids,
                             intermediate_size=cfg.intermediate_size)
    validate_pair(dcfg, target_config, where="train-draft")
    return dcfg


def mask_token_for(cfg: TrainConfig, tokenizer: Any, vocab_size: int, seen: set[int]) -> int:
    """`cfg.mask_token_id`, else :func:`choose_mask_token` over the response tokens `seen`."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token(tokenizer, vocab_size, seen)
    if mask_id in seen:
        log(f"warning: mask token {mask_id} occurs in the target's responses; acceptance may suffer")
    return mask_id


def new_drafter(cfg: TrainConfig, dcfg: Any, device: Any) -> Any:
    """The drafter to train, on `device` in train mode: seeded random weights (`cfg.seed`), or
    `cfg.init_from`'s where given."""
    import torch

    from dflash_trt.runtime.draft_model import DFlashDraftModel

    torch.manual_seed(cfg.seed)
    draft = DFlashDraftModel(dcfg)
    draft.reset_parameters(seed=cfg.seed)
    if cfg.init_from:
        init_from(draft, Path(cfg.init_from))
    return draft.to(device).train()


def init_from(draft: Any, source: Path) -> None:
    """Copy a trained drafter's weights into `draft` (e.g. grow 1 layer into 2 and keep training).

    Every tensor of `source` must exist in `draft` with the same shape, and both must agree on
    mask token, target layer ids and block size (otherwise the copied weights would mean
    something else). Layers `source` lacks keep their random init except their two output
    projections (attention o_proj, MLP down_proj), which are zeroed: a residual block with zero
    output is the identity, so training starts exactly from the source drafter's predictions.
    """
    import torch

    from dflash_trt.runtime.draft_model import DFlashDraftModel

    src = DFlashDraftModel.from_pretrained(source)
    for what in ("mask_token_id", "target_layer_ids", "block_size"):
        if getattr(src, what) != getattr(draft, what):
            raise DFlashError(f"--init-from {source}: {what} is {getattr(src, what)} there but "
                              f"{getattr(draft, what)} in this run; pass the same value or drop --init-from")
    mine = draft.state_dict()
    theirs = {k: v for k, v in src.state_dict().items() if not k.startswith("rotary_emb.")}
    for k, v in theirs.items():
        if k not in mine or mine[k].shape != v.shape:
            raise DFlashError(f"--init-from {source}: tensor {k} {tuple(v.shape)} has no match in this drafter "
                              f"({tuple(mine[k].shape) if k in mine else 'absent'}); use the same sizes or more layers")
    with torch.no_grad():
        for k, v in theirs.items():
            mine[k].copy_(v.to(mine[k].dtype))
        for i in range(len(src.layers), len(draft.layers)):
            draft.layers[i].self_attn.o_proj.weight.zero_()
            draft.layers[i].mlp.down_proj.weight.zero_()
    log(f"initialised from {source}: {len(theirs)} tensors copied, "
        f"{len(draft.layers) - len(src.layers)} new layer(s) start as identity")
