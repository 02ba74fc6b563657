"""`dflash-trt build`: validate -> plan -> (quantize) -> acceptance gate -> engine directory.

Everything cheap runs first (configs, mapping, quantization vs GPU, memory plan), so a bad
request fails in a second with one line. The engine is written into a temporary directory next
to `--out` and renamed into place only when complete, manifest last: an interrupted or failed
build (Ctrl-C, OOM, a failed acceptance gate) never leaves a directory that looks finished.
"""

from __future__ import annotations

import resource
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from dflash_trt.engine.archs import ArchSpec, resolve_arch
from dflash_trt.engine.checks import check_limits, check_mapping, check_quant
from dflash_trt.engine.plan import DraftShape, MemoryPlan, plan_memory, render_plan
from dflash_trt.engine.spec import BuildSpec
from dflash_trt.errors import DFlashError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# ---------------------------------------------------------------------------------------------
# Phases: wall time and peak RSS of each
# ---------------------------------------------------------------------------------------------


@dataclass
class Profile:
    phases: dict[str, float] = field(default_factory=dict)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
            # ru_maxrss is the process's peak so far (KiB on Linux): read after each phase, the
            # first phase whose value jumps is the one that set the peak.
            self.peak_rss_mib[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (timeout, scancel, kill) into KeyboardInterrupt so the temporary engine
    directory is removed; by default SIGTERM kills Python without running any cleanup."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def versions(quantized: bool) -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from dflash_trt import __version__

    out = {"dflash-trt": __version__, "python": platform.python_version()}
    libs = ["torch", "transformers", "safetensors", "pydantic", "pyyaml"] + (["nvidia-modelopt"] if quantized else [])
    for lib in libs:
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = "not installed"
    return out


# ---------------------------------------------------------------------------------------------
# Validation and planning (no weights loaded)
# ---------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    spec: BuildSpec
    arch: ArchSpec
    target_dir: Path | None
    draft_dir: Path | None
    draft_cfg: dict[str, Any] | None
    block_size: int | None
    mask_token_id: int | None
    target_layer_ids: list[int]
    max_draft_len: int
    max_num_tokens: int
    plan: MemoryPlan


def _resolve_dirs(spec: BuildSpec) -> tuple[str | None, str | None]:
    if spec.target is None and spec.draft is None:
        from dflash_trt.embedded import default_pair_dirs

        t, d = default_pair_dirs()
        return str(t), str(d)
    if spec.target is None:
        raise DFlashError("--draft given without --target; pass both, or neither for the embedded default pair")
    return spec.target, spec.draft


def _check_tokenizers(target_dir: Path, draft_dir: Path | None, vocab_size: int) -> None:
    from dflash_trt.runtime.loading import load_tokenizer

    if not any((target_dir / f).is_file() for f in TOKENIZER_FILES):
        return  # tiny random pairs have none; generation then folds bytes into the vocabulary
    tok = load_tokenizer(target_dir)
    if tok is None:
        raise DFlashError(f"{target_dir}: tokenizer files present but unreadable; re-export the checkpoint's tokenizer")
    if len(tok) > vocab_size:
        raise DFlashError(f"{target_dir}: tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab_size}; "
                          "ids past the embedding would crash, use the tokenizer of this checkpoint")
    if draft_dir is not None and any((draft_dir / f).is_file() for f in TOKENIZER_FILES):
        dtok = load_tokenizer(draft_dir)
        if dtok is not None and len(dtok) != len(tok):
            raise DFlashError(f"{draft_dir}: drafter tokenizer has {len(dtok)} tokens, the target's has {len(tok)}; "
                              "the pair must share one tokenizer, use a drafter trained for this target")


def prepare(spec: BuildSpec, need_checkpoints: bool = True) -> Prepared:
    """All checks that need only configs; the memory plan. Raises DFlashError on the first problem."""
    from dflash_trt.runtime.checkpoint import read_json
    from dflash_trt.runtime.validate import validate_pair

    target, draft = _resolve_dirs(spec)
    arch, tcfg, tdir = resolve_arch(target)
    if need_checkpoints:
        if tdir is None:
            raise DFlashError(f"target {target!r} is a known architecture, not a checkpoint; `build` needs "
                              "--target DIR (config.json + *.safetensors); use `dflash-trt plan` for sizing only")
        if draft is None:
            raise DFlashError("no --draft given; pass the DFlash drafter directory (z-lab format)")
        if not list(tdir.glob("*.safetensors")):
            raise DFlashError(f"{tdir}: no *.safetensors weights; pass a HF checkpoint directory with safetensors")
    ddir = Path(draft) if draft is not None else None
    draft_cfg = None
    block_size = mask = None
    layer_ids: list[int] = []
    if ddir is not None:
        if not ddir.is_dir():
            raise DFlashError(f"drafter directory {ddir} not found; pass --draft DIR with config.json and model.safetensors")
        draft_cfg = read_json(ddir / "config.json", what="drafter config")

        class _Cfg:  # validate_pair reads attributes
            hidden_size, num_hidden_layers, vocab_size = arch.hidden_size, arch.num_layers, arch.vocab_size

        settings = validate_pair(draft_cfg, _Cfg, where=str(ddir))
        block_size, mask, layer_ids = settings.block_size, settings.mask_token_id, list(settings.target_layer_ids)
    if tdir is not None:
        _check_tokenizers(tdir, ddir, arch.vocab_size)
    check_mapping(arch, spec)
    check_quant(spec)
    draft_len, num_tokens = check_limits(spec, block_size)
    shape = DraftShape.from_config(draft_cfg) if draft_cfg else DraftShape.estimate(arch, spec.draft_num_layers)
    plan = plan_memory(arch, spec, shape, draft_len, num_tokens)
    return Prepared(spec, arch, tdir, ddir, draft_cfg, block_size, mask, layer_ids, draft_len, num_tokens, plan)


def print_spec(spec: BuildSpec, console: Any) -> None:
    import yaml

    console.print("[bold]resolved build spec[/bold]")
    console.print(yaml.safe_dump(spec.model_dump(), sort_keys=False).rstrip(), markup=False, highlight=False)


# ---------------------------------------------------------------------------------------------
# Acceptance: tau with the reference runtime
# ---------------------------------------------------------------------------------------------


def measure_tau(target: Any, draft: Any, prompt_ids: list[list[int]], max_new_tokens: int, desc: str,
                progress: bool = True, max_draft_len: int | None = None) -> dict[str, float]:
    """Greedy DFlash on each prompt, K = max_draft_len drafts a step (the engine's); tau over all
    steps (includes the bonus token)."""
    from tqdm import tqdm

    from dflash_trt.runtime.generate import dflash_generate
    from dflash_trt.sampling_params import SamplingParams
    from dflash_trt.speculation import SpeculationSettings

    steps = committed = drafted = accepted = 0
    params = SamplingParams(max_tokens=max_new_tokens)
    speculation = SpeculationSettings.for_block(draft.block_size, max_draft_len)
    for ids in tqdm(prompt_ids, desc=desc, unit="prompt", disable=not progress, file=sys.stderr):
        s = dflash_generate(draft, target, ids, params, speculation).stats
        steps += s.num_steps
        committed += sum(s.acceptance_lengths)  # tau counts the bonus token of every step
        drafted += s.total_draft_tokens
        accepted += s.total_accepted_draft_tokens
    return {"tau": committed / steps if steps else 0.0, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "steps": steps, "prompts": len(prompt_ids)}


def acceptance_gate(before: dict[str, Any], after: dict[str, Any], quant: str, max_drop: float,
                    accept_drop: bool) -> dict[str, Any]:
    """The gate's record; DFlashError when tau fell by more than `max_drop` (relative) unless accepted.

    Quantization keeps DFlash lossless (the target verifies) but can silently cost acceptance:
    the drafter was trained on the float target's hidden states and outputs.
    """
    drop = (before["tau"] - after["tau"]) / before["tau"] if before["tau"] else 0.0
    record = {"before": before, "after": after, "relative_drop": drop, "max_tau_drop": max_drop,
              "accepted_by_flag": False}
    if drop > max_drop:
        if not accept_drop:
            raise DFlashError(
                f"acceptance gate failed: tau fell from {before['tau']:.3f} to {after['tau']:.3f} "
                f"({drop:.1%} > {max_drop:.0%}) after {quant} quantization; calibrate on more prompts, "
                "try --quant fp8 or --kv-cache-quant none, or pass --accept-tau-drop to keep the engine"
            )
        record["accepted_by_flag"] = True
    return record


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


def _resolve_dtype(spec: BuildSpec, tcfg_dtype: str | None):
    import torch

    name = spec.dtype if spec.dtype != "auto" else (tcfg_dtype or "bfloat16")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(name), torch.bfloat16)


def default_name(p: Prepared) -> str:
    s = p.spec
    return p.spec.name or f"{p.arch.name}-{s.quant}-{s.gpu}-tp{s.tp}" + (f"pp{s.pp}" if s.pp > 1 else "") + (
        f"ep{s.ep}" if s.ep > 1 else "")


def build_engine(p: Prepared, out: Path, overwrite: bool = False, progress: bool = True,
                 console: Any = None, profile: Profile | None = None) -> Path:
    """Write the engine directory for a prepared (validated, planned) build. Returns its path."""
    import yaml

    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts
    from dflash_trt.engine.dequant import load_quantized_target
    from dflash_trt.engine.llm_api import launch_scripts, llm_api_options, render_yaml
    from dflash_trt.engine.manifest import MANIFEST_NAME, DraftInfo, EngineManifest, Limits, Mapping, Quantization, TargetInfo
    from dflash_trt.engine.trtllm_versions import min_version, requirements
    from dflash_trt.engine.verify import hash_tree
    from dflash_trt.fsutil import atomic_directory, write_json_atomic, write_text_atomic
    from dflash_trt.runtime.checkpoint import read_json
    from dflash_trt.runtime.draft_model import DFlashDraftModel
    from dflash_trt.runtime.loading import load_target, load_tokenizer

    spec, prof = p.spec, profile or Profile()
    assert p.target_dir is not None and p.draft_dir is not None
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} already exists; pass --force to replace it, or choose another --out")
    from dflash_trt.fsutil import reserve_space, tree_bytes  # refuse now, not when the disk fills

    reserve_space(out, tree_bytes(p.target_dir) * {"fp8": 0.55, "nvfp4": 0.3}.get(spec.quant, 1.0)
                  + tree_bytes(p.draft_dir), "the engine")
    say = (console.print if console is not None else (lambda *a, **k: None))
    tcfg = read_json(p.target_dir / "config.json", what="target config")
    dtype = _resolve_dtype(spec, tcfg.get("dtype") or tcfg.get("torch_dtype"))
    quantized = spec.quant != "none"

    with sigterm_as_interrupt(), atomic_directory(out, overwrite=overwrite) as tmp:
        with prof.phase("load"):
            say(f"loading target {p.target_dir} ({str(dtype).removeprefix('torch.')}) and drafter {p.draft_dir}")
            target = load_target(p.target_dir, dtype)
            draft = DFlashDraftModel.from_pretrained(p.draft_dir, dtype=dtype)
            tokenizer = load_tokenizer(p.target_dir) if any((p.target_dir / f).is_file() for f in TOKENIZER_FILES) else None
        acceptance: dict[str, Any] | None = None
        if quantized:
            prompts = load_calibration_prompts(spec.calibration.prompts, spec.calibration.num_samples)
            ids = encode_prompts(tokenizer, prompts, p.arch.vocab_size, spec.calibration.max_length)
            gate_ids = ids[: spec.gate.num_prompts]
            if spec.gate.enabled:
                with prof.phase("tau_before"):
                    before = measure_tau(target, draft, gate_ids, spec.gate.max_new_tokens, "tau (unquantized)", progress,
                                         p.max_draft_len)
            with prof.phase("quantize_export"):
                say(f"quantizing with ModelOpt: {spec.quant} weights, KV cache {spec.kv_cache_quant}, "
                    f"{len(ids)} calibration prompts")
                from dflash_trt.engine.quantize import quantize_and_export

                quantize_and_export(target, spec.quant, spec.kv_cache_quant, ids, tmp / "target", dtype, progress)
            del target
            import gc

            gc.collect()  # the calibrated model is large; free it before loading the exported one
            if spec.gate.enabled:
                with prof.phase("tau_after"):
                    qtarget = load_quantized_target(tmp / "target", dtype)
                    after = measure_tau(qtarget, draft, gate_ids, spec.gate.max_new_tokens, f"tau ({spec.quant})", progress,
                                        p.max_draft_len)
                    del qtarget
                acceptance = acceptance_gate(before, after, spec.quant, spec.gate.max_tau_drop,
                                             spec.gate.accept_tau_drop)
                say(f"acceptance gate: tau {before['tau']:.3f} (unquantized) -> {after['tau']:.3f} ({spec.quant}), "
                    f"drop {acceptance['relative_drop']:+.1%} (allowed {spec.gate.max_tau_drop:.0%})")
        else:
            with prof.phase("export"):
                target.save_pretrained(tmp / "target")
                del target
        with prof.phase("write"):
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "target")
            (tmp / "draft").mkdir()
            for f in sorted(p.draft_dir.iterdir()):  # the drafter ships byte for byte (not requantized)
                if f.is_file() and f.suffix in (".json", ".safetensors", ".md", ".txt"):
                    shutil.copy2(f, tmp / "draft" / f.name)
            opts = llm_api_options(spec, is_moe=p.arch.is_moe, max_draft_len=p.max_draft_len,
                                   max_num_tokens=p.max_num_tokens, mask_token_id=int(p.mask_token_id or 0),
                                   target_layer_ids=p.target_layer_ids)
            min_trtllm = min_version(opts)  # the oldest release that has every key written
            header = (f"TensorRT-LLM LLM-API options (>= {min_trtllm}, one-model DFlash), generated by "
                      "dflash-trt build.\nRun from the engine directory: trtllm-serve ./target --config ./llm_api_options.yaml")
            write_text_atomic(tmp / "llm_api_options.yaml", render_yaml(opts, header))
            assert yaml.safe_load((tmp / "llm_api_options.yaml").read_text()) == opts
            for rel, text in launch_scripts(spec, is_moe=p.arch.is_moe, max_draft_len=p.max_draft_len,
                                            block_size=int(p.block_size or p.max_draft_len + 1)).items():
                write_text_atomic(tmp / rel, text)
                (tmp / rel).chmod(0o755)
        with prof.phase("hash"):
            files = hash_tree(tmp)
        manifest = EngineManifest(
            name=default_name(p),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            gpu=spec.gpu,
            mapping=Mapping(tp=spec.tp, pp=spec.pp, ep=spec.ep, gpus_per_node=spec.gpus_per_node),
            quantization=Quantization(weights=spec.quant, kv_cache=spec.kv_cache_quant),
            limits=Limits(max_batch_size=spec.max_batch_size, max_seq_len=spec.max_seq_len,
                          max_draft_len=p.max_draft_len, max_num_tokens=p.max_num_tokens),
            target=TargetInfo(architecture=p.arch.architecture, num_layers=p.arch.num_layers,
                              hidden_size=p.arch.hidden_size, vocab_size=p.arch.vocab_size),
            draft=DraftInfo(block_size=int(p.block_size or 0), mask_token_id=int(p.mask_token_id or 0),
                            target_layer_ids=p.target_layer_ids),
            min_tensorrt_llm_version=min_trtllm,
            tensorrt_llm_requirements=requirements(opts),
            versions=versions(quantized),
            # the resolved spec, re-runnable as is with `build --spec` (the Slurm build job does that)
            spec={**spec.model_dump(), "target": str(p.target_dir), "draft": str(p.draft_dir), "out": str(out),
                  "dtype": str(dtype).removeprefix("torch.")},
            files=files,
            plan=p.plan.to_dict(),
            acceptance=acceptance,
            timings_s={k: round(v, 3) for k, v in prof.phases.items()},
        )
        write_json_atomic(tmp / MANIFEST_NAME, manifest.model_dump(mode="json"))
    return out


def render_profile(prof: Profile, console: Any) -> None:
    from rich.table import Table

    t = Table(title="build profile")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    t.add_column("peak RSS so far (MiB)", justify="right")
    for name, secs in prof.phases.items():
        t.add_row(name, f"{secs:.2f}", f"{prof.peak_rss_mib.get(name, 0):.0f}")
    t.add_row("total", f"{sum(prof.phases.values()):.2f}", f"{max(prof.peak_rss_mib.values(), default=0):.0f}")
    console.print(t)


def show_plan(p: Prepared, console: Any) -> None:
    render_plan(p.plan, p.arch, console)
