"""Loading a drafter directory: its family told, its config and every tensor checked, the model built.

:func:`load_drafter` is the one call that loads a drafter (z-lab or speculators format, either
family); :func:`read_drafter` is its checked reading without building the model (what
``dflash-trt convert-draft`` copies). The family comes from the registry
(runtime/drafters/families.py), the config in z-lab's layout from
runtime/drafters/speculators_format.py, the model class from the family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.drafters.dflash import DFlashSettings
from dflash_trt.runtime.drafters.dflash2 import DFlash2Recipe, rename_codebooks
from dflash_trt.runtime.drafters.draft_vocab import FILE as DRAFT_VOCAB_FILE
from dflash_trt.runtime.drafters.draft_vocab import load_draft_vocab
from dflash_trt.runtime.drafters.families import (CONFIG_NAME, DFLASH2, FAMILIES, DrafterFamily, detect_family,
                                                  is_speculators)
from dflash_trt.runtime.drafters.speculators_format import zlab_config, zlab_state_of


def check_fields(family: DrafterFamily, cfg: dict[str, Any], where: Any) -> None:
    """One line for the first field of `cfg` (z-lab layout) `family` cannot run."""
    settings = DFlashSettings.from_config_dict(cfg, str(where))
    if family is DFLASH2:
        DFlash2Recipe.from_config_dict(cfg, str(where), settings.block_size)


def read_drafter(directory: str | Path, allow_pickle: bool = False
                 ) -> tuple[DrafterFamily, dict[str, Any], dict[str, torch.Tensor]]:
    """(family, config.json in z-lab's layout, tensors named as z-lab names them) of a drafter
    directory in either format, every tensor checked by name and shape against the config."""
    from dflash_trt.checkpoints.files import load_state_dict, read_json

    directory = Path(directory)
    raw = read_json(directory / CONFIG_NAME, what="drafter config")
    family = detect_family(raw, directory)
    cfg = zlab_config(raw, directory)
    check_fields(family, cfg, directory / CONFIG_NAME)  # its fields, named with the file they are in
    if family is DFLASH2 and (directory / DRAFT_VOCAB_FILE).is_file():
        raise DFlashError(f"{directory}: {DRAFT_VOCAB_FILE} beside a DFlash2 drafter; its candidate selector ranks "
                          f"the whole vocabulary (codebooks of every token), delete {DRAFT_VOCAB_FILE}")
    with torch.device("meta"):  # names and shapes only: nothing allocated
        expected = family.model_class()(cfg).checkpoint_state()
    state = load_state_dict(directory, allow_pickle=allow_pickle)
    if is_speculators(raw):
        state = zlab_state_of(state, directory)
    if family is DFLASH2:
        state = rename_codebooks(state)
    check_weights(expected, state, family, directory)
    return family, cfg, state


def load_drafter(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 allow_pickle: bool = False) -> Any:
    """The drafter in `directory` (z-lab or speculators format) as the model of its family, in
    `dtype` on `device`, with its draft vocabulary. Reads config.json and safetensors only (no
    remote code; pickle weights only with `allow_pickle`). The one call that loads a drafter."""
    directory = Path(directory)
    family, cfg, state = read_drafter(directory, allow_pickle)
    # built in the dtype it is loaded in: in float32 (torch's default) the modules' own
    # random weights were 2x a bf16 drafter beside its loaded weights and the cast copy (the
    # peak of a build's load phase at 830M parameters); the weights are overwritten either way
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else prev)
    try:
        model = family.model_class()(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.load_state_dict(state, strict=False)
    # bounds-checked against the drafter's vocab_size here, against the target's by the runtime
    vocab = cfg.get("vocab_size")
    model.draft_vocab = load_draft_vocab(directory, int(vocab) if vocab else None)
    return model.to(device=device, dtype=dtype).eval()


def check_weights(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], family: DrafterFamily,
                  where: Any) -> None:
    """One line for the first way `state` (model.safetensors) differs from the tensors the config
    implies, naming what the difference means."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    for other in FAMILIES.values():
        theirs = [k for k in unexpected if other is not family and any(p in k for p in other.tensor_parts)]
        if theirs:
            raise DFlashError(f"{where}: model.safetensors holds {len(theirs)} tensors of a {other.name} drafter "
                              f"(first: {theirs[0]}) but config.json describes a {family.name} drafter; a "
                              f"{other.name} checkpoint names [\"{other.architecture}\"] in architectures"
                              + (f" and {', '.join(other.recipe_keys)} in dflash_config" if other.recipe_keys else ""))
    own = [k for k in missing if any(p in k for p in family.tensor_parts)]
    if own and len(own) == len(missing):
        raise DFlashError(f"{where}: config.json describes a {family.name} drafter but model.safetensors lacks its "
                          f"{len(own)} {family.name} tensors (first: {own[0]}); the weights are of another "
                          "drafter, or incomplete")
    if missing:
        raise DFlashError(f"{where}: drafter weights missing {len(missing)} tensors (first: {missing[0]}); "
                          "the checkpoint is incomplete or not in z-lab format")
    if unexpected:
        layers = [k for k in unexpected if k.startswith("layers.")]
        why = ("num_hidden_layers in config.json is lower than the weights' layers" if layers else
               "config.json does not describe these weights")
        raise DFlashError(f"{where}: drafter weights have {len(unexpected)} unexpected tensors (first: "
                          f"{unexpected[0]}); {why}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise DFlashError(
                f"{where}: tensor {k} has shape {tuple(state[k].shape)} but config.json implies "
                f"{tuple(v.shape)}; config.json and model.safetensors disagree"
            )
