"""One bench run: resolve the source and prompts, sweep concurrency for each mode, summarise."""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path
from typing import Any

from dflash_trt.bench.config import BenchConfig
from dflash_trt.bench.prompts import BenchPrompt, from_categories, from_jsonl
from dflash_trt.bench.runners import BenchRequest, EndpointRunner, InProcessRunner, RequestRecord
from dflash_trt.errors import DFlashError

SCHEMA_VERSION = 1


def load_bench_prompts(cfg: BenchConfig) -> list[BenchPrompt]:
    prompts = from_jsonl(cfg.prompts) if cfg.prompts else from_categories(cfg.category, cfg.split)
    if not prompts:
        raise DFlashError(f"no {cfg.split} prompts in categories {','.join(cfg.category)}; choose other --category")
    return prompts[: cfg.num_prompts] if cfg.num_prompts else prompts


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(cfg: BenchConfig) -> dict[str, Any]:
    """Versions and machine, recorded with every figure."""
    from importlib import metadata

    import dflash_trt

    versions = {"python": platform.python_version(), "dflash_trt": dflash_trt.__version__}
    for pkg in ("torch", "transformers", "numpy", "tritonclient", "grpcio", "nvidia-modelopt", "tensorrt_llm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    env: dict[str, Any] = {"versions": versions, "platform": platform.platform(), "cpu": _cpu_name(),
                           "cpu_count": os.cpu_count(), "device": cfg.device if cfg.in_process else None, "gpu_name": None}
    if cfg.in_process:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        if cfg.device.startswith("cuda"):
            env["gpu_name"] = torch.cuda.get_device_name(torch.device(cfg.device))
    return env


def _source(cfg: BenchConfig) -> tuple[Any, dict[str, Any], dict[str, Any] | None]:
    """(runner, source description, weight sizes for the ceiling or None)."""
    if not cfg.in_process:
        runner = EndpointRunner(cfg.url, model=cfg.model, plain_url=cfg.plain_url, timeout_s=cfg.timeout_s)
        runner.check()
        return runner, {"kind": "endpoint", "url": cfg.url, "plain_url": cfg.plain_url, "model": cfg.model}, None

    import torch

    from dflash_trt.bench.ceiling import bytes_per_step
    from dflash_trt.pairs import resolve_pair

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = resolve_pair(cfg.target, cfg.draft, engine_dir=cfg.engine, dtype=cfg.dtype, device=cfg.device,
                        max_draft_len=cfg.max_draft_len, policy=cfg.policy)
    source: dict[str, Any] = {"kind": "in_process", "engine": cfg.engine, "target": cfg.target, "draft": cfg.draft,
                              "engine_manifest_sha256": None, "speculation": pair.speculation.to_dict()}
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
    runner = InProcessRunner(pair)
    return runner, source, bytes_per_step(pair.target, weights)


def run_bench(cfg: BenchConfig, progress: Any = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Every figure of one run (the bench.json object) and the raw records.

    `progress(kind, total_or_record)` is told the number of requests first, then each record.
    """
    from dflash_trt.bench.ceiling import ceiling, detect_gpu
    from dflash_trt.bench.summary import build_sweep, identical_outputs

    prompts = load_bench_prompts(cfg)
    runner, source, sizes = _source(cfg)
    requests = [BenchRequest(p, cfg.max_new_tokens, cfg.temperature, cfg.seed + i) for i, p in enumerate(prompts)]
    modes = runner.modes
    if progress:
        progress("total", len(requests) * len(modes) * len(cfg.concurrency))
    runner.warmup()
    runner.t0 = time.perf_counter()
    records: list[RequestRecord] = []
    for c in cfg.concurrency:
        for mode in modes:
            records += runner.run(mode, requests, c, (lambda r: progress("done", r)) if progress else (lambda r: None))

    sweep = build_sweep(records, cfg.concurrency, modes)
    first = sweep[0]
    gpu = cfg.gpu or (detect_gpu(cfg.device) if cfg.in_process else None) or ("cpu" if cfg.in_process and cfg.device == "cpu" else None)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "config": cfg.model_dump(),
        "environment": environment(cfg),
        "source": {**source, "runner": runner.name, "parallel": runner.parallel, "modes": list(modes)},
        "prompts": [{"id": p.id, "category": p.category} for p in prompts],
        "sweep": sweep,
        "ceiling": ceiling(sizes, gpu, first["dflash"]["tau"], first["dflash"]["tpot_s"]["mean"],
                           first["plain"]["tpot_s"]["mean"] if first["plain"] else None),
        "identical_to_plain": identical_outputs(records) if cfg.temperature == 0 else None,
        "requests": [r.to_dict() for r in records],
    }
    return result, records
