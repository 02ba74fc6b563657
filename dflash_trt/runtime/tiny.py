"""Tiny randomly initialised targets and drafters, built from a config with no download.

Used by the tests (losslessness must hold for ANY drafter) and by `dflash-trt generate --tiny`.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_trt.runtime.drafters.dflash import DFlashDraftModel, make_draft_config

ARCHITECTURES = ("llama", "qwen3", "gpt_oss")


def tiny_target_config(
    arch: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
) -> Any:
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    hd = head_dim or hidden_size // num_heads
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        head_dim=hd, max_position_embeddings=512, tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common)
    elif arch == "gpt_oss":
        # MoE, attention sinks, sliding window on alternating layers: the gpt-oss shape, tiny.
        cfg = GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {ARCHITECTURES}")
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def tiny_target(arch: str = "llama", seed: int = 0, **kw: Any):
    from transformers import AutoModelForCausalLM

    cfg = tiny_target_config(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_logits(model)
    return model.eval()


# A small DFlash2 recipe for tiny drafters: 2 taps, groups of 8 channels, rank 8, 4 candidates.
TINY_DFLASH2_RECIPE = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


def random_draft(target_config: Any, seed: int = 0, family: str = "dflash", dflash2_recipe: dict[str, int] | None = None,
                 **kw: Any) -> DFlashDraftModel:
    """A random drafter for `target_config` (make_draft_config's sizes and fields). `family`
    "dflash2": a DFlash2 drafter with `dflash2_recipe` (default TINY_DFLASH2_RECIPE), z-lab's layout."""
    from dflash_trt.runtime.drafters.families import FAMILIES

    if family not in FAMILIES:
        raise ValueError(f"unknown drafter family {family!r}; use one of {', '.join(FAMILIES)}")
    if family == "dflash2":
        from dflash_trt.runtime.drafters.dflash2 import as_dflash2_config

        kw.setdefault("block_size", 8)
        cfg = as_dflash2_config(make_draft_config(target_config, **kw), dflash2_recipe or TINY_DFLASH2_RECIPE)
    else:
        cfg = make_draft_config(target_config, **kw)
    model = FAMILIES[family].model_class()(cfg)
    model.reset_parameters(seed=seed)
    return model.eval()


@torch.no_grad()
def _spread_logits(model: Any) -> None:
    """HF's init (std 0.02) makes near-uniform logits with frequent exact ties, which would make
    greedy decoding ill-defined. Scale the head so the argmax is unambiguous."""
    model.get_output_embeddings().weight.mul_(25.0)
