"""Write a Triton model repository for an engine directory from the `triton_repo/` template.

    REPO/
      dflash_trt_repo.json        the resolved settings (what was generated, from what)
      <model_name>/
        config.pbtxt              template filled from the engine manifest and flags
        1/model.py                the Python-backend model, copied unchanged

No value is templated by hand: each comes from the manifest (limits, engine name, mapping) or a
flag. The filled config is parsed strictly as `inference.ModelConfig` before anything is written,
and the repository appears atomically (a failed run leaves nothing behind).
"""

from __future__ import annotations

import shutil
import string
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.errors import DFlashError

TEMPLATE_MODEL = "dflash"  # folder name inside triton_repo/
REPO_RECORD = "dflash_trt_repo.json"


class TritonRepoSettings(BaseModel):
    """Everything `deploy triton` decides; printed and recorded in dflash_trt_repo.json."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("dflash", pattern=r"^[A-Za-z0-9_.-]+$")
    backend: Literal["auto", "tensorrt_llm", "reference"] = "auto"
    default_max_tokens: int | None = Field(None, ge=1)  # None: min(256, max_seq_len // 2)
    max_queue: int = Field(64, ge=1)
    # adaptive: the batched runtime picks the draft length per step from measured costs (down to
    # plain decoding), never slower than plain; full: always block_size - 1 drafts, as the reference
    # loop does (reproducible tau, e.g. for benchmarks comparing transports).
    speculation: Literal["adaptive", "full"] = "adaptive"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # reference runtime only
    device: str = "cpu"  # reference runtime only: cpu | cuda | cuda:N
    # reference runtime on a GPU: greedy draft/verify passes replayed as CUDA graphs
    # (runtime/cuda_graphs.py); no effect on a CPU
    cuda_graphs: bool = False
    engine_path: str | None = None  # the engine directory as the server sees it (containers)


def _pbtxt_string(value: str) -> str:
    """Escape a value for a double-quoted protobuf text-format string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render_config(engine_dir: Path, settings: TritonRepoSettings) -> str:
    """config.pbtxt text for `engine_dir`; raises DFlashError if it would not parse."""
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.resources import resource_dir

    manifest = load_manifest(engine_dir)
    limit = manifest.limits.max_seq_len
    default_max = settings.default_max_tokens or min(256, max(1, limit // 2))
    if default_max > limit:
        raise DFlashError(f"--default-max-tokens {default_max} is above the engine's max_seq_len {limit}; lower it")
    template = (resource_dir("triton_repo") / TEMPLATE_MODEL / "config.pbtxt.in").read_text(encoding="utf-8")
    values = {
        "model_name": settings.model_name,
        "engine_name": manifest.name,
        "gpu": manifest.gpu,
        "tp": manifest.mapping.tp,
        "pp": manifest.mapping.pp,
        "weights": manifest.quantization.weights,
        "engine_dir": settings.engine_path or str(engine_dir.resolve()),
        "llm_api_options": manifest.llm_api_options,
        "backend": settings.backend,
        "max_seq_len": limit,
        "default_max_tokens": default_max,
        "max_queue": settings.max_queue,
        "speculation": settings.speculation,
        "dtype": settings.dtype,
        "device": settings.device,
        "cuda_graphs": str(settings.cuda_graphs).lower(),
    }
    text = string.Template(template).substitute({k: _pbtxt_string(str(v)) for k, v in values.items()})
    parse_config(text, where="generated config.pbtxt")
    return text


def parse_config(text: str, where: str = "config.pbtxt"):
    """Strictly parse text-format `inference.ModelConfig` (unknown fields are errors)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise DFlashError(f"{where} is not a valid Triton ModelConfig: {e}")


def read_model_config(model_dir: Path):
    path = model_dir / "config.pbtxt"
    if not path.is_file():
        raise DFlashError(f"{model_dir}: no config.pbtxt; generate the repository with `dflash-trt deploy triton`")
    return parse_config(path.read_text(encoding="utf-8"), where=str(path))


def generate_repository(engine_dir: str | Path, out: str | Path, settings: TritonRepoSettings | None = None,
                        overwrite: bool = False) -> Path:
    """Write the repository for `engine_dir` at `out` (atomically) and return `out`."""
    from dflash_trt.fsutil import atomic_directory, write_json_atomic, write_text_atomic
    from dflash_trt.resources import resource_dir

    settings = settings or TritonRepoSettings()
    engine_dir, out = Path(engine_dir), Path(out)
    if not engine_dir.is_dir():
        raise DFlashError(f"engine directory {engine_dir} does not exist; build one with `dflash-trt build`")
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} already exists; pass --force to replace it or choose another --out")
    if out.resolve() == engine_dir.resolve() or engine_dir.resolve() in out.resolve().parents:
        raise DFlashError(f"--out {out} is inside the engine directory; write the repository elsewhere")
    config = render_config(engine_dir, settings)
    model_py = resource_dir("triton_repo") / TEMPLATE_MODEL / "1" / "model.py"
    try:
        with atomic_directory(out, overwrite=overwrite) as tmp:
            model_dir = tmp / settings.model_name
            write_text_atomic(model_dir / "config.pbtxt", config)
            (model_dir / "1").mkdir(parents=True)
            shutil.copyfile(model_py, model_dir / "1" / "model.py")
            write_json_atomic(tmp / REPO_RECORD, {
                "engine_dir": str(engine_dir.resolve()), "settings": settings.model_dump(),
            })
    except OSError as e:
        raise DFlashError(f"cannot write the repository at {out}: {e}")
    return out
