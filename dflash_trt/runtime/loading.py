"""Loading a target / drafter pair from directories: safetensors and configs only, no remote code."""

from __future__ import annotations

import pickle
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoints.files import PICKLE_SUFFIXES, read_json
from dflash_trt.checkpoints.quiet import quiet_transformers
from dflash_trt.checkpoints.streaming import check_safetensors, load_checkpoint
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.cpu_packing import pack_cpu_linears
from dflash_trt.runtime.draft_model import DFlashDraftModel
from dflash_trt.runtime.validate import validate_pair

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedPair:
    target: Any  # transformers PreTrainedModel
    draft: DFlashDraftModel
    tokenizer: Any | None


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively AND PyTorch uses it: x86 with AVX512-BF16
    (or AMX-BF16) where torch dispatches to AVX-512 and oneDNN may use its bf16 instructions; Arm
    with the BF16 extension.

    Without it torch emulates bf16 matmuls, which run several times slower than float32 (an AVX2
    EPYC: a [4 x 576] x [576 x 1536] product 1.20 ms in bf16, 0.25 ms in float32, issue 35). It is
    what torch reports, not only the CPU's flags, so ``ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine resolves as an AVX2 machine would.
    """
    if platform.machine() in ("x86_64", "AMD64"):
        capability = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
        has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: "avx512_bf16" in _cpu_flags())()
        has_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: "amx_bf16" in _cpu_flags())()
        onednn_bf16 = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", lambda: True)()
        return capability.startswith("AVX512") and (has_bf16 or has_amx) and bool(onednn_bf16)
    return "bf16" in _cpu_flags()  # Arm: the BF16 extension (/proc/cpuinfo Features)


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return set()


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The fastest exact-enough dtype on `device`: bf16 on GPUs (fp16 on those without bf16) and
    on bf16-native CPUs, float32 on other CPUs. Any other device (``meta``, where device paths
    are checked without a GPU) resolves as a GPU with bf16 does.

    On CPU it matters for DFlash beyond raw speed: verifying a 16-token block in bf16 costs
    ~1.4 plain steps on an AVX512-BF16 core, in float32 ~2.6 (measured on the embedded pair).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def compute_dtype(weights: torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """What to RUN a model whose weights are `weights` in, on `device`: `weights` itself, except a
    16-bit dtype on a CPU that does not multiply it natively (bf16 without native bf16, fp16 on
    any CPU), which runs in float32. Upcasting is exact (every bf16/fp16 value is a float32), so
    the model is the same one; only its arithmetic rounds less, and runs 3-5x faster there."""
    if torch.device(device).type != "cpu" or weights not in (torch.bfloat16, torch.float16):
        return weights
    return weights if weights == torch.bfloat16 and cpu_has_native_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype from its name; "auto" resolves with :func:`auto_dtype` for `device`."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise DFlashError(f"unknown dtype {name!r}; use one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


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


def load_pair(target_dir: str | Path, draft_dir: str | Path, dtype: str | torch.dtype = "float32",
              device: str = "cpu", allow_pickle: bool = False, pack: bool = True) -> LoadedPair:
    """Validate the pair from configs first (cheap), then load weights for inference. `pack`:
    oneDNN-packed linear layers in both models for float32 on CPU (runtime/cpu_packing.py;
    ignored elsewhere)."""
    from transformers import AutoConfig

    dt = parse_dtype(dtype, device)
    draft_cfg = read_json(Path(draft_dir) / "config.json", what="drafter config")
    read_json(Path(target_dir) / "config.json", what="target config")
    try:
        tcfg = AutoConfig.from_pretrained(Path(target_dir), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise DFlashError(f"cannot read target config in {target_dir}: {str(e).splitlines()[0]}")
    validate_pair(draft_cfg, tcfg, where=str(draft_dir))
    tokenizer = load_tokenizer(target_dir)  # an unreadable one fails before the weights load
    target = load_target(target_dir, dt, device, allow_pickle)
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=dt, device=device, allow_pickle=allow_pickle)
    if pack:
        pack_cpu_linears(target)
        pack_cpu_linears(draft)
    return LoadedPair(target, draft, tokenizer)
