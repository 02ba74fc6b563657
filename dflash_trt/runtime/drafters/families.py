"""Drafter families, and the ONE place a checkpoint's family and format are told apart.

A family is data (:class:`DrafterFamily`) plus the module that runs it: DFlash v1
(runtime/drafters/dflash.py) and DFlash2 (runtime/drafters/dflash2.py), each with the batched
runtime's proposer for it (runtime/batched/dflash_proposer.py, runtime/batched/dflash2_proposer.py).
The registry sits BELOW the families it lists: it names their classes as "module:Class" and
imports them only when one is asked for (:meth:`DrafterFamily.model_class`), so a family's
module may read its own data here (DFlash2's recipe keys) without an import circle. The rule is
z-lab's and vLLM's (dflash 0.1.0 benchmark.py; vLLM's model registry):

- a config.json with a ``speculators_model_type`` key is the speculators format, whatever its
  ``architectures`` say; its type (``dflash`` / ``dflash2``) names the family, and it is read as its
  z-lab equivalent (runtime/drafters/speculators_format.py);
- otherwise ``"DFlash2DraftModel"`` in ``architectures`` is DFlash2, ``"DFlashDraftModel"`` (or no
  architectures at all) is DFlash v1; any other architecture is refused.

Where z-lab would quietly run a checkpoint as something else, this refuses in one line instead: a
v1 config carrying DFlash2 keys (z-lab runs it as v1 and drops them; TensorRT-LLM runs it as
DFlash2), a DFlash2 config without all four of its keys inside ``dflash_config`` (TensorRT-LLM's
rule; vLLM and SGLang read them there only), and weights of the other family.

:func:`~dflash_trt.runtime.drafters.loading.load_drafter` is the one call that loads a drafter
directory; :func:`~dflash_trt.runtime.drafters.speculators_format.zlab_config` the one reader of a
config in either format.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dflash_trt.errors import DFlashError

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class DrafterFamily:
    name: str  # "dflash" | "dflash2"
    architecture: str  # what z-lab writes in config.json `architectures`
    speculators_type: str  # speculators_model_type of the same drafter in the speculators format
    recipe_keys: tuple[str, ...]  # dflash_config keys the family requires (and no other family carries)
    tensor_parts: tuple[str, ...]  # parameter-name parts of the weights only this family has
    model: str  # "module:Class" that runs it
    proposer: str  # "module:Class" that drafts with it in the batched runtime

    def model_class(self) -> type:
        return _imported(self.model)

    def proposer_class(self) -> type:
        return _imported(self.proposer)


def _imported(where: str) -> type:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


DFLASH = DrafterFamily("dflash", "DFlashDraftModel", "dflash", (), (),
                       "dflash_trt.runtime.drafters.dflash:DFlashDraftModel",
                       "dflash_trt.runtime.batched.dflash_proposer:DFlashProposer")
DFLASH2 = DrafterFamily(
    "dflash2", "DFlash2DraftModel", "dflash2",
    # dflash_config keys every DFlash2 drafter carries (z-lab has no defaults for them; TensorRT-LLM
    # refuses a partial set, vLLM indexes them directly); runtime/drafters/dflash2.py reads them
    ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    # parameter-name parts only DFlash2 has (telling its weights apart from a v1 checkpoint's)
    (".attention_conv.", ".mlp_conv.", "candidate_selector."),
    "dflash_trt.runtime.drafters.dflash2:DFlash2DraftModel",
    "dflash_trt.runtime.batched.dflash2_proposer:DFlash2Proposer")
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
