"""HF safetensors checkpoints read and written one tensor at a time.

Why: a build used to hold the checkpoint two or three times over (a float32 load, an exported
copy, a float32 reload for the acceptance gate). Here a checkpoint is read through a
`CheckpointReader` (safetensors' lazy `safe_open`: one tensor in host memory at a time) and
written shard by shard, so a build's host memory stays near one copy of the model it runs, and a
`--quant none` engine never loads a model at all.

- `load_checkpoint`: any checkpoint the reference runtime runs (float, ModelOpt FP8/NVFP4,
  gpt-oss MXFP4) as a float HF model, each tensor dequantized (dflash_trt.checkpoints.dequant) and
  placed on its device as it is read: one device, or a device map spread over several GPUs.
- `convert_checkpoint`: the engine's `target/` for `--quant none`: float tensors cast to the
  engine dtype, MXFP4 expert tensors (and every other integer tensor) byte for byte, shard for
  shard; config.json keeps its quantization_config and gains the RoPE keys transformers 4.57
  reads (dflash_trt.checkpoints.hf_config_compat).
- `copy_aux_files`: tokenizer, chat template and generation config, byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoints.dequant import (IGNORED_SUFFIXES, SUPPORTED_ALGOS, dequantize_tensor, read_fp8_block,
                                            read_quant_algo)
from dflash_trt.checkpoints.files import read_json
from dflash_trt.checkpoints.hf_config_compat import both_generations
from dflash_trt.checkpoints.placement import device_of
from dflash_trt.checkpoints.quiet import quiet_transformers
from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import dtype_name

INDEX_NAME = "model.safetensors.index.json"
# Small top-level files a checkpoint needs beside its weights (tokenizer, templates, configs).
# Subdirectories (gpt-oss ships `original/` and `metal/` copies of its weights) are never copied.
AUX_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
WEIGHT_FILES = ("config.json", INDEX_NAME, "hf_quant_config.json")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# safetensors dtype names (the format's header) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 2**20


class CheckpointReader:
    """key -> tensor over a directory's *.safetensors files, one tensor in memory at a time.

    Tensors are READ into memory the process owns (plain file reads at the header's offsets),
    not mapped: a tensor that points into a file's memory map keeps every page of that file
    resident for as long as any tensor of it lives -- dequantized sources included -- which is
    what made a loaded model cost more than its own size. Format: an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.key_file: dict[str, Path] = {}
        self._entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise DFlashError(f"{self.directory}: no *.safetensors weights; pass a HF checkpoint directory")
        self._files = files
        for f in files:
            for key, entry in _read_header(f).items():
                self.key_file[key] = f
                self._entries[key] = entry

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def keys(self) -> list[str]:
        return list(self.key_file)

    def has(self, key: str) -> bool:
        return key in self.key_file

    def get(self, key: str) -> torch.Tensor:
        dtype, shape, start, end = self._entries[key]
        out = torch.empty(end - start, dtype=torch.uint8)
        with open(self.key_file[key], "rb") as fh:
            fh.seek(start)
            if fh.readinto(memoryview(out.numpy())) != end - start:
                raise DFlashError(f"{self.key_file[key]}: truncated at tensor {key}; re-download or re-export it")
        return out.view(dtype).reshape(shape)

    def files(self) -> list[Path]:
        return list(self._files)

    def keys_of(self, f: Path) -> list[str]:
        return [k for k, g in self.key_file.items() if g == f]


def check_safetensors(directory: str | Path) -> None:
    """Every *.safetensors file of `directory` checked against its own header (truncated, corrupt,
    offsets or lengths past the end of the file): the one DFlashError line, before any loader --
    this one or transformers' -- reads a tensor."""
    for f in sorted(Path(directory).glob("*.safetensors")):
        _read_header(f)


def _read_header(f: Path) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """{key: (dtype, shape, absolute start, absolute end)} of one safetensors file."""
    bad = f"{f}: corrupt or truncated safetensors file"
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise DFlashError(f"{bad} (header length {n}); re-download or re-export it")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DFlashError(f"{bad} (header is not JSON: {e}); re-download or re-export it")
    except OSError as e:  # a directory named *.safetensors, no read permission, an I/O error
        raise DFlashError(f"{f}: cannot read it ({e.strerror or e}); pass a readable safetensors file") from None
    if not isinstance(header, dict):
        raise DFlashError(f"{bad} (header is a JSON {type(header).__name__}, not an object); re-download or re-export it")
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(x) for x in info["shape"]]
            start, end = (int(x) + 8 + n for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DFlashError(f"{bad} (tensor {key}: {str(info)[:80]}); re-download or re-export it")
        if min(shape, default=0) < 0:
            raise DFlashError(f"{bad} (tensor {key} has shape {shape}); re-download or re-export it")
        numel = 1
        for d in shape:
            numel *= d
        if start < 8 + n or end > size or end - start != numel * torch.empty((), dtype=dtype).element_size():
            raise DFlashError(f"{bad} (tensor {key} lies outside the file); re-download or re-export it")
        entries[key] = (dtype, shape, start, end)
    return entries


# ---------------------------------------------------------------------------------------------
# Loading (dequantizing) into a float model
# ---------------------------------------------------------------------------------------------


def model_config(directory: Path) -> Any:
    """The transformers config of a checkpoint, without its quantization_config (the loaded model
    is float: the weights are dequantized here, not by transformers' quantizers)."""
    from transformers import AutoConfig

    raw = read_json(directory / "config.json", what="target config")
    raw = {k: v for k, v in raw.items() if k not in ("quantization_config", "transformers_version")}
    model_type = raw.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{directory}: cannot build a {model_type!r} config ({str(e).splitlines()[0]}); "
                          "pass a HF causal-LM checkpoint")


@contextlib.contextmanager
def _empty_weights() -> Iterator[None]:
    """Parameters without memory (meta) while buffers stay real (rotary tables are computed at
    init); without accelerate, plain CPU tensors that are never written (not resident either)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        ctx: Any = contextlib.nullcontext()
    else:
        ctx = init_empty_weights(include_buffers=False)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: random init, only slower
        no_init: Any = contextlib.nullcontext()
    else:
        no_init = no_init_weights()
    with ctx, no_init:
        yield


def empty_model(cfg: Any, dtype: torch.dtype) -> Any:
    """A causal LM of `cfg` whose parameters hold no memory yet."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), _empty_weights():
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _set_parameter(model: Any, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    device_map: dict[str, Any] | None = None) -> Any:
    """A float HF causal LM from any checkpoint the engine writes, read one tensor at a time.

    Each tensor is dequantized (FP8, NVFP4, MXFP4) and cast to the parameter's dtype, then placed
    on its device: `device`, or per module by `device_map` (accelerate's format; the model is
    then dispatched so activations follow the layers across GPUs). Peak host memory: the model
    itself when on the CPU, one tensor when on GPUs.
    """
    directory = Path(directory)
    algo = read_quant_algo(directory)
    if algo is not None and algo not in SUPPORTED_ALGOS:
        raise DFlashError(f"{directory}: quant_algo {algo} is not supported by the reference runtime "
                          f"(only {', '.join(SUPPORTED_ALGOS)}); rebuild with --quant fp8 or nvfp4")
    fp8_block = read_fp8_block(directory)
    cfg = model_config(directory)
    model = empty_model(cfg, dtype)
    placement: dict[str, Any] = dict(device_map) if device_map else {"": device}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tied_names = set(getattr(model, "_tied_weights_keys", None) or {"lm_head.weight": None})
    missing: list[str] = []
    used: set[str] = set()
    with CheckpointReader(directory) as ckpt:
        for name, param in list(model.named_parameters()):
            target_device = device_of(placement, name)
            try:
                got = dequantize_tensor(name, tuple(param.shape), algo, ckpt.has, ckpt.get, param.dtype, target_device,
                                        fp8_block)
            except KeyError as e:
                raise DFlashError(f"{directory}: quantized tensor {name} has no scale {e}; the export is incomplete, "
                                  "rebuild")
            except ValueError as e:
                raise DFlashError(f"{directory}: tensor {name}: {e}; the checkpoint does not match its config.json")
            if got is None:
                if not (tied and name in tied_names):  # tied copies are re-pointed after the loop
                    missing.append(name)
                continue
            value, keys = got
            used.update(keys)
            if tuple(value.shape) != tuple(param.shape):
                raise DFlashError(f"{directory}: tensor {name} has shape {tuple(value.shape)} but config.json implies "
                                  f"{tuple(param.shape)}; the weights do not belong to this config.json")
            # contiguous: a transposed view would change the GEMM summation order (last-ulp drift)
            _set_parameter(model, name, value.contiguous())
        leftover = [k for k in ckpt.keys() if k not in used and not k.endswith(IGNORED_SUFFIXES)
                    and not (tied and k == "lm_head.weight")]
    if missing:
        raise DFlashError(f"{directory}: weights missing {missing[0]} ({len(missing)} in all); the checkpoint is "
                          "incomplete, re-export it or rebuild the engine")
    if leftover:
        raise DFlashError(f"{directory}: {len(leftover)} tensors the model does not use (first: {leftover[0]}); "
                          "config.json and the weights disagree, rebuild")
    if tied:
        model.tie_weights()
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:
            raise DFlashError(f"{directory}: {meta[0]} is tied but could not be tied to a loaded weight; re-export")
    devices = {str(d) for d in placement.values()}
    if len(devices) > 1:
        from accelerate import dispatch_model

        # outputs come back to the home device (the embedding's), where the loops' tensors live;
        # named as the map names it (accelerate compares it with the string "cpu"), it also keeps
        # accelerate from taking a "cpu" entry of the map for CPU offload
        embedding = model.get_input_embeddings().weight
        home = device_of(placement, next(n for n, p in model.named_parameters() if p is embedding))
        model = dispatch_model(model, device_map=placement, main_device=home)
    else:
        model = model.to(next(iter(placement.values())))  # buffers (rotary tables); parameters are there
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Writing: --quant none, shard by shard
# ---------------------------------------------------------------------------------------------


def copy_aux_files(src: Path, dst: Path, skip: tuple[str, ...] = WEIGHT_FILES) -> list[str]:
    """Copy tokenizer / template / generation-config files byte for byte (top level only, never
    over a file already in `dst`). Returns the names copied."""
    copied = []
    for f in sorted(src.iterdir()):
        real = f.resolve()  # hub snapshots link their files into a blob store
        if f.suffix in AUX_SUFFIXES and f.name not in skip and real.is_file() and not (dst / f.name).exists():
            shutil.copyfile(real, dst / f.name)
            copied.append(f.name)
    return copied


def convert_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype, progress: bool = False) -> dict[str, Any]:
    """`src` -> `dst` with every float tensor cast to `dtype` and every other tensor (MXFP4
    blocks and scales, integer buffers) kept byte for byte; same shard files, same index.

    Host memory: one shard at a time. Returns {"tensors", "kept", "cast", "bytes"}.
    """
    import sys

    from safetensors.torch import save_file
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    stats = {"tensors": 0, "kept": 0, "cast": 0, "bytes": 0}
    weight_map: dict[str, str] = {}
    with CheckpointReader(src) as ckpt:
        files = ckpt.files()
        for f in tqdm(files, desc="write target", unit="shard", disable=not progress or len(files) < 2, file=sys.stderr):
            shard: dict[str, torch.Tensor] = {}
            for key in ckpt.keys_of(f):
                t = ckpt.get(key)
                if t.dtype in FLOAT_DTYPES and t.dtype != dtype:
                    t = t.to(dtype)
                    stats["cast"] += 1
                else:
                    stats["kept"] += 1
                shard[key] = t.contiguous()
                weight_map[key] = f.name
                stats["bytes"] += t.numel() * t.element_size()
            stats["tensors"] += len(shard)
            save_file(shard, str(dst / f.name), metadata={"format": "pt"})
            del shard
    if (src / INDEX_NAME).is_file() or len(files) > 1:
        index = {"metadata": {"total_size": stats["bytes"]}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    cfg = read_json(src / "config.json", what="target config")
    name = dtype_name(dtype)
    cfg["dtype"] = name
    if "torch_dtype" in cfg:  # written by transformers < 5
        cfg["torch_dtype"] = name
    cfg = both_generations(cfg, where=str(src / "config.json"))  # TensorRT-LLM reads it with transformers 4.57
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    copy_aux_files(src, dst)
    return stats


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of a checkpoint's weights on disk (all *.safetensors files)."""
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))
