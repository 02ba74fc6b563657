"""What the node needs to know about a drafter, read from its config (and weight names) alone.

- its family (runtime/drafters/families.py: DFlash v1 or DFlash2). TensorRT-LLM reads DFlash2 from the
  checkpoint under ``decoding_type: DFlash`` (DFlashForCausalLM: dflash_config conv/selector keys
  or a DFlash2 architecture; shared/design/upstream-2026-08.md C), so the family changes no YAML
  key: the manifest records it, `doctor` checks the node's TensorRT-LLM has DFlash2, and the vLLM
  and SGLang commands say what their DFlash2 needs.
- whether its sliding-window layers run non-causally there: TensorRT-LLM's DFlash block decode is
  bidirectional for v1 drafters whatever ``is_causal`` says (only subclasses opt into causal
  sliding layers), and honours the top-level ``is_causal`` for DFlash2 only. Such drafters (the
  released DFlash2 ones) are refused by the TRTLLM attention backend (PR 19159): VANILLA or FA4.
- refusals: a DFlash2 drafter with a reduced draft vocabulary (``d2t``/``t2d`` tensors, a
  ``draft_vocab_size`` below the vocabulary, or this project's draft_vocab.json) -- TensorRT-LLM
  raises NotImplementedError for it (``_apply_dflash2_selector``): the selector ranks the whole
  vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

REDUCED_VOCAB_TENSORS = ("d2t", "t2d")


@dataclass(frozen=True)
class DrafterTraits:
    family: str  # dflash | dflash2
    non_causal_sliding: bool  # sliding-window layers TensorRT-LLM runs bidirectionally


def has_sliding_window(cfg: dict[str, Any]) -> bool:
    """sliding_attention layers with a window (``sliding_window``, or dflash_config's use_swa /
    swa_window_size, which TensorRT-LLM reads)."""
    dcfg = cfg.get("dflash_config") or {}
    if dcfg.get("use_swa") and dcfg.get("swa_window_size"):
        return True
    return "sliding_attention" in (cfg.get("layer_types") or []) and bool(cfg.get("sliding_window"))


def drafter_traits(cfg: dict[str, Any], directory: str | Path | None = None) -> DrafterTraits:
    """The family and attention traits of a z-lab-format drafter config; DFlashError for a DFlash2
    drafter TensorRT-LLM would refuse (reduced vocabulary). `directory`: also checks its files."""
    from dflash_trt.runtime.drafters.families import DFLASH2, detect_family

    where = directory if directory is not None else "drafter config.json"
    family = detect_family(cfg, where)
    if family is DFLASH2:
        _refuse_reduced_vocab(cfg, Path(directory) if directory is not None else None)
    causal_honoured = family is DFLASH2 and cfg.get("is_causal") is True
    return DrafterTraits(family.name, has_sliding_window(cfg) and not causal_honoured)


def _refuse_reduced_vocab(cfg: dict[str, Any], directory: Path | None) -> None:
    from dflash_trt.runtime.drafters.draft_vocab import FILE as DRAFT_VOCAB_FILE

    fix = "DFlash2's candidate selector ranks the whole vocabulary; use a full-vocabulary drafter"
    vocab, draft_vocab = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if draft_vocab is not None and vocab is not None and int(draft_vocab) != int(vocab):
        raise DFlashError(f"{directory or 'drafter'}: a DFlash2 drafter with draft_vocab_size={draft_vocab} below "
                          f"vocab_size={vocab}: TensorRT-LLM raises NotImplementedError for a reduced draft "
                          f"vocabulary (d2t) with DFlash2; {fix}")
    if directory is None:
        return
    if (directory / DRAFT_VOCAB_FILE).is_file():
        raise DFlashError(f"{directory}: {DRAFT_VOCAB_FILE} beside a DFlash2 drafter: a reduced draft vocabulary, which "
                          f"TensorRT-LLM refuses with DFlash2 (NotImplementedError) and this project too; delete "
                          f"{DRAFT_VOCAB_FILE} ({fix})")
    if list(directory.glob("*.safetensors")):
        from dflash_trt.checkpoints.streaming import CheckpointReader

        found = [k for k in CheckpointReader(directory).keys() if k.split(".")[-1] in REDUCED_VOCAB_TENSORS]
        if found:
            raise DFlashError(f"{directory}: a DFlash2 drafter whose weights hold {found[0]} (a reduced draft "
                              f"vocabulary): TensorRT-LLM raises NotImplementedError for d2t with DFlash2; {fix}")
