"""Checks that a drafter fits a target, before any heavy work. Each failure: one actionable line."""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.drafters.dflash import DFlashSettings, check_is_drafter


def validate_settings(settings: DFlashSettings, where: str = "drafter") -> None:
    """Checks that need only the drafter's own config.

    Repeated target_layer_ids are allowed, as z-lab's reference allows them (its own
    build_target_layer_ids gives [1, 1] for a 4-layer target and 2 draft layers): the drafter's
    fc then reads that layer's features twice. The draft length K is checked where it is chosen
    (SpeculationSettings)."""
    if settings.block_size < 2:
        raise DFlashError(
            f"{where}: block_size={settings.block_size}; DFlash needs block_size >= 2 "
            "(one anchor plus at least one drafted token), fix block_size in config.json"
        )


def validate_pair(
    draft_config: dict[str, Any],
    target_config: Any,
    where: str = "drafter",
) -> DFlashSettings:
    """Raise DFlashError unless the drafter config (z-lab or speculators format) fits the target config."""
    from dflash_trt.runtime.drafters.speculators_format import zlab_config

    check_is_drafter(draft_config, where)
    draft_config = zlab_config(draft_config, where)
    s = DFlashSettings.from_config_dict(draft_config, where=f"{where} config.json")
    validate_settings(s, where)
    t_hidden = int(target_config.hidden_size)
    t_layers = int(target_config.num_hidden_layers)
    t_vocab = int(target_config.vocab_size)
    d_hidden = draft_config.get("hidden_size")
    if d_hidden != t_hidden:
        raise DFlashError(
            f"{where}: hidden_size={d_hidden} but the target's hidden_size={t_hidden}; the drafter borrows the "
            "target's embedding and lm_head, so use a drafter trained for this target"
        )
    if s.num_target_layers is not None and s.num_target_layers != t_layers:
        raise DFlashError(
            f"{where}: num_target_layers={s.num_target_layers} but the target has {t_layers} layers; "
            "this drafter was trained for a different target"
        )
    bad = [i for i in s.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise DFlashError(
            f"{where}: dflash_config.target_layer_ids={list(s.target_layer_ids)} has {bad} outside the target's "
            f"layers 0..{t_layers - 1}; use ids of the target's decoder layers"
        )
    if not 0 <= s.mask_token_id < t_vocab:
        raise DFlashError(
            f"{where}: dflash_config.mask_token_id={s.mask_token_id} is outside the target vocabulary "
            f"(0..{t_vocab - 1}); pick an id the target never emits, e.g. a reserved special token"
        )
    d_vocab = draft_config.get("vocab_size")
    if d_vocab is not None and int(d_vocab) != t_vocab:
        raise DFlashError(
            f"{where}: vocab_size={d_vocab} but the target's vocab_size={t_vocab}; the pair must share a tokenizer"
        )
    return s
