"""Drafter families, and the ONE place a checkpoint's family and format are told apart.

A family is data (:class:`DrafterFamily`) plus the module that runs it: DFlash v1
(runtime/draft_model.py) and DFlash2 (runtime/dflash2.py). The rule is z-lab's and vLLM's
(dflash 0.1.0 benchmark.py; vLLM's model registry):

- a config.json with a ``speculators_model_type`` key is the speculators format, whatever its
  ``architectures`` say; its type (``dflash`` / ``dflash2``) names the family, and it is read as its
  z-lab equivalent (runtime/speculators_format.py);
- otherwise ``"DFlash2DraftModel"`` in ``architectures`` is DFlash2, ``"DFlashDraftModel"`` (or no
  architectures at all) is DFlash v1; any other architecture is refused.

Where z-lab would quietly run a checkpoint as something else, this refuses in one line instead: a
v1 config carrying DFlash2 keys (z-lab runs it as v1 and drops them; TensorRT-LLM runs it as
DFlash2), a DFlash2 config without all four of its keys inside ``dflash_config`` (TensorRT-LLM's
rule; vLLM and SGLang read them there only), and weights of the other family.

:func:`load_drafter` is the one call that loads a drafter directory.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime import dflash2
from dflash_trt.runtime.draft_vocab import FILE as DRAFT_VOCAB_FILE

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class DrafterFamily:
    name: str  # "dflash" | "dflash2"
    architecture: str  # what z-lab writes in config.json `architectures`
    speculators_type: str  # speculators_model_type of the same drafter in the speculators format
    recipe_keys: tuple[str, ...]  # dflash_config keys the family requires (and no other family carries)
    tensor_parts: tuple[str, ...]  # parameter-name parts of the weights only this family has
    model: str  # "module:Class" that runs it

    def model_class(self) -> type:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)

    def check(self, cfg: dict[str, Any], where: Any) -> None:
        """One line for the first field of `cfg` (z-lab layout) this family cannot run."""
        from dflash_trt.runtime.draft_model import DFlashSettings

        settings = DFlashSettings.from_config_dict(cfg, str(where))
        if self.recipe_keys:
            dflash2.DFlash2Recipe.from_config_dict(cfg, str(where), settings.block_size)


DFLASH = DrafterFamily("dflash", "DFlashDraftModel", "dflash", (), (), "dflash_trt.runtime.draft_model:DFlashDraftModel")
DFLASH2 = DrafterFamily("dflash2", "DFlash2DraftModel", "dflash2", dflash2.RECIPE_KEYS, dflash2.TENSOR_PARTS,
                        "dflash_trt.runtime.dflash2:DFlash2DraftModel")
FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (DFLASH, DFLASH2)}
ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


def is_speculators(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg


def detect_family(cfg: Any, where: Any = CONFIG_NAME) -> DrafterFamily:
    """The family of a drafter config.json (z-lab or speculators format), or one line saying why none."""
    if not isinstance(cfg, dict):
        raise DFlashError(f"{where}: a drafter config must be a JSON object, got {type(cfg).__name__}")
    if is_speculators(cfg):
        kind = cfg["speculators_model_type"]
        for family in FAMILIES.values():
            if family.speculators_type == kind:
                return family
        known = ", ".join(f.speculators_type for f in FAMILIES.values())
        raise DFlashError(f"{where}: speculators_model_type={kind!r} is not a drafter this project runs (it runs "
                          f"{known}); use a DFlash or DFlash2 speculator")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise DFlashError(f"{where}: architectures={archs!r} is not a list; fix config.json")
    named = [f for f in FAMILIES.values() if f.architecture in archs]
    if len(named) > 1:
        raise DFlashError(f"{where}: architectures={archs} names both DFlash and DFlash2; keep the one the weights are")
    if named:
        family = named[0]
    elif not archs:
        family = DFLASH  # z-lab loads every checkpoint it does not know as DFlashDraftModel
    elif any("dflash" in str(a).lower() for a in archs):
        raise DFlashError(f"{where}: architectures={archs} is a drafter architecture this project does not run (it "
                          f"runs {' and '.join(ARCHITECTURES)}); use one of those drafters")
    else:
        raise DFlashError(f"{where}: architectures={archs} is not a DFlash drafter; pass the drafter directory "
                          f"(config.json with architectures [\"{DFLASH.architecture}\"] or [\"{DFLASH2.architecture}\"])")
    _check_recipe(cfg, family, where)
    return family


def _check_recipe(cfg: dict[str, Any], family: DrafterFamily, where: Any) -> None:
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise DFlashError(f"{where}: dflash_config must be an object, got {type(dcfg).__name__}; fix config.json")
    for other in FAMILIES.values():
        if other is family:
            continue
        foreign = [k for k in other.recipe_keys if k in dcfg or k in cfg]
        if foreign:
            raise DFlashError(f"{where}: carries {foreign[0]} (a {other.name} drafter's key) but "
                              f"architectures says {family.architecture}; a {other.name} drafter names "
                              f"[\"{other.architecture}\"] in architectures, else remove {', '.join(foreign)}")
    for key in family.recipe_keys:
        if key not in dcfg:
            moved = " (it is at the top level: move it into dflash_config)" if key in cfg else ""
            raise DFlashError(f"{where}: dflash_config has no {key}{moved}; a {family.name} drafter needs all of "
                              f"{', '.join(family.recipe_keys)} there, as its training recipe set them")


def zlab_config(cfg: dict[str, Any], where: Any = CONFIG_NAME) -> dict[str, Any]:
    """`cfg` in z-lab's layout: a z-lab config as it is, a speculators config converted
    (runtime/speculators_format.py). Every reader of a drafter config goes through this."""
    if isinstance(cfg, dict) and is_speculators(cfg):
        from dflash_trt.runtime.speculators_format import zlab_config_of

        return zlab_config_of(cfg, where)
    return cfg


def read_drafter(directory: str | Path, allow_pickle: bool = False
                 ) -> tuple[DrafterFamily, dict[str, Any], dict[str, torch.Tensor]]:
    """(family, config.json in z-lab's layout, tensors named as z-lab names them) of a drafter
    directory in either format, every tensor checked by name and shape against the config."""
    from dflash_trt.checkpoints.files import load_state_dict, read_json

    directory = Path(directory)
    raw = read_json(directory / CONFIG_NAME, what="drafter config")
    family = detect_family(raw, directory)
    cfg = zlab_config(raw, directory)
    family.check(cfg, directory / CONFIG_NAME)  # its fields, named with the file they are in
    if family is DFLASH2 and (directory / DRAFT_VOCAB_FILE).is_file():
        raise DFlashError(f"{directory}: {DRAFT_VOCAB_FILE} beside a DFlash2 drafter; its candidate selector ranks "
                          f"the whole vocabulary (codebooks of every token), delete {DRAFT_VOCAB_FILE}")
    with torch.device("meta"):  # names and shapes only: nothing allocated
        expected = family.model_class()(cfg).checkpoint_state()
    state = load_state_dict(directory, allow_pickle=allow_pickle)
    if is_speculators(raw):
        from dflash_trt.runtime.speculators_format import zlab_state_of

        state = zlab_state_of(state, directory)
    if family is DFLASH2:
        state = dflash2.rename_codebooks(state)
    check_weights(expected, state, family, directory)
    return family, cfg, state


def load_drafter(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 allow_pickle: bool = False) -> Any:
    """The drafter in `directory` (z-lab or speculators format) as the model of its family, in
    `dtype` on `device`, with its draft vocabulary. Reads config.json and safetensors only (no
    remote code; pickle weights only with `allow_pickle`). The one call that loads a drafter."""
    from dflash_trt.runtime.draft_vocab import load_draft_vocab

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
