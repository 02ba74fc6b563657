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
    if "attention_bias" in cfg and not isinstance(cfg["attention_bias"], bool):
        raise DFlashError(f"{where}: attention_bias={cfg['attention_bias']!r} is not true/false; fix config.json")
