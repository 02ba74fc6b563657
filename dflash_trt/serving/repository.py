"""Write a Triton model repository for an engine directory from the `triton_repo/` template.

    REPO/
      dflash_trt_repo.json        the resolved settings (what was generated, from what)
      <model_name>/
        config.pbtxt              template filled from the engine manifest and flags: the I/O
                                  contract of tensorrtllm_backend's llmapi model, our settings
        1/model.py                the Python-backend model, copied unchanged
        1/model.yaml              as upstream's llmapi model.yaml: the engine's LLM() keyword
                                  arguments and triton_config (max_batch_size 0, decoupled)

No value is templated by hand: each comes from the manifest (limits, engine name, mapping) or a
flag. The filled config is parsed strictly as `inference.ModelConfig` before anything is written,
and the repository appears atomically (a failed run leaves nothing behind).

Defaults follow the engine, not the machine that runs ``deploy`` (often a login node without a
GPU): a GPU engine (manifest ``gpu`` != cpu) is served by TensorRT-LLM (``backend tensorrt_llm``;
the pytorch fallback runs on cuda in the engine's bfloat16/float16), and never falls back to the
CPU runtime unless ``--backend`` / ``--device`` say so; a CPU engine by the pytorch backend on the
CPU in float32, and never by TensorRT-LLM (engine/llm_api.tensorrt_llm_refusal). The draft method
follows the backend too: the pytorch backend's default is speculation.DEFAULT_DRAFT_METHOD,
TensorRT-LLM's exact match (another method asked of it is refused). ``decoupled`` defaults to
False, as upstream's model.yaml.
"""

from __future__ import annotations

import shutil
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import DtypeChoice, engine_runtime_defaults
from dflash_trt.serving.backends import BackendSettings, tensorrt_llm_draft_method
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD

TEMPLATE_MODEL = "dflash"  # folder name inside triton_repo/
REPO_RECORD = "dflash_trt_repo.json"
MODEL_YAML = "model.yaml"  # beside model.py, as in tensorrtllm_backend's llmapi model


class TritonRepoSettings(BackendSettings):
    """Everything `deploy triton` decides: the backend settings (serving/backends.py) the model
    loads its engine with, whether the model is decoupled, the model's name and the engine path the
    server sees; printed and recorded in dflash_trt_repo.json. backend, dtype and device left None
    follow the engine (see the module docstring): :meth:`for_engine` resolves them."""

    backend: Literal["auto", "tensorrt_llm", "pytorch"] | None = None  # type: ignore[assignment]
    dtype: DtypeChoice | None = None  # type: ignore[assignment]
    device: str | None = None  # type: ignore[assignment]
    decoupled: bool = False  # as upstream's model.yaml: streaming needs --decoupled
    model_name: str = Field("dflash", pattern=r"^[A-Za-z0-9_.-]+$")
    engine_path: str | None = None  # the engine directory as the server sees it (containers)

    def for_engine(self, manifest: Any) -> "TritonRepoSettings":
        """These settings with backend, dtype and device resolved for `manifest`'s engine."""
        from dflash_trt.engine.llm_api import tensorrt_llm_refusal

        gpu = manifest.gpu != "cpu"
        refusal = tensorrt_llm_refusal(manifest)
        if self.backend == "tensorrt_llm" and refusal:
            raise DFlashError(f"--backend tensorrt_llm: {refusal}")
        # The engine's GPU decides, never the machine that runs `deploy` (runtime_options)
        runs = engine_runtime_defaults(gpu, manifest.quantization.dtype)
        backend = self.backend or ("tensorrt_llm" if gpu else "pytorch")
        # the backend's own draft method when none is given (auto: decided when the model loads)
        method = (tensorrt_llm_draft_method(self.draft_method) if backend == "tensorrt_llm"
                  else self.draft_method or (DEFAULT_DRAFT_METHOD if backend == "pytorch" else None))
        return self.model_copy(update={
            "backend": backend,
            "dtype": self.dtype or runs["dtype"],
            "device": self.device or runs["device"],
            "draft_method": method,
        })


def resolve_repo_settings(flags: Mapping[str, Any]) -> TritonRepoSettings:
    """The settings of `deploy triton` / `serve` flags (None = not given), by the one config loader."""
    from dflash_trt.config import load_config

    return load_config(TritonRepoSettings, flags=flags, what="repository settings")


def _pbtxt_string(value: str) -> str:
    """Escape a value for a double-quoted protobuf text-format string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render_config(engine_dir: Path, settings: TritonRepoSettings) -> str:
    """config.pbtxt text for `engine_dir`; raises DFlashError if it would not parse."""
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.resources import resource_dir
    from dflash_trt.serving.backends import default_max_tokens_for
    from dflash_trt.speculation import SpeculationSettings

    manifest = load_manifest(engine_dir)
    settings = settings.for_engine(manifest)
    limit = manifest.limits.max_seq_len
    if settings.default_max_tokens is not None and settings.default_max_tokens > limit:
        raise DFlashError(f"--default-max-tokens {settings.default_max_tokens} is above the engine's max_seq_len "
                          f"{limit}; lower it")
    default_max = default_max_tokens_for(limit, settings.default_max_tokens)
    speculation = SpeculationSettings.from_manifest(manifest, settings.max_draft_len, settings.policy,
                                                    draft_len_schedule=settings.draft_len_schedule)
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
        "policy": speculation.policy,
        "max_draft_len": speculation.max_draft_len,
        "draft_method": settings.draft_method or "",  # "": the backend's own (--backend auto)
        # resolved here (given, or the engine's for policy schedule): the model loads exactly this one
        "draft_len_schedule": speculation.schedule.to_text() if speculation.schedule is not None else "off",
        "dtype": settings.dtype,
        "device": settings.device,
        "cuda_graphs": {None: "auto", True: "true", False: "false"}[settings.cuda_graphs],
        "torch_compile": "true" if settings.torch_compile else "false",
        "prefix_cache": "true" if settings.prefix_cache else "false",
        "prefix_cache_mib": f"{settings.prefix_cache_mib:g}",
    }
    text = string.Template(template).substitute({k: _pbtxt_string(str(v)) for k, v in values.items()})
    parse_config(text, where="generated config.pbtxt")
    return text


def render_model_yaml(engine_dir: Path, settings: TritonRepoSettings) -> str:
    """1/model.yaml for `engine_dir`: the LLM() kwargs (tensorrt_llm_backend.llm_kwargs, paths as
    the server sees them) and triton_config, the keys of upstream's llmapi model.yaml."""
    import yaml

    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.serving.tensorrt_llm_backend import llm_kwargs
    from dflash_trt.speculation import SpeculationSettings

    manifest = load_manifest(engine_dir)
    speculation = SpeculationSettings.from_manifest(manifest, settings.max_draft_len, settings.policy,
                                                    draft_len_schedule=settings.draft_len_schedule)
    kwargs = llm_kwargs(engine_dir, manifest, speculation, root=settings.engine_path)
    body = yaml.safe_dump({**kwargs, "triton_config": {"max_batch_size": 0, "decoupled": settings.decoupled}},
                          sort_keys=False)
    return (f"# Generated by `dflash-trt deploy triton` for engine {manifest.name}: the keyword arguments of\n"
            f"# tensorrt_llm.LLM() (every key but triton_config) and the Triton settings model.py applies in\n"
            f"# auto_complete_config, as in tensorrtllm_backend's llmapi model. Regenerate rather than edit.\n"
            + body)


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
    from dflash_trt.engine.manifest import load_manifest
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
    settings = settings.for_engine(load_manifest(engine_dir))
    config = render_config(engine_dir, settings)
    model_yaml = render_model_yaml(engine_dir, settings)
    model_py = resource_dir("triton_repo") / TEMPLATE_MODEL / "1" / "model.py"
    try:
        with atomic_directory(out, overwrite=overwrite) as tmp:
            model_dir = tmp / settings.model_name
            write_text_atomic(model_dir / "config.pbtxt", config)
            (model_dir / "1").mkdir(parents=True)
            shutil.copyfile(model_py, model_dir / "1" / "model.py")
            write_text_atomic(model_dir / "1" / MODEL_YAML, model_yaml)
            write_json_atomic(tmp / REPO_RECORD, {
                "engine_dir": str(engine_dir.resolve()), "settings": settings.model_dump(),
            })
    except OSError as e:
        raise DFlashError(f"cannot write the repository at {out}: {e}")
    return out
