"""Type and range of every drafter config.json field the runtime reads, checked before use.

A config.json comes from anywhere (a download, a hand edit); a field of the wrong type ("sixteen")
or out of range (block_size 100000) must end in one line naming the field, the value and the
accepted range, not in a traceback from torch or a silent allocation of gigabytes.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashError

# z-lab's drafters use blocks of 8..16; a block is drafted and verified as one batch, so past 64
# the attention mask and verification cost grow while acceptance never reaches that far.
MAX_BLOCK_SIZE = 64

# field -> (kind, lowest, highest); highest None = unbounded. "int" excludes bool.
INT_FIELDS: dict[str, tuple[int, int | None]] = {
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 256),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),
    "intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, None),
    "num_target_layers": (1, 1024),
    "block_size": (2, MAX_BLOCK_SIZE),
    "mask_token_id": (0, None),  # < the target's vocab_size: validate_pair
    "sliding_window": (1, None),
}
FLOAT_FIELDS: dict[str, tuple[float, float]] = {  # open interval (lowest, highest)
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, float("inf")),
}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# The attention layer kinds a drafter may name in `layer_types` (z-lab's two; the runtime builds
# the mask of each: runtime/drafters/dflash.py block_attention_mask).
LAYER_TYPES = ("full_attention", "sliding_attention")


def _range(lo: int, hi: int | None) -> str:
    return f"{lo}..{hi}" if hi is not None else f">= {lo}"


def _check_int(where: str, name: str, value: Any, lo: int, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DFlashError(f"{where}: {name}={value!r} is {type(value).__name__}, not an integer; "
                          f"accepted: an integer {_range(lo, hi)}, fix {name} in config.json")
    if value < lo or (hi is not None and value > hi):
        raise DFlashError(f"{where}: {name}={value} is out of range; accepted: {_range(lo, hi)}, "
                          f"fix {name} in config.json")
    return value


def draft_value(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    """z-lab's lookup of a DFlash field (dflash 0.1.0, model.py `_draft_value`): ``dflash_config``
    first, then the top level, then `default`. Every DFlash/DFlash2 key is read through this."""
    dcfg = cfg.get("dflash_config") or {}
    return dcfg[name] if name in dcfg else cfg.get(name, default)


def check_number(where: str, name: str, value: Any, positive: bool = False) -> float:
    """A finite number (bools excluded), > 0 when `positive`; else one line naming the field."""
    import math

    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise DFlashError(f"{where}: {name}={value!r} is not {want}; fix {name} in config.json")
    return float(value)


def check_drafter_config(cfg: Any, where: str = "config.json") -> None:
    """DFlashError (one line, with the accepted range) for the first bad field of a drafter config;
    fields may sit at top level or in ``dflash_config`` (block_size, mask_token_id, target_layer_ids)."""
    if not isinstance(cfg, dict):
        raise DFlashError(f"{where}: a drafter config must be a JSON object, got {type(cfg).__name__}")
    dcfg = cfg.get("dflash_config")
    if dcfg is None:
        dcfg = {}
    if not isinstance(dcfg, dict):
        raise DFlashError(f"{where}: dflash_config must be an object, got {type(dcfg).__name__}; fix config.json")
    for name in REQUIRED:
        if cfg.get(name) is None:
            raise DFlashError(f"{where}: no {name}; accepted: an integer {_range(*INT_FIELDS[name])}, add it to config.json")
    for name, (lo, hi) in INT_FIELDS.items():
        for scope, src in (("", cfg), ("dflash_config.", dcfg)):
            if src.get(name) is not None:
                _check_int(where, scope + name, src[name], lo, hi)
    for name, (lo, hi) in FLOAT_FIELDS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value < hi:
            raise DFlashError(f"{where}: {name}={value!r} is not a number in ({lo}, {hi}); fix {name} in config.json")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise DFlashError(f"{where}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                          f"accepted: a divisor of {heads}, fix config.json")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise DFlashError(f"{where}: hidden_size={cfg['hidden_size']} is not divisible by num_attention_heads={heads} "
                          "and there is no head_dim; add head_dim to config.json")
    ids = dcfg.get("target_layer_ids")
    if ids is not None:
        hi = INT_FIELDS["num_target_layers"][1] - 1  # against the target's layers: validate_pair
        if not isinstance(ids, list) or not ids:
            raise DFlashError(f"{where}: dflash_config.target_layer_ids={ids!r} is not a non-empty list; "
                              f"accepted: a list of layer ids 0..{hi}, fix config.json")
        for i in ids:
            _check_int(where, "dflash_config.target_layer_ids[]", i, 0, hi)
    for name in ("attention_bias", "use_sliding_window"):
        if name in cfg and not isinstance(cfg[name], bool):
            raise DFlashError(f"{where}: {name}={cfg[name]!r} is not true/false; fix config.json")
    if cfg.get("is_causal") is not None and not isinstance(cfg["is_causal"], bool):
        raise DFlashError(f"{where}: is_causal={cfg['is_causal']!r} is not true, false or null; fix config.json")
    _check_layer_types(cfg, where)


def _check_layer_types(cfg: dict[str, Any], where: str) -> None:
    """`layer_types` names one known kind per layer; a sliding window is unambiguous.

    z-lab 0.1.0 reads the window through transformers' Qwen3Config, which drops `sliding_window`
    unless `use_sliding_window` is true (vLLM reads the same config object): a checkpoint with
    sliding_attention layers, a sliding_window and no use_sliding_window runs there with NO window.
    The author surely meant one, so that combination is refused rather than guessed."""
    types = cfg.get("layer_types")
    if types is None:
        return
    n = cfg["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != n:
        raise DFlashError(f"{where}: layer_types={types!r} must list one type per layer ({n}); fix config.json")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise DFlashError(f"{where}: layer_types has {unknown[0]!r}, a kind of drafter layer this project does not "
                          f"run (it runs {', '.join(LAYER_TYPES)}); use a drafter with those layers")
    if ("sliding_attention" in types and cfg.get("sliding_window") is not None
            and cfg.get("use_sliding_window") is not True):
        raise DFlashError(f"{where}: layer_types has sliding_attention layers and sliding_window="
                          f"{cfg['sliding_window']} but use_sliding_window is not true, so z-lab and vLLM run them "
                          "without a window; set \"use_sliding_window\": true (a window) or remove sliding_window "
                          "(none) in config.json")
