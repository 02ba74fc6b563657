"""The drafter a training run starts from: its family, its shape, its mask token, its initial weights.

The target is frozen; its embedding and lm_head are shared with the drafter (which has none), so
the drafter's config is the target's plus the DFlash settings (block size, the target layers it
reads, the mask token) and, for a DFlash2 drafter, its recipe (convolution taps and group size,
selector rank and top-k; runtime/drafters/dflash2.py). A bad layer id, mask id or recipe is refused BEFORE
the long data generation, with the pair loader's own checks (runtime/drafters/validate.py).

A DFlash2 drafter starts as the DFlash drafter it contains (DFlash2DraftModel.start_as_dflash):
its convolutions the identity and its selector's walk the plain argmax. So ``--family dflash2
--init-from <a v1 drafter>`` starts exactly where that drafter is -- the same proposals, step for
step -- and training moves on from there.
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
    from dflash_trt.runtime.drafters.dflash import build_target_layer_ids

    n_layers = int(target_config.num_hidden_layers)
    return cfg.target_layer_ids or sorted(set(build_target_layer_ids(n_layers, cfg.num_target_features)))


def training_family(cfg: TrainConfig) -> tuple[str, dict[str, int] | None]:
    """(the family this run trains, its DFlash2 recipe or None): `cfg.family`, else the
    `--init-from` drafter's; the recipe from the flags, else that drafter's, else speculators'
    defaults."""
    from dflash_trt.train.config import DFLASH2_DEFAULTS

    source_family, source_recipe = "dflash", {}
    if cfg.init_from:
        from dflash_trt.checkpoints.files import read_json
        from dflash_trt.runtime.drafters.families import CONFIG_NAME, DFLASH2, detect_family
        from dflash_trt.runtime.drafters.speculators_format import zlab_config

        where = Path(cfg.init_from) / CONFIG_NAME
        raw = read_json(where, what="--init-from drafter config")
        source = detect_family(raw, where)
        source_family = source.name
        if source is DFLASH2:
            dcfg = zlab_config(raw, where)["dflash_config"]
            source_recipe = {k: dcfg[k] for k in DFLASH2_DEFAULTS}
    family = cfg.family or source_family
    if family == "dflash":
        if source_family == "dflash2":
            raise DFlashError(f"--init-from {cfg.init_from} is a DFlash2 drafter and --family dflash drops its "
                              "convolutions and selector (other proposals); train it as --family dflash2")
        if cfg.recipe_flags():
            flag = next(iter(cfg.recipe_flags())).replace("_", "-")
            raise DFlashError(f"--{flag} is a DFlash2 setting but this run trains a DFlash (v1) drafter; "
                              "add --family dflash2 or drop it")
        return family, None
    return family, {**DFLASH2_DEFAULTS, **source_recipe, **cfg.recipe_flags()}


def check_recipe(recipe: dict[str, int], hidden_size: int, block_size: int, vocab_size: int) -> None:
    """One line for a DFlash2 recipe the target's sizes cannot take (the ranges are TrainConfig's)."""
    g, k, top_k = recipe["conv_group_size"], recipe["conv_kernel_size"], recipe["selector_top_k"]
    if hidden_size % g:
        raise DFlashError(f"train-draft: conv_group_size {g} does not divide the target's hidden_size {hidden_size}; "
                          f"pass --conv-group-size with a divisor of {hidden_size}")
    if k > block_size:
        raise DFlashError(f"train-draft: conv_kernel_size {k} is longer than the block ({block_size}); its taps "
                          f"never cross a block, pass --conv-kernel-size <= {block_size}")
    if top_k > vocab_size:
        raise DFlashError(f"train-draft: selector_top_k {top_k} exceeds the vocabulary ({vocab_size}); pass a "
                          "smaller --selector-top-k")


def drafter_config(cfg: TrainConfig, target_config: Any, layer_ids: list[int], mask_id: int | None = None) -> Any:
    """The drafter's config in z-lab's layout, checked against the target (`mask_id` None: a
    placeholder, to check the shape before the mask token is known)."""
    from dflash_trt.runtime.drafters.dflash import make_draft_config
    from dflash_trt.runtime.drafters.validate import validate_pair

    mask = mask_id if mask_id is not None else int(target_config.vocab_size) - 1
    dcfg = make_draft_config(target_config, mask_token_id=mask, num_layers=cfg.num_layers,
                             block_size=cfg.block_size, target_layer_ids=layer_ids,
                             intermediate_size=cfg.intermediate_size)
    _, recipe = training_family(cfg)
    if recipe is not None:
        from dflash_trt.runtime.drafters.dflash2 import as_dflash2_config

        check_recipe(recipe, int(target_config.hidden_size), cfg.block_size, int(target_config.vocab_size))
        dcfg = as_dflash2_config(dcfg, recipe)
    validate_pair(dcfg, target_config, where="train-draft")
    return dcfg


def mask_token_for(cfg: TrainConfig, tokenizer: Any, vocab_size: int, seen: set[int]) -> int:
    """`cfg.mask_token_id`, else :func:`choose_mask_token` over the response tokens `seen`."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token(tokenizer, vocab_size, seen)
    if mask_id in seen:
        log(f"warning: mask token {mask_id} occurs in the target's responses; acceptance may suffer")
    return mask_id


def new_drafter(cfg: TrainConfig, dcfg: Any, device: Any) -> Any:
    """The drafter to train (the family `dcfg` names), on `device` in train mode: seeded random
    weights (`cfg.seed`; a DFlash2 drafter's extra parts started as DFlash), or `cfg.init_from`'s
    where given."""
    import torch

    from dflash_trt.runtime.drafters.families import detect_family

    torch.manual_seed(cfg.seed)
    draft = detect_family(dcfg, "train-draft").model_class()(dcfg)
    draft.reset_parameters(seed=cfg.seed)
    if draft.family == "dflash2":
        draft.start_as_dflash()
    if cfg.init_from:
        init_from(draft, Path(cfg.init_from))
    return draft.to(device).train()


def init_from(draft: Any, source: Path) -> None:
    """Copy a trained drafter's weights into `draft` (e.g. grow 1 layer into 2 and keep training,
    or make a DFlash2 drafter of a DFlash one).

    Every tensor of `source` must exist in `draft` with the same shape, and both must agree on
    mask token, target layer ids and block size (otherwise the copied weights would mean
    something else). Layers `source` lacks keep their random init except their two output
    projections (attention o_proj, MLP down_proj), which are zeroed: a residual block with zero
    output is the identity, so training starts exactly from the source drafter's predictions.
    A DFlash2 `draft` from a DFlash `source` takes every shared tensor (layers, fc, norms); its
    convolutions and selector stay as :func:`new_drafter` started them (the identity, the plain
    argmax), so it proposes what `source` proposes.
    """
    import torch

    from dflash_trt.runtime.drafters.loading import load_drafter

    src = load_drafter(source)
    if src.family == "dflash2" and draft.family != "dflash2":
        raise DFlashError(f"--init-from {source} is a DFlash2 drafter but this run trains a DFlash (v1) one, which "
                          "would drop its convolutions and selector; train it as --family dflash2")
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
    grown = src.family != draft.family
    log(f"initialised from {source} ({src.family}): {len(theirs)} tensors copied, "
        f"{len(draft.layers) - len(src.layers)} new layer(s) start as identity"
        + (", the convolutions as the identity and the selector as the plain argmax" if grown else ""))
