"""`RuntimeOptions`: how a target/drafter pair is loaded and run, defined once.

Built at the edge (a command's flags, a config file, a repository's config.pbtxt) and passed
whole to the one pair loader (dflash_trt/pairs.py) and the one runtime opener
(runtime/opener.py), as :class:`~dflash_trt.speculation.SpeculationSettings` is. The line
between the two: these options say HOW the pair executes (device, dtypes, CUDA graphs,
torch.compile, chunked verification, CPU packing, the batch and sequence limits) and never change
a greedy answer's tokens; speculation says WHAT a step drafts and how it is verified.

- **device** (``--device``): cpu, cuda, cuda:N (meta in tests: shapes only). Checked where torch
  can see it, when the pair loads (checkpoints.placement.runtime_device).
- **dtype** (``--dtype``): the weights' dtype, one of :data:`DTYPE_NAMES`, or ``auto``: bfloat16
  on GPUs (float16 on those without it) and on CPUs that multiply bfloat16 natively, float32 on
  other CPUs (:func:`auto_dtype`). No aliases (``fp32``, ``bf16``): one spelling everywhere.
- **compute_dtype** (``--compute-dtype`` of `build`): what the models RUN in. None: the weights'
  dtype (every runtime command); ``auto``: the weights' dtype where the device multiplies it
  natively, else float32 (:func:`compute_dtype`: an exact upcast, 3-5x faster on such a CPU).
- **cuda_graphs** (``--cuda-graphs``): the batched runtime's static-shape passes, captured at
  start-up; None: on for a CUDA target, off elsewhere (True on a CPU runs them eagerly).
- **torch_compile** (``--torch-compile``): the decoder layers through torch.compile, compiled at
  start-up (runtime/gpu/compiled_layers.py).
- **pack** (``--pack``): oneDNN-packed linear layers for float32 on a CPU (runtime/cpu/packing.py).
- **verify_chunk**: greedy eager steps verify their drafts this many positions at a time, a row
  stopping at its first rejection (the acceptance gate's CPU case); None: one pass.
- **max_batch**, **max_seq_len**: rows decoded together and positions per row (prompt + output);
  an engine's ``limits`` set them when it is served.
- **prefix_cache** (``--prefix-cache/--no-prefix-cache``): the batched runtime reuses the target's
  K/V and the drafter's context K/V of a prompt prefix an earlier request of the same runtime
  computed (runtime/batched/prefix_cache.py); on by default. Outputs and acceptance are the same either way.
- **prefix_cache_mib** (``--prefix-cache-mib``): its memory budget; least recently used blocks are
  evicted beyond it. A budget below one block is refused at start-up.

`serve`/`deploy triton` (serving.backends.BackendSettings) and `bench` (bench.config.BenchConfig)
take the user's part of these as their own keys by inheriting :class:`RuntimeChoices`, so the
flags, config-file keys and config.pbtxt parameters keep their names.

Nothing here imports torch at module import: the CLI starts without it.
"""

from __future__ import annotations

import platform
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_trt.errors import DFlashError

if TYPE_CHECKING:
    import torch

DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(DtypeName)
DtypeChoice = Literal["auto", DtypeName]  # "auto": resolved for the device (auto_dtype)
DTYPE_CHOICES: tuple[str, ...] = typing.get_args(DtypeChoice)
# The prefix cache's default budget: ~21K positions of the embedded pair (48 KiB a position), ~7K
# of an 8B target's bf16 K/V
DEFAULT_PREFIX_CACHE_MIB = 1024.0


# ---------------------------------------------------------------------------------------------
# The dtype vocabulary and its defaults
# ---------------------------------------------------------------------------------------------


def torch_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of a name of :data:`DTYPE_CHOICES` ("auto" resolved for `device`)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPE_NAMES:
        raise DFlashError(f"--dtype {name!r} is not a dtype; use one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the vocabulary's spelling of a torch dtype."""
    return str(dtype).removeprefix("torch.")


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively AND PyTorch uses it: x86 with AVX512-BF16
    (or AMX-BF16) where torch dispatches to AVX-512 and oneDNN may use its bf16 instructions; Arm
    with the BF16 extension.

    Without it torch emulates bf16 matmuls, which run several times slower than float32 (an AVX2
    EPYC: a [4 x 576] x [576 x 1536] product 1.20 ms in bf16, 0.25 ms in float32, issue 35). It is
    what torch reports, not only the CPU's flags, so ``ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine resolves as an AVX2 machine would.
    """
    import torch

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
    import torch

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
    import torch

    if torch.device(device).type != "cpu" or weights not in (torch.bfloat16, torch.float16):
        return weights
    return weights if weights == torch.bfloat16 and cpu_has_native_bf16() else torch.float32


def resolve_compute_dtype(choice: str | None, weights: torch.dtype, device: str | torch.device) -> torch.dtype:
    """A compute_dtype choice resolved: None -> `weights`, "auto" -> :func:`compute_dtype`, a name -> it."""
    if choice is None:
        return weights
    return compute_dtype(weights, device) if choice == "auto" else torch_dtype(choice, device)


def engine_dtype_name(requested: str, checkpoint_dtype: str | None, emulated: bool) -> str:
    """The dtype an engine stores its unquantized tensors in (`build --dtype`): `requested`, else
    the checkpoint's 16-bit dtype (bfloat16 for a float32 checkpoint); an `emulated` target (the CPU
    recipe, the reference runtime) keeps a float32 checkpoint in float32."""
    if requested != "auto":
        return requested
    ckpt = str(checkpoint_dtype or "bfloat16").removeprefix("torch.")
    if ckpt in ("bfloat16", "float16"):
        return ckpt
    return "float32" if emulated and ckpt == "float32" else "bfloat16"


def engine_runtime_defaults(gpu_engine: bool, engine_dtype: str | None) -> dict[str, str]:
    """The device and dtype that run an engine when none are given. The ENGINE decides, never the
    machine that writes its repository (often a login node without a GPU): a GPU engine runs on
    cuda in its own 16-bit dtype (bfloat16 when it has none), a CPU engine on the CPU in float32."""
    if not gpu_engine:
        return {"device": "cpu", "dtype": "float32"}
    return {"device": "cuda", "dtype": engine_dtype if engine_dtype in ("bfloat16", "float16") else "bfloat16"}


# ---------------------------------------------------------------------------------------------
# The options
# ---------------------------------------------------------------------------------------------


class RuntimeChoices(BaseModel):
    """The options a user picks by flag or config key, declared once. `serve`'s and `bench`'s
    configs inherit them (their keys, flags and config.pbtxt parameters keep these names) and hand
    them on as :class:`RuntimeOptions` (:meth:`RuntimeOptions.of`)."""

    model_config = ConfigDict(extra="forbid")

    device: str = "cpu"
    dtype: DtypeChoice = "float32"
    # static-shape passes captured as CUDA graphs at start-up, then replayed (runtime/gpu/cuda_graphs.py).
    # None: on for a CUDA device, off on a CPU (True there runs the same static-shape passes eagerly)
    cuda_graphs: bool | None = None
    # both models' decoder layers through torch.compile, compiled at start-up (runtime/gpu/compiled_layers.py)
    torch_compile: bool = False
    pack: bool = True  # oneDNN-packed linear layers for float32 on a CPU (runtime/cpu/packing.py)
    # the batched runtime's prefix cache (runtime/batched/prefix_cache.py): a prompt's cached prefix, the
    # drafter's context included, is copied in instead of prefilled; its budget in MiB (LRU beyond it)
    prefix_cache: bool = True
    prefix_cache_mib: float = Field(DEFAULT_PREFIX_CACHE_MIB, gt=0)


# The flag that sets each option, for the one-line error of a bad value built in code.
FLAGS = {"device": "--device", "dtype": "--dtype", "compute_dtype": "--compute-dtype", "cuda_graphs": "--cuda-graphs",
         "torch_compile": "--torch-compile", "pack": "--pack", "verify_chunk": "verify_chunk (positions a chunk verifies)",
         "max_batch": "--max-batch-size", "max_seq_len": "--max-seq-len",
         "prefix_cache": "--prefix-cache", "prefix_cache_mib": "--prefix-cache-mib"}


class RuntimeOptions(RuntimeChoices):
    """How a pair is loaded and run (see the module docstring). Frozen; a bad value is a
    DFlashError naming the option's flag and what it accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute_dtype: DtypeChoice | None = None
    verify_chunk: int | None = Field(None, ge=1)
    max_batch: int = Field(8, ge=1)
    max_seq_len: int = Field(2048, ge=2)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            first = e.errors()[0]
            key = str(first["loc"][0]) if first["loc"] else "?"
            if first["type"] == "extra_forbidden":
                raise DFlashError(f"runtime options: unknown option {key!r}; use one of {', '.join(FLAGS)}") from None
            msg = str(first["msg"]).removeprefix("Value error, ")
            raise DFlashError(f"runtime options: {FLAGS.get(key, key)} {first.get('input')!r}: {msg}; change "
                              f"{FLAGS.get(key, key)}") from None

    @classmethod
    def of(cls, choices: RuntimeChoices, **more: Any) -> "RuntimeOptions":
        """The options of a config that inherits :class:`RuntimeChoices`, with `more` (limits, chunking)."""
        return cls(**{name: getattr(choices, name) for name in RuntimeChoices.model_fields}, **more)

    def replace(self, **changes: Any) -> "RuntimeOptions":
        """These options with `changes`, validated again."""
        return type(self)(**{**self.model_dump(), **changes})

    def weights_dtype(self) -> torch.dtype:
        """The dtype the weights load in (``auto`` resolved for the device)."""
        return torch_dtype(self.dtype, self.device)

    def run_dtype(self) -> torch.dtype:
        """The dtype the models run in (see compute_dtype in the module docstring)."""
        return resolve_compute_dtype(self.compute_dtype, self.weights_dtype(), self.device)
