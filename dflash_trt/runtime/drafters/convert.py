"""A drafter written in the other format: the speculators config of a z-lab one, and the
conversion ``dflash-trt convert-draft`` runs (either way; the weights copied bit for bit).

The fields map as runtime/drafters/speculators_format.py's table says; reading either format is
there, below the drafter models (every loader reads through it). Writing sits above them: it
checks a config through the drafter's own settings (runtime/drafters/dflash.py) and reads the
source through the one drafter loader (runtime/drafters/loading.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dflash_trt.checkpoints.files import read_json, save_safetensors_atomic
from dflash_trt.errors import DFlashError
from dflash_trt.fsutil import atomic_directory, write_json_atomic
from dflash_trt.runtime.drafters.config import draft_value
from dflash_trt.runtime.drafters.dflash import DFlashSettings
from dflash_trt.runtime.drafters.families import detect_family
from dflash_trt.runtime.drafters.loading import read_drafter
from dflash_trt.runtime.drafters.speculators_format import (FORMATS, NEWER_FIELDS, NOT_LAYER_KEYS,
                                                            SPECULATOR_ARCHITECTURES, SPECULATORS_VERSION)


def speculators_config_of(cfg: dict[str, Any], where: Any = "config.json", verifier: str | None = None,
                          verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """The speculators config.json of a z-lab DFlash/DFlash2 config (see the module docstring).
    `verifier`: the target's name or path, recorded where speculators looks for it."""
    family = detect_family(cfg, where)
    settings = DFlashSettings.from_config_dict(cfg, where)
    for name, default in NEWER_FIELDS.items():
        value = draft_value(cfg, name, default)
        if value != default and not (name == "final_logit_softcapping" and settings.final_logit_softcapping is None):
            raise DFlashError(f"{where}: {name}={value} has no field in the speculators format, so vLLM would run this "
                              "drafter without it; keep the z-lab format for it")
    if cfg.get("is_causal") is True:
        raise DFlashError(f"{where}: is_causal=true makes full-attention layers causal, which the speculators format "
                          "cannot say (its full-attention layers are bidirectional); keep the z-lab format")
    layer = {k: v for k, v in cfg.items() if k not in NOT_LAYER_KEYS + family.recipe_keys + tuple(NEWER_FIELDS)}
    layer["model_type"] = "qwen3"
    B = settings.block_size
    out: dict[str, Any] = {
        "architectures": [SPECULATOR_ARCHITECTURES[family.name]],
        "speculators_model_type": family.speculators_type,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["vocab_size"],
        "block_size": B,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in settings.target_layer_ids],
        "mask_token_id": settings.mask_token_id,
        "sliding_window_non_causal": cfg.get("is_causal") is False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": family.speculators_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B - 1, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
    }
    dcfg = cfg.get("dflash_config") or {}
    for key in family.recipe_keys:
        out[key] = dcfg[key]
    if settings.num_target_layers is not None:
        out["num_target_layers"] = settings.num_target_layers
    return out


def convert_drafter(src: str | Path, out: str | Path, to: str, verifier: str | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Write the drafter in `src` (either format) to `out` in format `to`, atomically; the weights
    are copied bit for bit. Returns what was written (format, family, tensors)."""
    if to not in FORMATS:
        raise DFlashError(f"--to {to!r} is not one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise DFlashError(f"{out} is the source drafter itself; write the converted drafter to another directory")
    family, zcfg, state = read_drafter(src)  # every check a load makes: config, recipe, each tensor
    if to == "zlab":
        cfg = dict(zcfg)
    else:
        archs = None
        if verifier is not None and (Path(verifier) / "config.json").is_file():
            archs = read_json(Path(verifier) / "config.json", what="verifier config").get("architectures")
        cfg = speculators_config_of(zcfg, src, verifier, archs)
    with atomic_directory(out, overwrite=overwrite, what="the converted drafter") as tmp:
        save_safetensors_atomic(state, tmp / "model.safetensors")
        write_json_atomic(tmp / "config.json", cfg)
        for f in sorted(src.iterdir()):  # tokenizer files, draft_vocab.json: as they are
            if f.is_file() and f.name != "config.json" and f.name != "MANIFEST.json" and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
    return {"format": to, "family": family.name, "tensors": len(state), "out": str(out)}
