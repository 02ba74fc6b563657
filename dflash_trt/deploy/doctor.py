"""`dflash-trt doctor [ENGINE]`: can this environment serve that engine? One line per finding.

Every Slurm job runs it first (inside the container, on every node), and it is meant for login
nodes too. It reports what is installed (Python, torch, tensorrt_llm and the fields of its
DFlashDecodingConfig, tritonserver, GPUs with memory and FP4/FP8 capability, the NVLink topology)
and, for an engine, every reason it cannot be served here, each with the fix:

- TensorRT-LLM backend (GPU engines): tensorrt_llm importable; the CAPABILITY, not a version
  number: every written key a field of the INSTALLED DFlashDecodingConfig / TorchLlmArgs
  (pydantic extra=forbid: one missing field and the file is refused) and the engine's
  attention_backend among the installed class's values; the manifest's min_tensorrt_llm_version
  is enforced only for what the capability cannot show (a value of another section, or no
  DFlashDecodingConfig at all: upstream's first DFlash tag could not be read, see
  tests/upstream/tensorrt_llm_node.json). Then what that attention backend loads: VANILLA imports
  flash_attn.flash_attn_with_kvcache (the flash-attn package), TRTLLM needs FlashInfer and
  SM100/SM103 GPUs, FA4 needs flash-attn's CuTe interface (flash_attn.cute), FlashInfer and SM90.
  A DFlash2 engine needs a TensorRT-LLM with DFlash2, which no config field shows (DFlash2 is read
  from the checkpoint under decoding_type: DFlash): the capability probe is
  hasattr(tensorrt_llm._torch.models.modeling_dflash, "DFlash2CandidateSelector"). An engine with
  a draft_len_schedule needs a DFlash that applies it: the field is DecodingBaseConfig's, older
  than DFlash, and DFlash's first releases skip it silently; the probe is
  SpeculativeDecodingMode.DFLASH.support_dynamic_draft_len(). An engine whose options draft 0 at a
  batch size it serves (a draft_len_schedule below max_batch_size or with a 0, or max_concurrency)
  needs a release that keeps DFlash's context buffers refreshed at 0 drafts (PR 16888, in no
  release yet): the probe is hasattr(DFlashDecodingConfig, "min_runtime_draft_len"); the build
  floors every draft length at 1 instead. The overlap scheduler, asked the same way
  (SpeculativeDecodingMode.DFLASH.support_overlap_scheduler()), is a warning where off: the engine
  serves, slower. As many GPUs on this node as the
  engine has ranks per node, FP4 tensor cores for an NVFP4 engine, FP8 for an FP8 one. A CPU engine (float32) is never TensorRT-LLM's.
- reference backend (the project's PyTorch runtime; CPU engines): torch importable.

Probing is read-only and bounded: nvidia-smi and the tensorrt_llm import run as child processes
with timeouts (a broken CUDA install must not hang a job's first step).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Backend = Literal["auto", "trtllm", "reference"]
PROBE_TIMEOUT_S = 300  # importing tensorrt_llm loads CUDA libraries and can take a minute
FP4_MIN_CC = (10, 0)  # Blackwell: native NVFP4 tensor cores (sm_100, sm_103, sm_120)
FP8_MIN_CC = (8, 9)  # Ada / Hopper and later
CONTAINER_HINT = "run inside the dflash-trt container (deploy/container/README.md)"
FLASH_ATTN_FIX = "pip install flash-attn --no-build-isolation (the dflash-trt container carries it)"
TRTLLM_ATTENTION_CC = ((10, 0), (10, 3))  # upstream's is_sm_100f: SM100 / SM103
FA4_ATTENTION_CC = ((9, 0),)  # dflash_attention.validate_dflash_fa4_runtime: SM90 only
FA4_FIX = "use the TensorRT-LLM image's flash-attn-4 (flash_attn.cute) and flashinfer, on H100/H200 nodes"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mib: int
    compute_capability: tuple[int, int] | None

    @property
    def fp4(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= FP4_MIN_CC

    @property
    def fp8(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= FP8_MIN_CC

    def describe(self) -> str:
        cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "?"
        caps = "FP4+FP8" if self.fp4 else "FP8" if self.fp8 else "no FP8/FP4"
        return f"GPU {self.index}: {self.name}, {self.memory_mib / 1024:.0f} GiB, sm_{cc.replace('.', '')} ({caps})"


@dataclass
class Environment:
    """What `probe_environment` found (tests build one by hand from recorded upstream data)."""

    python: str
    torch: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda
    tensorrt_llm: str | None = None  # installed version
    tensorrt_llm_error: str | None = None  # why it cannot be imported
    dflash_fields: list[str] | None = None  # DFlashDecodingConfig.model_fields; None: class absent
    dflash_attention_backends: list[str] | None = None  # its attention_backend Literal; None: no such field
    flash_attn: str | None = None  # flash-attn version, when `from flash_attn import flash_attn_with_kvcache` works
    flash_attn_error: str | None = None  # why it does not
    flashinfer: str | None = None  # flashinfer version, when importable
    flash_attn_cute: bool | None = None  # `from flash_attn.cute.interface import _flash_attn_fwd` works (FA4)
    dflash2: bool | None = None  # modeling_dflash has DFlash2CandidateSelector; None: not probed / import failed
    dflash2_error: str | None = None
    # SpeculativeDecodingMode.DFLASH.support_dynamic_draft_len(): DFlash applies draft_len_schedule
    dflash_dynamic_draft_len: bool | None = None
    # SpeculativeDecodingMode.DFLASH.support_overlap_scheduler(): the overlap scheduler stays on for DFlash
    dflash_overlap_scheduler: bool | None = None
    # DFlashDecodingConfig has min_runtime_draft_len (PR 16888): a 0-drafting schedule keeps DFlash's context fresh
    dflash_zero_draft_safe: bool | None = None
    llm_args_fields: list[str] | None = None  # TorchLlmArgs.model_fields
    tritonserver: str | None = None  # path of the binary `serve` would run
    tritonserver_origin: str = ""  # where it was found (PATH, /opt/tritonserver, dflash-trt's install)
    # what keeps its Python backend from running model.py here (serving/tritonserver.stub_problems)
    tritonserver_problems: list[str] = field(default_factory=list)
    gpus: list[GpuInfo] = field(default_factory=list)
    gpu_source: str = "none"  # nvidia-smi | torch | none
    topology: str | None = None  # `nvidia-smi topo -m`


@dataclass(frozen=True)
class Finding:
    ok: bool  # False: this blocks serving the engine (or is missing for any GPU engine)
    what: str
    fix: str = ""
    warn: bool = False  # ok (does not block) but slower or worse than it should be; printed with its fix

    def line(self) -> str:
        if self.ok and self.warn:
            return f"WARN     {self.what}" + (f"; fix: {self.fix}" if self.fix else "")
        if self.ok:
            return f"ok       {self.what}"
        return f"MISSING  {self.what}" + (f"; fix: {self.fix}" if self.fix else "")


# --------------------------------------------------------------------------------------------
# Probing (real commands; nothing here is mocked in the tests, which run it on this machine)
# --------------------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_nvidia_smi(csv_text: str) -> list[GpuInfo]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits`."""
    gpus = []
    for row in csv_text.strip().splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) < 4:
            continue
        try:
            cc = tuple(int(x) for x in parts[3].split(".")[:2])
            capability = (cc[0], cc[1]) if len(cc) == 2 else None
        except ValueError:
            capability = None
        gpus.append(GpuInfo(int(parts[0]), parts[1], int(float(parts[2])), capability))
    return gpus


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _probe_gpus(env: Environment) -> None:
    smi = shutil.which("nvidia-smi")
    if smi:
        out = _run([smi, "--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"])
        if out is not None:
            env.gpus, env.gpu_source = parse_nvidia_smi(out), "nvidia-smi"
            env.topology = _run([smi, "topo", "-m"])
            return
    if env.torch is None:
        return
    code = ("import json, torch\n"
            "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
            "print(json.dumps([[i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory // 2**20,"
            " list(torch.cuda.get_device_capability(i))] for i in range(n)]))")
    out = _run([sys.executable, "-c", code], timeout=PROBE_TIMEOUT_S)
    if out:
        rows = json.loads(out.strip().splitlines()[-1])
        env.gpus = [GpuInfo(i, name, mem, (cc[0], cc[1])) for i, name, mem, cc in rows]
        env.gpu_source = "torch" if env.gpus else "none"


_TRTLLM_PROBE = """
import json
out = {}
try:
    from tensorrt_llm.llmapi import llm_args
    out["version"] = __import__("tensorrt_llm").__version__
    cls = getattr(llm_args, "DFlashDecodingConfig", None)
    out["dflash_fields"] = sorted(cls.model_fields) if cls is not None else None
    field = cls.model_fields.get("attention_backend") if cls is not None else None
    if field is not None:
        import typing
        out["dflash_attention_backends"] = sorted(str(a) for a in typing.get_args(field.annotation))
    out["llm_args_fields"] = sorted(llm_args.TorchLlmArgs.model_fields)
except Exception as e:
    out["error"] = type(e).__name__ + ": " + (str(e).splitlines() or [""])[0]
if "error" not in out:
    # DFlash2 adds no config field: the class that runs its selector is the capability
    try:
        import importlib
        modeling = importlib.import_module("tensorrt_llm._torch.models.modeling_dflash")
        out["dflash2"] = hasattr(modeling, "DFlash2CandidateSelector")
    except Exception as e:
        out["dflash2_error"] = type(e).__name__ + ": " + (str(e).splitlines() or [""])[0]
    # draft_len_schedule is a DecodingBaseConfig field older than DFlash: whether DFlash applies it
    # is the mode's support_dynamic_draft_len() (Eagle3 only in DFlash's first releases)
    try:
        import importlib
        mode = getattr(importlib.import_module("tensorrt_llm._torch.speculative.interface").SpeculativeDecodingMode,
                       "DFLASH", None)
        out["dflash_dynamic_draft_len"] = bool(mode is not None and mode.support_dynamic_draft_len())
        # the overlap scheduler: py_executor_creator turns it off for modes that do not support it
        out["dflash_overlap_scheduler"] = bool(mode is not None and mode.support_overlap_scheduler())
    except Exception:
        pass  # unknown: the recorded first version decides
    # PR 16888: schedule-resolved draft lengths floored at the config's min_runtime_draft_len, so a
    # 0-drafting schedule no longer starves DFlash's context buffers
    out["dflash_zero_draft_safe"] = cls is not None and hasattr(cls, "min_runtime_draft_len")
print("DFLASH_TRT_PROBE " + json.dumps(out))
"""


def _probe_trtllm(env: Environment) -> None:
    env.tensorrt_llm = _version("tensorrt_llm") or _version("tensorrt-llm")
    if env.tensorrt_llm is None:
        env.tensorrt_llm_error = "not installed"
        return
    found, error = _probe_child(_TRTLLM_PROBE)
    if error is not None:
        env.tensorrt_llm_error = error
        return
    env.tensorrt_llm_error = found.get("error")
    env.tensorrt_llm = found.get("version", env.tensorrt_llm)
    env.dflash_fields = found.get("dflash_fields")
    env.dflash_attention_backends = found.get("dflash_attention_backends")
    env.llm_args_fields = found.get("llm_args_fields")
    env.dflash2 = found.get("dflash2")
    env.dflash2_error = found.get("dflash2_error")
    env.dflash_dynamic_draft_len = found.get("dflash_dynamic_draft_len")
    env.dflash_overlap_scheduler = found.get("dflash_overlap_scheduler")
    env.dflash_zero_draft_safe = found.get("dflash_zero_draft_safe")


# DFlash's VANILLA attention imports exactly this (tensorrt_llm/_torch/speculative/dflash_attention.py).
_FLASH_ATTN_PROBE = """
import json
from flash_attn import flash_attn_with_kvcache
import flash_attn
print("DFLASH_TRT_PROBE " + json.dumps(getattr(flash_attn, "__version__", "?")))
"""


def _probe_attention_packages(env: Environment) -> None:
    import importlib.util

    env.flashinfer = _version("flashinfer-python") or _version("flashinfer")
    if importlib.util.find_spec("flash_attn") is None:
        env.flash_attn_error = "not installed"
        return
    found, env.flash_attn_error = _probe_child(_FLASH_ATTN_PROBE)  # a child: flash_attn loads its CUDA extension
    if env.flash_attn_error is None:
        env.flash_attn = found
    cute, _ = _probe_child(_FA4_PROBE)
    env.flash_attn_cute = bool(cute)


# DFlash's FA4 attention imports exactly this (dflash_attention.get_dflash_fa4_fwd).
_FA4_PROBE = """
import json
try:
    from flash_attn.cute.interface import _flash_attn_fwd
    ok = True
except (ImportError, OSError):
    ok = False
print("DFLASH_TRT_PROBE " + json.dumps(ok))
"""


def _probe_child(code: str) -> tuple[Any, str | None]:
    """(the JSON a probe script printed after "DFLASH_TRT_PROBE ", None), or (None, why it printed none)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"import did not finish within {PROBE_TIMEOUT_S}s"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DFLASH_TRT_PROBE ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"import crashed (exit {proc.returncode}): {tail}"
    return json.loads(line.split(" ", 1)[1]), None


def probe_environment() -> Environment:
    env = Environment(python=platform.python_version())
    env.torch = _version("torch")
    if env.torch is not None:
        out = _run([sys.executable, "-c", "import torch; print(torch.version.cuda)"], timeout=PROBE_TIMEOUT_S)
        env.torch_cuda = (out or "").strip() or None
        if env.torch_cuda == "None":
            env.torch_cuda = None
    _probe_trtllm(env)
    _probe_attention_packages(env)
    from dflash_trt.serving.tritonserver import find_tritonserver, stub_problems

    install = find_tritonserver()
    if install is not None:
        env.tritonserver, env.tritonserver_origin = str(install.binary), install.origin
        env.tritonserver_problems = stub_problems(install)
    _probe_gpus(env)
    return env


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------

def environment_findings(env: Environment) -> list[Finding]:
    """What is installed; a missing piece is reported with its fix but only blocks an engine that needs it."""
    found = [Finding(True, f"python {env.python}")]
    found.append(Finding(env.torch is not None, f"torch {env.torch} (CUDA {env.torch_cuda or 'none'})"
                         if env.torch else "torch: not installed", "pip install 'dflash-trt[all]' (torch first)"))
    if env.tensorrt_llm and not env.tensorrt_llm_error:
        found.append(Finding(True, f"tensorrt_llm {env.tensorrt_llm}"))
        if env.dflash_fields is None:
            found.append(Finding(False, f"tensorrt_llm {env.tensorrt_llm} has no DFlashDecodingConfig (no DFlash)",
                                 f"{CONTAINER_HINT}, or upgrade TensorRT-LLM"))
        else:
            found.append(Finding(True, "DFlashDecodingConfig fields: " + ", ".join(env.dflash_fields)
                                 + (f"; attention_backend {' | '.join(env.dflash_attention_backends)}"
                                    if env.dflash_attention_backends else "")))
            found.append(_dflash2_finding(env, "DFlash2 drafters"))
            if env.dflash_overlap_scheduler is not None:
                found.append(_overlap_finding(env, "DFlash"))
            if env.dflash_zero_draft_safe is not None:
                found.append(Finding(True, f"tensorrt_llm {env.tensorrt_llm} "
                                     + ("floors a schedule's 0 draft length for DFlash (min_runtime_draft_len)"
                                        if env.dflash_zero_draft_safe else
                                        "does not floor a schedule's 0 draft length for DFlash (no min_runtime_draft_"
                                        "len, PR 16888): engines drafting 0 at a served batch size are refused")))
    else:
        found.append(Finding(False, f"tensorrt_llm: {env.tensorrt_llm_error or 'not installed'}"
                             + (f" (version {env.tensorrt_llm} installed)" if env.tensorrt_llm else ""),
                             CONTAINER_HINT + "; the reference backend needs none"))
    found.append(Finding(env.flash_attn is not None,
                         f"flash-attn {env.flash_attn} (flash_attn_with_kvcache: DFlash VANILLA attention)"
                         if env.flash_attn else f"flash-attn: {env.flash_attn_error or 'not installed'} (DFlash VANILLA "
                         "attention, the Hopper engines' backend, imports flash_attn.flash_attn_with_kvcache)",
                         FLASH_ATTN_FIX))
    found.append(Finding(env.tritonserver is not None,
                         f"tritonserver {env.tritonserver} ({env.tritonserver_origin})" if env.tritonserver
                         else "tritonserver: not found on PATH, in /opt/tritonserver/bin or in dflash-trt's install",
                         CONTAINER_HINT + " (it copies /opt/tritonserver in); elsewhere `make setup` or "
                         "`dflash-trt setup-tritonserver`"))
    # each piece its Python backend lacks to run model.py here, one line each (the fix is in the line)
    found += [Finding(False, f"tritonserver's Python backend: {problem}") for problem in env.tritonserver_problems]
    if env.gpus:
        found += [Finding(True, g.describe() + f" [{env.gpu_source}]") for g in env.gpus]
    else:
        found.append(Finding(False, "GPUs: none visible (no nvidia-smi, and torch sees no CUDA device)",
                             "run on a GPU node (srun/sbatch --gpus-per-node=N); CPU engines need none"))
    if env.topology:
        found.append(Finding(True, "topology (nvidia-smi topo -m):\n" + env.topology.rstrip()))
    elif env.gpus:
        found.append(Finding(True, "topology: `nvidia-smi topo -m` unavailable"))
    return found


def _dflash2_finding(env: Environment, what: str) -> Finding:
    """Whether the installed TensorRT-LLM runs DFlash2 (the capability probe; no field shows it)."""
    if env.dflash2:
        return Finding(True, f"{what}: tensorrt_llm {env.tensorrt_llm} has DFlash2 (modeling_dflash."
                             "DFlash2CandidateSelector)")
    why = (f"importing tensorrt_llm._torch.models.modeling_dflash failed ({env.dflash2_error})" if env.dflash2_error
           else "tensorrt_llm._torch.models.modeling_dflash has no DFlash2CandidateSelector")
    return Finding(False, f"{what}: tensorrt_llm {env.tensorrt_llm} cannot run them: {why}",
                   f"use a TensorRT-LLM build with DFlash2 ({CONTAINER_HINT}); DFlash v1 engines are unaffected")


def _schedule_finding(env: Environment, name: str, schedule: Any) -> Finding:
    """Whether the installed TensorRT-LLM's DFlash applies the engine's draft_len_schedule: where
    SpeculativeDecodingMode.DFLASH.support_dynamic_draft_len() is False the schedule is skipped
    without a word and every batch drafts max_draft_len."""
    what = f"{name}: its draft_len_schedule {schedule}"
    if env.dflash_dynamic_draft_len:
        return Finding(True, f"{what} is applied by tensorrt_llm {env.tensorrt_llm} (SpeculativeDecodingMode.DFLASH."
                             "support_dynamic_draft_len())")
    return Finding(False, f"{what} would be ignored by tensorrt_llm {env.tensorrt_llm}: its SpeculativeDecodingMode."
                          "DFLASH.support_dynamic_draft_len() is False, so every batch would draft max_draft_len",
                   f"use a TensorRT-LLM whose DFlash applies it ({CONTAINER_HINT}), or rebuild with "
                   "--draft-len-schedule off to draft max_draft_len at every batch size knowingly")


def _overlap_finding(env: Environment, name: str) -> Finding:
    """Whether the installed release keeps the overlap scheduler on for DFlash: a warning where not
    (the engine serves, with the host's scheduling no longer hidden behind the GPU's step)."""
    if env.dflash_overlap_scheduler:
        return Finding(True, f"{name}: tensorrt_llm {env.tensorrt_llm} overlaps scheduling with the GPU step "
                             "(SpeculativeDecodingMode.DFLASH.support_overlap_scheduler())")
    return Finding(True, f"{name}: tensorrt_llm {env.tensorrt_llm} turns the overlap scheduler off for DFlash "
                         "(SpeculativeDecodingMode.DFLASH.support_overlap_scheduler() is False): the host schedules "
                         "each step after the GPU's", f"use a TensorRT-LLM whose DFlash supports it ({CONTAINER_HINT})",
                   warn=True)


def _zero_draft_finding(env: Environment, name: str, opts: dict[str, Any]) -> Finding | None:
    """An engine whose options draft 0 at a batch size it serves: refused unless the installed
    release keeps DFlash's context buffers refreshed at 0 drafts (PR 16888's min_runtime_draft_len)."""
    from dflash_trt.engine.llm_api import zero_draft_refusal
    from dflash_trt.engine.trtllm_versions import zero_draft_batches

    if not zero_draft_batches(opts):
        return None
    spec = opts.get("speculative_config") or {}
    what = (f"draft_len_schedule {spec['draft_len_schedule']}" if spec.get("draft_len_schedule") is not None
            else f"max_concurrency {spec.get('max_concurrency')}")
    if env.dflash_zero_draft_safe:
        return Finding(True, f"{name}: its {what} drafts 0 at some served batch sizes, and tensorrt_llm "
                             f"{env.tensorrt_llm} floors that for DFlash (min_runtime_draft_len)")
    line = zero_draft_refusal(opts) or f"speculative_config.{what} drafts 0 at a served batch size"
    why, _, fix = line.partition("; rebuild")
    return Finding(False, f"{name}: {why}", "rebuild" + fix if fix else
                   "rebuild the engine with this dflash-trt (it floors the schedule at 1 up to max_batch_size)")


def _written_keys(opts: dict[str, Any]) -> tuple[list[str], list[str]]:
    spec = opts.get("speculative_config") or {}
    return [k for k in opts if k != "speculative_config"], list(spec)


def _confirmed_by_capability(env: Environment, key: str, attention_backend: str) -> bool:
    """Whether the installed classes themselves show that `key` (a requirements() key) is accepted."""
    if key.startswith("speculative_config drafts 0"):  # trtllm_versions.requirements: PR 16888's floor
        return env.dflash_zero_draft_safe is True
    name, _, value = key.partition("=")
    section, _, sub = name.partition(".")
    if section == "speculative_config" and env.dflash_fields is not None:
        if not sub:
            return env.llm_args_fields is not None and section in env.llm_args_fields
        if sub == "decoding_type":
            return True  # the class exists
        if sub == "attention_backend" and value:
            return env.dflash_attention_backends is not None and attention_backend in env.dflash_attention_backends
        if sub == "draft_len_schedule":  # every DFlash release has the field; only the mode shows it applies
            return env.dflash_dynamic_draft_len is True
        return not value and sub in env.dflash_fields
    if not sub and not value and env.llm_args_fields is not None:
        return name in env.llm_args_fields
    return False  # another section's key or value: only the recorded first version tells


def engine_findings(env: Environment, manifest: Any, opts: dict[str, Any], backend: Backend,
                    family: str | None = None) -> list[Finding]:
    """Why this engine cannot be served here (empty: it can), plus what was checked. `family`: the
    drafter's (dflash | dflash2), when the manifest does not record it."""
    from dflash_trt.engine.llm_api import tensorrt_llm_refusal
    from dflash_trt.engine.trtllm_versions import requirements, unmet, upstream_default

    if backend == "auto":
        backend = "reference" if manifest.gpu == "cpu" else "trtllm"
    name = f"engine {manifest.name!r}"
    if backend == "reference":
        # `serve` runs it on tritonserver's Python backend: the server, and what its stub needs here
        serve = [Finding(env.tritonserver is not None and not env.tritonserver_problems,
                         f"{name}: `dflash-trt serve` runs it on tritonserver "
                         + (f"({env.tritonserver})" if env.tritonserver else "(none found)"),
                         "; ".join(env.tritonserver_problems) if env.tritonserver_problems
                         else "`make setup` or `dflash-trt setup-tritonserver`")]
        return [Finding(env.torch is not None, f"{name}: reference backend (PyTorch) needs torch",
                        "pip install 'dflash-trt[all]'"), *serve]
    refusal = tensorrt_llm_refusal(manifest)
    if refusal:
        return [Finding(False, refusal, f"dflash-trt doctor {manifest.name} --backend reference")]
    found: list[Finding] = []
    need = manifest.min_tensorrt_llm_version
    spec_opts = opts.get("speculative_config") or {}
    attention = spec_opts.get("attention_backend") or upstream_default("speculative_config.attention_backend") or "VANILLA"
    if not env.tensorrt_llm or env.tensorrt_llm_error:
        found.append(Finding(False, f"{name} needs TensorRT-LLM >= {need}; tensorrt_llm "
                             f"{env.tensorrt_llm_error or 'not installed'}",
                             f"{CONTAINER_HINT}, or pip install 'tensorrt-llm>={need}' from NVIDIA's index; "
                             "or serve it with --backend reference"))
    else:
        top, spec_keys = _written_keys(opts)
        if env.dflash_fields is not None:
            missing = [k for k in spec_keys if k not in env.dflash_fields]
            found.append(Finding(not missing, f"{name}: speculative_config keys in the installed DFlashDecodingConfig"
                                 + (f"; missing {', '.join(missing)}" if missing else ""),
                                 f"TensorRT-LLM >= {need} has them; or rebuild without those settings"))
            if env.dflash_attention_backends is not None:
                ok = attention in env.dflash_attention_backends
                found.append(Finding(ok, f"{name}: attention_backend {attention} in the installed DFlashDecodingConfig "
                                     f"({' | '.join(env.dflash_attention_backends)})",
                                     "rebuild with dflash_attention_backend: auto in the build spec"))
        if env.llm_args_fields is not None:
            missing = [k for k in top if k not in env.llm_args_fields]
            found.append(Finding(not missing, f"{name}: top-level keys in the installed TorchLlmArgs"
                                 + (f"; missing {', '.join(missing)}" if missing else ""),
                                 f"TensorRT-LLM >= {need} has them"))
        # The capability decides; the recorded first version only for what it cannot show.
        required = manifest.tensorrt_llm_requirements or requirements(opts)
        too_old = {k: v for k, v in unmet(required, env.tensorrt_llm).items()
                   if not _confirmed_by_capability(env, k, attention)}
        if env.dflash_fields is None:
            too_old["min_tensorrt_llm_version"] = need
        found.append(Finding(not too_old, f"{name} needs TensorRT-LLM >= {need}, installed {env.tensorrt_llm}"
                             + (f" lacks {', '.join(k for k in too_old if k != 'min_tensorrt_llm_version')}"
                                if any(k != "min_tensorrt_llm_version" for k in too_old) else "")
                             + ("" if too_old or env.dflash_fields is None else
                                " (capability checked: the installed classes accept every key written)"),
                             f"use an image with TensorRT-LLM >= {need} ({CONTAINER_HINT})"))
        if (manifest.draft.family or family) == "dflash2":
            found.append(_dflash2_finding(env, f"{name} has a DFlash2 drafter"))
        if "draft_len_schedule" in spec_opts and env.dflash_dynamic_draft_len is not None:
            found.append(_schedule_finding(env, name, spec_opts["draft_len_schedule"]))
        zero = _zero_draft_finding(env, name, opts)
        if zero is not None:
            found.append(zero)
        if opts.get("disable_overlap_scheduler") is True:
            from dflash_trt.engine.llm_api import OVERLAP_WHY

            found.append(Finding(False, f"{name}: disable_overlap_scheduler: true turns off what {OVERLAP_WHY}",
                                 "rebuild the engine (the build never writes it)"))
        elif env.dflash_overlap_scheduler is False:
            found.append(_overlap_finding(env, name))
    gpu_note = f"the {manifest.gpu} engine's DFlash attention"
    if attention == "VANILLA":
        found.append(Finding(env.flash_attn is not None,
                             f"{name}: {gpu_note} is VANILLA, which imports flash_attn.flash_attn_with_kvcache"
                             + (f" (flash-attn {env.flash_attn})" if env.flash_attn else
                                f"; flash-attn {env.flash_attn_error or 'not installed'} (TensorRT-LLM raises 'DFlash "
                                "VANILLA attention requires the flash-attn package.')"),
                             FLASH_ATTN_FIX))
    elif attention == "TRTLLM":
        off = [g for g in env.gpus if g.compute_capability not in TRTLLM_ATTENTION_CC]
        found.append(Finding(env.flashinfer is not None and not off,
                             f"{name}: {gpu_note} is TRTLLM, which needs FlashInfer and SM100/SM103 GPUs"
                             + ("" if env.flashinfer else "; flashinfer not installed")
                             + (f"; {off[0].name} is sm_{''.join(map(str, off[0].compute_capability or ()))}"
                                if off else ""),
                             "run on B200/B300 nodes in the dflash-trt container, or rebuild with "
                             "dflash_attention_backend: VANILLA in the build spec"))
    elif attention == "FA4":
        off = [g for g in env.gpus if g.compute_capability not in FA4_ATTENTION_CC]
        found.append(Finding(bool(env.flash_attn_cute) and env.flashinfer is not None and not off,
                             f"{name}: {gpu_note} is FA4, which needs flash-attn's CuTe interface (flash_attn.cute), "
                             "FlashInfer and SM90 GPUs"
                             + ("" if env.flash_attn_cute else "; flash_attn.cute not importable")
                             + ("" if env.flashinfer else "; flashinfer not installed")
                             + (f"; {off[0].name} is sm_{''.join(map(str, off[0].compute_capability or ()))}"
                                if off else ""),
                             FA4_FIX + ", or rebuild with dflash_attention_backend: VANILLA in the build spec"))
    per_node = manifest.mapping.tasks_per_node
    found.append(Finding(len(env.gpus) >= per_node,
                         f"{name} runs {manifest.mapping.world_size} rank(s), {per_node} per node: "
                         f"{len(env.gpus)} GPU(s) visible here",
                         f"run on nodes with >= {per_node} GPUs (sbatch --gpus-per-node={per_node}), "
                         "or rebuild for fewer ranks (--tp/--pp)"))
    weights = manifest.quantization.weights
    if weights == "nvfp4":
        slow = [g for g in env.gpus if not g.fp4]
        found.append(Finding(bool(env.gpus) and not slow, f"{name} is NVFP4: needs FP4 tensor cores (Blackwell, sm_100+)"
                             + (f"; {slow[0].name} is sm_{''.join(map(str, slow[0].compute_capability or ()))}"
                                if slow else ""),
                             "run on B200/B300 nodes, or rebuild with --quant fp8 for Hopper"))
    elif weights == "fp8" or manifest.quantization.kv_cache == "fp8":
        slow = [g for g in env.gpus if not g.fp8]
        found.append(Finding(bool(env.gpus) and not slow, f"{name} uses FP8: needs sm_89+ (Ada, Hopper, Blackwell)",
                             "run on H100/H200/B200/B300 nodes, or rebuild with --quant none"))
    return found


def load_engine(engine_dir: str | Path) -> tuple[Any, dict[str, Any]]:
    """(the manifest, its llm_api_options mapping); DFlashError naming the file and the rebuild."""
    from dflash_trt.config import read_config_file
    from dflash_trt.engine.manifest import load_manifest

    manifest = load_manifest(engine_dir)
    opts = read_config_file(Path(engine_dir) / manifest.llm_api_options, "llm_api_options", fix="rebuild the engine")
    return manifest, opts


def engine_family(engine_dir: str | Path, manifest: Any) -> str | None:
    """The drafter family of an engine: the manifest's record, else read from its draft/config.json
    (manifests before issue 43 do not record it); None without that file (`verify` names it)."""
    if manifest.draft.family:
        return manifest.draft.family
    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.runtime.drafters.families import detect_family

    path = Path(engine_dir) / manifest.draft.path / "config.json"
    if not path.is_file():
        return None
    return detect_family(read_json(path, what="drafter config"), path).name


def run_doctor(engine_dir: str | Path | None, backend: Backend = "auto", as_json: bool = False,
               echo: Any = print) -> int:
    """Print the findings; 1 when ENGINE cannot be served here, else 0 (no engine: always 0)."""
    loaded = load_engine(engine_dir) if engine_dir is not None else None  # bad input fails before probing
    family = engine_family(engine_dir, loaded[0]) if loaded else None
    env = probe_environment()
    general = environment_findings(env)
    specific = engine_findings(env, *loaded, backend, family=family) if loaded else []
    servable = all(f.ok for f in specific)
    if as_json:
        echo(json.dumps({"environment": asdict(env), "findings": [asdict(f) for f in general + specific],
                         "engine": str(engine_dir) if engine_dir else None,
                         "servable": servable if loaded else None}, default=list))
    else:
        for f in general + specific:
            echo(f.line())
        if loaded:
            echo(f"verdict: {engine_dir} can be served here" if servable
                 else f"verdict: {engine_dir} CANNOT be served here ({sum(not f.ok for f in specific)} problem(s) above)")
    return 0 if servable else 1
