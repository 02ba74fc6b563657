"""One bench run: resolve the sides and prompts, sweep concurrency, summarise.

The sweep runs level by level: at each C every side runs DFlash and plain decoding back to back
(with --repeats, that whole round again, and the fastest run of each (side, mode, C) counts), so
load from other processes on a shared machine hits every side alike. Every other round, counted
across levels, runs in reverse order (:func:`round_order`), so no mode always goes first.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from dflash_trt.bench.config import BenchConfig, parse_policies
from dflash_trt.bench.prompts import BenchPrompt, from_categories, from_jsonl
from dflash_trt.bench.runners import BenchRequest, RequestRecord, RunResult
from dflash_trt.errors import DFlashError

SCHEMA_VERSION = 2


def load_bench_prompts(cfg: BenchConfig) -> list[BenchPrompt]:
    prompts = from_jsonl(cfg.prompts) if cfg.prompts else from_categories(cfg.category, cfg.split)
    if not prompts:
        raise DFlashError(f"no {cfg.split} prompts in categories {','.join(cfg.category)}; choose other --category")
    return prompts[: cfg.num_prompts] if cfg.num_prompts else prompts


def bench_requests(cfg: BenchConfig, prompts: list[BenchPrompt], concurrency: int) -> list[BenchRequest]:
    """--num-requests cycling over the prompts, by default one per prompt and at least one per user
    (C users and fewer prompts would leave users idle and measure a lower level); request i uses seed + i."""
    n = cfg.num_requests or max(len(prompts), concurrency)
    return [BenchRequest(prompts[i % len(prompts)], cfg.max_new_tokens, cfg.temperature, cfg.seed + i) for i in range(n)]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: how shared the machine was while the figures were taken."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(cfg: BenchConfig) -> dict[str, Any]:
    """Versions and machine, recorded with every figure."""
    from importlib import metadata

    import dflash_trt

    versions = {"python": platform.python_version(), "dflash_trt": dflash_trt.__version__}
    for pkg in ("torch", "transformers", "numpy", "tritonclient", "grpcio", "httpx", "nvidia-modelopt", "tensorrt_llm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    env: dict[str, Any] = {"versions": versions, "platform": platform.platform(), "cpu": _cpu_name(),
                           "cpu_count": os.cpu_count(), "device": cfg.device if cfg.in_process else None,
                           "gpu_name": None, "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else None, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    if cfg.in_process:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        if cfg.device.startswith("cuda"):
            env["gpu_name"] = torch.cuda.get_device_name(torch.device(cfg.device))
    return env


# ------------------------------------------------------------------------------------------------
# the sides of this run
# ------------------------------------------------------------------------------------------------
def _endpoint_sides(cfg: BenchConfig) -> tuple[list[Any], dict[str, Any]]:
    from dflash_trt.bench.openai_endpoint import OpenAIEndpointSide, is_http_url

    assert cfg.url is not None
    if is_http_url(cfg.url):
        if cfg.plain_url and not is_http_url(cfg.plain_url):
            raise DFlashError(f"--plain-url {cfg.plain_url} must speak what --url speaks (http://host:port)")
        side: Any = OpenAIEndpointSide(cfg.url, model=cfg.model, plain_url=cfg.plain_url, metrics_url=cfg.metrics_url,
                                       timeout_s=cfg.timeout_s)
        kind = "openai"
    else:
        from dflash_trt.bench.triton_endpoint import TritonEndpointSide

        url = cfg.url.removeprefix("grpc://")
        side = TritonEndpointSide(url, model=cfg.model or "dflash",
                                  plain_url=cfg.plain_url.removeprefix("grpc://") if cfg.plain_url else None,
                                  timeout_s=cfg.timeout_s, stream=cfg.stream)
        kind = "triton_grpc"
    side.check()
    return [side], {"kind": "endpoint", "protocol": kind, "url": cfg.url, "plain_url": cfg.plain_url,
                    "model": side.model, "metrics_url": getattr(side, "metrics_url", None)}


def _max_seq_len(cfg: BenchConfig, inputs: Any, prompts: list[BenchPrompt], block_size: int, candidates: int) -> int:
    from dflash_trt.runtime.batched.policy_calibration import calibration_tokens

    longest = max(len(inputs.encode(p)) for p in prompts)
    calib = 16 + calibration_tokens(candidates, block_size) if cfg.calibrate else 0
    return max(longest + cfg.max_new_tokens, calib, 64)


def _in_process_sides(cfg: BenchConfig, prompts: list[BenchPrompt], say: Any) -> tuple[list[Any], dict[str, Any],
                                                                                       Any, Any]:
    """(sides, source, weight sizes for the ceiling, the loaded pair's inputs)."""
    import torch

    from dflash_trt.bench.ceiling import bytes_per_step
    from dflash_trt.bench.inprocess import BatchedSide, PairInputs, ReferenceSide
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.batched.policy import default_candidates
    from dflash_trt.runtime_options import RuntimeOptions

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    policies = parse_policies(cfg.policy) if cfg.policy else [("fixed", None)]
    options = RuntimeOptions.of(cfg)
    kinds = [kind for kind, _ in policies]
    # "schedule" where any side follows it: the settings then hold the schedule given or the engine's
    pair = load_pair(PairSource(cfg.target, cfg.draft, engine=cfg.engine), options, max_draft_len=cfg.max_draft_len,
                     policy="schedule" if "schedule" in kinds else kinds[0], draft_method=cfg.draft_method,
                     draft_len_schedule=cfg.draft_len_schedule)
    spec = pair.speculation.replace(policy=kinds[0])
    source: dict[str, Any] = {"kind": "in_process", "engine": cfg.engine, "target": cfg.target, "draft": cfg.draft,
                              "engine_manifest_sha256": None, "speculation": spec.to_dict()}
    weights = "none"
    if cfg.engine:
        from dflash_trt.engine.manifest import MANIFEST_NAME

        weights = pair.manifest.quantization.weights
        source["engine_manifest_sha256"] = hashlib.sha256((Path(cfg.engine) / MANIFEST_NAME).read_bytes()).hexdigest()
        source["engine_name"] = pair.manifest.name
    elif cfg.target is None:
        from dflash_trt.embedded import default_pair_dirs

        t, d = default_pair_dirs()
        source.update(target=str(t), draft=str(d), embedded=True)
    inputs = PairInputs(pair)
    modes = ("dflash",) if cfg.tau_only else ("dflash", "plain")
    sides: list[Any] = []
    for name in cfg.runtime or []:
        if name == "reference":
            sides.append(ReferenceSide(inputs, spec.replace(policy="fixed", schedule=None), modes=modes))
            continue
        n_cands = len(default_candidates(spec.max_draft_len))
        limits = options.replace(max_batch=max(cfg.concurrency),
                                 max_seq_len=_max_seq_len(cfg, inputs, prompts, spec.block_size, n_cands))
        named = [kind if kind != "fixed" else f"fixed:{k if k is not None else spec.max_draft_len}"
                 for kind, k in policies]
        calibrate_levels = cfg.concurrency if cfg.calibrate else ()
        if len(named) == 1:  # one policy: one side, its DFlash and plain modes (bench.json's side "batched")
            sides.append(BatchedSide(inputs, spec, named[0], limits, calibrate_levels=calibrate_levels, modes=modes))
        else:  # several, side by side: one plain runtime, each policy's DFlash runtime measured against it
            if not cfg.tau_only:
                sides.append(BatchedSide(inputs, spec, named[0], limits, modes=("plain",)))
            sides += [BatchedSide(inputs, spec, policy, limits, calibrate_levels=calibrate_levels,
                                  name=f"batched {policy}", label=f"ours, batched runtime, policy {policy}",
                                  modes=("dflash",), baseline="batched") for policy in named]
        source["batched_policy"] = ",".join(named)
    source["runtimes"] = list(cfg.runtime or [])
    if cfg.peer:
        sides += _peer_sides(cfg, source, pair, spec, say)
    return sides, source, bytes_per_step(pair.target, weights), inputs


def _settle(sides: list[Any], say: Any) -> float:
    """Wait until the sides' own processes (the vLLM peer's engines) are idle; seconds waited
    (bench/quiet.py: an idle engine's spin otherwise shares the cores with the next run)."""
    pids = [pid for side in sides for pid in getattr(side, "pids", list)()]
    if not pids:
        return 0.0
    from dflash_trt.bench.quiet import wait_until_idle

    waited, idle = wait_until_idle(pids)
    if not idle:
        say(f"the peer's processes were still busy after {waited:.0f} s; running anyway")
    return waited


def _peer_sides(cfg: BenchConfig, source: dict[str, Any], pair: Any, spec: Any, say: Any) -> list[Any]:
    from dflash_trt.bench.peer_vllm import PeerSettings, VllmSide, cores_for_threads

    # vLLM binds its threads to every core unless told; ours computes on --threads of them
    cpu_bind = cores_for_threads(cfg.threads)
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_bind
    if bound:
        say(f"vLLM's threads bound to core(s) {bound}"
            + (" (VLLM_CPU_OMP_THREADS_BIND)" if "VLLM_CPU_OMP_THREADS_BIND" in os.environ
               else f", as many as ours (--threads {cfg.threads})"))
    log_dir = Path(cfg.out) / "vllm-logs" if cfg.out else Path(tempfile.mkdtemp(prefix="dflash-peer-logs-"))
    sides = []
    for eager in {"compiled": [False], "eager": [True], "both": [False, True]}[cfg.vllm_mode]:
        settings = PeerSettings(target=Path(source["target"]), draft=Path(source["draft"]), enforce_eager=eager,
                                num_speculative_tokens=spec.max_draft_len, dtype=cfg.dtype,
                                max_new_tokens=cfg.max_new_tokens, stop_token_ids=list(pair.codec.stop_token_ids),
                                fix_context_k_norm=cfg.k_norm_fix, seed=cfg.seed, cpu_bind=cpu_bind)
        sides.append(VllmSide(settings, pair.codec, log_dir, progress=say))
    source["peer"] = {"name": "vllm", "log_dir": str(log_dir), "modes": cfg.vllm_mode,
                      "num_speculative_tokens": spec.max_draft_len, "cpu_bind": bound}
    return sides


def _oracle(inputs: Any, requests: list[BenchRequest], say: Any) -> dict[str, list[int]]:
    """The reference loop's plain greedy decoding of every prompt (not timed): what --check compares with."""
    from dflash_trt.runtime.reference.generate import autoregressive_generate

    out: dict[str, list[int]] = {}
    for r in requests:
        if r.prompt.id not in out:
            out[r.prompt.id] = autoregressive_generate(inputs.pair.target, inputs.encode(r.prompt),
                                                       inputs.params(r.max_new_tokens)).output_ids
    say(f"reference greedy decoding of {len(out)} prompts done (the identity oracle)")
    return out


def _margins_of(inputs: Any) -> Any:
    """margins(prompt_id, reference ids) -> the target's logit margins along the reference output
    (bench/divergence.py), one teacher-forced pass per prompt that needs them, cached."""
    from dflash_trt.bench.divergence import logit_margins

    cache: dict[str, list[float]] = {}

    def margins(prompt_id: str, ref: list[int]) -> list[float]:
        if prompt_id not in cache:
            cache[prompt_id] = logit_margins(inputs.pair.target, inputs.ids_of(prompt_id), ref)
        return cache[prompt_id]

    return margins


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, progress: Any = None, say: Any = None
              ) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Every figure of one run (the bench.json object) and the raw records.

    `progress(kind, total_or_record)` is told the number of requests first, then each record;
    `say(line)` gets status lines (warm-up, the peer's progress)."""
    from dflash_trt.bench.ceiling import ceiling, detect_gpu
    from dflash_trt.bench.limits import analyse
    from dflash_trt.bench.summary import build_rows

    say = say or (lambda _line: None)
    if cfg.in_process:
        from dflash_trt.checkpoints.placement import runtime_device

        runtime_device(cfg.device)  # a GPU this machine lacks: one line, before anything loads
    if cfg.peer:
        from dflash_trt.bench.peer_vllm import require_peer

        require_peer()  # before anything slow: one line and `make peer` if it is absent
    gpus = _gpus(cfg)  # a bad --engine: one line before anything runs
    load_start = load_average()
    prompts = load_bench_prompts(cfg)
    requests = {c: bench_requests(cfg, prompts, c) for c in cfg.concurrency}
    inputs = sizes = None
    if cfg.in_process:
        sides, source, sizes, inputs = _in_process_sides(cfg, prompts, say)
    else:
        sides, source = _endpoint_sides(cfg)
    try:
        for side in sides:
            say(f"warm-up: {side.label}")
            side.warmup()
        runs = [(side, mode) for side in sides for mode in side.modes]
        if progress:
            progress("total", sum(map(len, requests.values())) * len(runs) * cfg.repeats)
        ran_reference_plain = any(s.name == "reference" and "plain" in s.modes for s in sides)
        oracle = None
        if cfg.check and cfg.temperature == 0 and inputs is not None and not ran_reference_plain and not cfg.tau_only:
            oracle = _oracle(inputs, requests[max(cfg.concurrency)], say)
        results: dict[tuple[str, str, int], RunResult] = {}
        every_run: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        on_done = (lambda r: progress("done", r)) if progress else (lambda r: None)
        rounds = 0
        for c in cfg.concurrency:
            for _ in range(cfg.repeats):
                for position, (side, mode) in enumerate(round_order(runs, rounds)):
                    settle_s = _settle(sides, say)
                    load = load_average()
                    res = side.run(mode, requests[c], c, on_done)
                    res.info.update(loadavg=load, settle_s=round(settle_s, 2))
                    say(f"{side.name} {mode} C={c}: {_throughput(res):.1f} tok/s total (load {load[0] if load else '?'})")
                    key = (side.name, mode, c)
                    every_run.setdefault(key, []).append(
                        {"round": rounds, "position": position, "tokens_per_s": round(_throughput(res), 3),
                         "loadavg": load, "prefill_steps_s": res.info.get("prefill_steps_s"),
                         "step_timing": res.info.get("step_timing"), "policy_choices": res.info.get("policy_choices")})
                    best = results.get(key)
                    if best is None or _throughput(res) > _throughput(best):
                        results[key] = res
                rounds += 1
        for key, res in results.items():  # the fastest run counts; every run is kept beside it
            res.info["runs"] = every_run[key]
    finally:
        for side in sides:
            side.close()

    margins = _margins_of(inputs) if inputs is not None and cfg.temperature == 0 else None
    rows = build_rows(results, sides, cfg.concurrency, cfg.per_category, oracle, margins)
    first = next((r for r in rows if r["mode"] == "dflash"), rows[0])
    plain_first = next((r for r in rows if r["side"] == first["side"] and r["mode"] == "plain"
                        and r["concurrency"] == first["concurrency"]), None)
    gpu = cfg.gpu or (detect_gpu(cfg.device) if cfg.in_process else None) or (
        "cpu" if cfg.in_process and cfg.device == "cpu" else None)
    records = [r for res in results.values() for r in res.records]
    env = environment(cfg)
    env.update(loadavg_start=load_start, loadavg_end=load_average())
    for r in rows:  # the peer's own versions, from its worker
        engine = (r.get("info") or {}).get("engine") or {}
        if engine.get("vllm_version"):
            env["versions"].update(vllm=engine["vllm_version"], vllm_torch=engine.get("torch_version"))
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "config": cfg.model_dump(),
        "environment": env,
        "source": {**source, "sides": [{"name": s.name, "label": s.label, "parallel": s.parallel,
                                        "modes": list(s.modes)} for s in sides]},
        "prompts": [{"id": p.id, "category": p.category} for p in prompts],
        "rows": rows,
        "ceiling": ceiling(sizes, gpu, first["tau"] or 0.0, first["tpot_s"]["mean"],
                           plain_first["tpot_s"]["mean"] if plain_first else None),
        "identical_all": _identical_all(rows) if cfg.temperature == 0 else None,
        "limits": analyse(rows),
        "requests": [r.to_dict() for r in records],
    }
    from dflash_trt.bench.frontier import frontier

    result["frontier"] = frontier(result, *gpus, cfg.interactivity)
    return result, records


def _gpus(cfg: BenchConfig) -> tuple[int | None, str]:
    """The GPUs a run's throughput is divided by, and where that number came from."""
    if cfg.in_process:
        return 1, f"in process: one device ({'cpu' if cfg.device == 'cpu' else 'gpu'})"
    if cfg.gpus:
        return cfg.gpus, "--gpus"
    if cfg.engine:
        from dflash_trt.engine.manifest import load_manifest

        m = load_manifest(cfg.engine).mapping
        return m.world_size, f"the engine's manifest: tp {m.tp} x pp {m.pp}"
    return None, "unknown: pass --gpus N or --engine ENGINE"


def round_order(runs: list[Any], round_index: int) -> list[Any]:
    """The order of one round's (side, mode) runs: as listed in even rounds, reversed in odd ones.
    Rounds count across levels, so with one run per level the sweep alternates too. Whatever runs
    first at a level meets that level's shapes and memory first (and, on a shared machine, a
    minute the others do not); reversing every other round spreads that over every mode alike
    instead of charging it to DFlash, which is listed first."""
    return list(runs) if round_index % 2 == 0 else list(reversed(runs))


def _throughput(res: RunResult) -> float:
    ok = [r for r in res.records if r.error is None]
    return sum(r.num_output_tokens for r in ok) / res.wall_s if res.wall_s > 0 else 0.0


def _identical_all(rows: list[dict[str, Any]]) -> bool | None:
    checks = [r["identical"] for r in rows if r.get("identical")]
    if not checks:
        return None
    return all(c["identical"] == c["checked"] for c in checks)
