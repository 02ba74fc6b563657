"""The pieces a pair is loaded from: the target, the drafter and the tokenizer of checkpoint
directories, reading safetensors and configs only (no remote code). The one pair loader
(dflash_trt/pairs.py) and the build (engine/builder.py) put them together."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from dflash_trt.checkpoints.files import PICKLE_SUFFIXES, read_json
from dflash_trt.checkpoints.quiet import quiet_transformers
from dflash_trt.checkpoints.streaming import check_safetensors, load_checkpoint
from dflash_trt.errors import DFlashError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_target(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                allow_pickle: bool = False):
    """A HF causal LM from a local directory; never executes code from it.

    A quantized checkpoint (gpt-oss's MXFP4 experts, a ModelOpt FP8/NVFP4 export) is dequantized
    in plain torch, one tensor at a time (dflash_trt.checkpoints.streaming), so the source of an
    engine and the engine itself load through the same exact dequantization.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    cfg = read_json(directory / "config.json", what="target config")
    if cfg.get("quantization_config"):
        return load_checkpoint(directory, dtype, device)
    check_safetensors(directory)  # a truncated or lying file is one line here, as in `build`
    if not list(directory.glob("*.safetensors")):
        pickles = [p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if not pickles:
            raise DFlashError(f"{directory}: no *.safetensors weights; pass a HF checkpoint directory")
        if not allow_pickle:
            raise DFlashError(f"{directory}: only pickle weights ({pickles[0].name}); convert to safetensors or pass --allow-pickle")
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, trust_remote_code=False, use_safetensors=not allow_pickle or None,
                local_files_only=True,
            )
    except pickle.UnpicklingError as e:  # --allow-pickle: the weights-only unpickler refused the file
        from dflash_trt.checkpoints.files import pickle_refusal

        raise pickle_refusal(directory, e) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise DFlashError(f"cannot load target from {directory}: {str(e).splitlines()[0]}")
    return model.to(device).eval()


def load_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer, or None when it ships none (tiny random pairs: generation then
    folds bytes into the vocabulary). Tokenizer files that are there but cannot be read are a
    DFlashError: falling back to bytes would answer a real model's prompts with garbage."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(directory, trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises plain Exception on a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise DFlashError(f"{directory}: tokenizer files present but unreadable ({first}); re-export the "
                          "checkpoint's tokenizer (tokenizer.json, tokenizer_config.json)") from None
