"""Backend selection: which runtime serves an engine directory, with which settings.

    backend = load_backend(engine_dir, BackendSettings(backend="auto", policy="adaptive"))

- ``tensorrt_llm``: TensorRT-LLM's LLM API (serving/tensorrt_llm_backend.py), used when it is
  importable AND has DFlashDecodingConfig; asked for explicitly and missing, it is an error.
- ``pytorch``: dflash-trt's own runtime (serving/pytorch_backend.py: the batched runtime with
  the settings' policy, the reference loop for pairs the batched runtime cannot run). The old
  name ``reference`` is accepted and means the same.
- ``auto``: tensorrt_llm when usable, else pytorch.

The choice and its reason are logged: silently serving with the slow path is a failure mode.
K comes from the engine manifest (``limits.max_draft_len``), lowered by ``max_draft_len`` if set.
Sampled requests draft and verify by ``draft_method``: the pytorch backend runs any method
(speculation.DEFAULT_DRAFT_METHOD unless told otherwise); TensorRT-LLM's engine verifies by exact
match only, and another method asked of it is one line naming ``--backend pytorch``.
A device that is not there (``cuda`` without a GPU) is one line naming the flag that changes it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import RuntimeChoices
from dflash_trt.serving.protocol import Backend
from dflash_trt.speculation import MATCH, DraftMethod, Policy

log = logging.getLogger("dflash_trt.serving")

BACKENDS = ("auto", "tensorrt_llm", "pytorch")
BACKEND_ALIASES = {"reference": "pytorch"}  # old names still accepted


def normalize_backend(name: str) -> str:
    """The current name of a backend (old aliases mapped); DFlashError for an unknown one."""
    name = BACKEND_ALIASES.get(name, name)
    if name not in BACKENDS:
        raise DFlashError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    return name


def default_max_tokens_for(max_seq_len: int, requested: int | None = None) -> int:
    """max_tokens of a request that names none: `requested`, else min(256, max_seq_len / 2)."""
    return min(requested or min(256, max(1, max_seq_len // 2)), max_seq_len)


class BackendSettings(RuntimeChoices):
    """How a server runs an engine: recorded in the Triton repository (config.pbtxt parameters)
    and given by `serve` / `deploy triton` flags. The runtime choices it inherits (device, dtype,
    cuda_graphs, torch_compile, pack: dflash_trt/runtime_options.py) apply to the pytorch backend
    only; the engine's limits complete them into the RuntimeOptions it loads and runs with."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "tensorrt_llm", "pytorch"] = "auto"
    default_max_tokens: int | None = Field(None, ge=1)  # None: min(256, max_seq_len // 2)
    max_queue: int = Field(64, ge=1)
    # adaptive: the batched runtime picks k <= K per step from measured costs (down to plain
    # decoding), never slower than plain; fixed: K every step, as the reference loop does
    # (reproducible tau, e.g. for benchmarks comparing transports)
    policy: Policy = "adaptive"
    max_draft_len: int | None = Field(None, ge=1)  # K; None: the engine's limits.max_draft_len
    # how sampled steps draft and verify (speculation.py); None: the backend's own -- the pytorch
    # backend's is DEFAULT_DRAFT_METHOD, TensorRT-LLM's exact match (tensorrt_llm_draft_method)
    draft_method: DraftMethod | None = None
    # what policy schedule follows (--draft-len-schedule's text, "off": none); None: the engine's recorded one
    draft_len_schedule: str | None = None

    @field_validator("backend", mode="before")
    @classmethod
    def _alias(cls, v: object) -> object:
        return BACKEND_ALIASES.get(v, v) if isinstance(v, str) else v


def tensorrt_llm_draft_method(method: str | None) -> DraftMethod:
    """The draft method of the tensorrt_llm backend: exact match, the only rule TensorRT-LLM's
    engine verifies sampled steps by; another method asked of it is one line naming the way out."""
    if method not in (None, MATCH):
        raise DFlashError(f"--draft-method {method}: the tensorrt_llm backend verifies sampled steps as TensorRT-LLM's "
                          f"engine does (exact match); use --backend pytorch for {method}, or --draft-method match")
    return MATCH


def load_backend(engine_dir: str | Path, settings: BackendSettings | None = None,
                 llm_kwargs: dict | None = None) -> Backend:
    """Load `engine_dir` with the backend `settings` name (see the module docstring).
    `llm_kwargs`: TensorRT-LLM's LLM() arguments when a repository's model.yaml gives them."""
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.serving.tensorrt_llm_backend import tensorrt_llm_status
    from dflash_trt.speculation import SpeculationSettings

    settings = settings or BackendSettings()
    engine_dir = Path(engine_dir).resolve()
    manifest = load_manifest(engine_dir)
    speculation = SpeculationSettings.from_manifest(manifest, settings.max_draft_len, settings.policy,
                                                    settings.draft_method, settings.draft_len_schedule)
    limit = manifest.limits.max_seq_len
    default = default_max_tokens_for(limit, settings.default_max_tokens)
    from dflash_trt.engine.llm_api import tensorrt_llm_refusal

    usable, why = tensorrt_llm_status()
    refusal = tensorrt_llm_refusal(manifest)
    if settings.backend == "tensorrt_llm" and refusal:
        raise DFlashError(refusal)
    if refusal:  # auto: a CPU engine is never handed to TensorRT-LLM, installed or not
        usable, why = False, f"a {manifest.gpu} engine ({manifest.quantization.dtype or 'float32'}) runs on the pytorch backend"
    if settings.backend == "tensorrt_llm" and not usable:
        raise DFlashError(f"backend tensorrt_llm requested but {why}; use --backend pytorch or a TensorRT-LLM >= "
                          f"{manifest.min_tensorrt_llm_version} container")
    if usable and settings.backend != "pytorch":
        from dflash_trt.serving.tensorrt_llm_backend import TensorRTLLMBackend

        speculation = speculation.replace(draft_method=tensorrt_llm_draft_method(settings.draft_method))
        log.info("engine %s: TensorRT-LLM LLM API (%s)", engine_dir, why)
        return TensorRTLLMBackend(engine_dir, manifest, speculation, _codec(engine_dir, manifest), default,
                                  llm_kwargs)
    log.info("engine %s: dflash-trt pytorch backend (%s)", engine_dir,
             "requested" if settings.backend == "pytorch" else why)

    from dflash_trt.checkpoints.placement import runtime_device
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.opener import open_runtime
    from dflash_trt.runtime.targets.adapter import TargetAdapter
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.serving.pytorch_backend import PyTorchBackend

    runtime_device(settings.device)  # before the engine's hashes and weights: one line on a bad device
    # the engine's limits size the runtime: its memory plan holds max_batch_size rows of max_seq_len
    options = RuntimeOptions.of(settings, max_batch=manifest.limits.max_batch_size, max_seq_len=limit)
    # the loader re-checks every file's sha256 and dequantizes FP8/NVFP4 targets
    pair = load_pair(PairSource(engine=engine_dir), options, max_draft_len=settings.max_draft_len,
                     policy=settings.policy, draft_method=settings.draft_method,
                     draft_len_schedule=settings.draft_len_schedule)
    if pair.tokenizer is None:
        raise DFlashError(_no_tokenizer(engine_dir, manifest))
    runtime = open_runtime(TargetAdapter(pair.target), pair.draft, options, pair.speculation)
    return PyTorchBackend(engine_dir=engine_dir, runtime=runtime, codec=pair.codec, default_max_tokens=default,
                          max_queue=settings.max_queue)


def _no_tokenizer(engine_dir: Path, manifest: object) -> str:
    return (f"{engine_dir / manifest.target.path}: no tokenizer (tokenizer.json); the server needs one for text "  # type: ignore[attr-defined]
            f"in/out: rebuild the engine from a checkpoint that has a tokenizer")


def _codec(engine_dir: Path, manifest: object):
    """The tokenizer contract from the engine's target directory (without loading weights)."""
    from transformers import AutoConfig

    from dflash_trt.runtime.targets.loading import load_tokenizer
    from dflash_trt.runtime.decoding.tokens import TextCodec

    tdir = engine_dir / manifest.target.path  # type: ignore[attr-defined]
    tokenizer = load_tokenizer(tdir)
    if tokenizer is None:
        raise DFlashError(_no_tokenizer(engine_dir, manifest))
    return TextCodec.for_model(tokenizer, AutoConfig.from_pretrained(tdir, trust_remote_code=False,
                                                                     local_files_only=True),
                               manifest.limits.max_seq_len)  # type: ignore[attr-defined]
