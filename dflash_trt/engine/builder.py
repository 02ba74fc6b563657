"""`dflash-trt build`: validate -> plan -> (quantize) -> acceptance gate -> engine directory.

Everything cheap runs first (configs, mapping, quantization vs GPU, memory plan), so a bad
request fails in a second with one line. The engine is written into a temporary directory next
to `--out` and renamed into place only when complete, manifest last: an interrupted or failed
build (Ctrl-C, OOM, a failed acceptance gate) never leaves a directory that looks finished.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_trt.engine.archs import ArchSpec, resolve_arch
from dflash_trt.engine.devices import BuildDevice
from dflash_trt.engine.checks import (
    check_dtype,
    check_limits,
    check_mapping,
    check_moe_backend,
    check_quant,
    expert_format,
)
from dflash_trt.engine.drafter_node import DrafterTraits, drafter_traits
from dflash_trt.engine.hardware import GPUS
from dflash_trt.engine.release_fields import dflash_attention_backend
from dflash_trt.engine.trtllm_versions import engine_release
from dflash_trt.engine.plan import DraftShape, MemoryPlan, plan_memory, render_plan
from dflash_trt.engine.schedule_plan import ScheduleDecision
from dflash_trt.engine.schedule_plan import decide as decide_schedule
from dflash_trt.engine.recipes import ResolvedRecipe, resolve_recipe
from dflash_trt.engine.spec import BuildSpec
from dflash_trt.errors import DFlashError
from dflash_trt.process import Profile, library_versions, sigterm_as_interrupt
from dflash_trt.runtime_options import dtype_name, engine_dtype_name, torch_dtype
from dflash_trt.runtime_options import resolve_compute_dtype as resolve_compute_dtype_for


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
    recipe: ResolvedRecipe | None = None
    dtype_name: str = "bfloat16"  # the engine's unquantized dtype
    expert_format: str | None = None  # MoE experts as written (mxfp4 | nvfp4 | fp8 | bf16 ...)
    source_format: str | None = None  # MXFP4 for gpt-oss as released; None for a 16-bit checkpoint
    drafter: DrafterTraits | None = None  # family, non-causal sliding layers (engine/drafter_node.py)
    schedule: ScheduleDecision | None = None  # draft_len_schedule and K as planned (engine/schedule_plan.py)
    release: str = ""  # the TensorRT-LLM release the engine is for (trtllm_versions.engine_release)
    draft_head_dim: int | None = None  # the drafter's (or the estimate's): FA4 takes 8..256 on SM90


def _resolve_dirs(spec: BuildSpec) -> tuple[str | None, str | None]:
    if spec.target is None and spec.draft is None:
        from dflash_trt.embedded import default_pair_dirs

        t, d = default_pair_dirs()
        return str(t), str(d)
    if spec.target is None:
        raise DFlashError("--draft given without --target; pass both, or neither for the embedded default pair")
    return spec.target, spec.draft


def _check_tokenizers(target_dir: Path, draft_dir: Path | None, vocab_size: int) -> None:
    from dflash_trt.runtime.targets.loading import load_tokenizer

    tok = load_tokenizer(target_dir)  # unreadable files: DFlashError
    if tok is None:
        return  # tiny random pairs have none; generation then folds bytes into the vocabulary
    if len(tok) > vocab_size:
        raise DFlashError(f"{target_dir}: tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab_size}; "
                          "ids past the embedding would crash, use the tokenizer of this checkpoint")
    if draft_dir is not None:
        dtok = load_tokenizer(draft_dir)
        if dtok is not None and len(dtok) != len(tok):
            raise DFlashError(f"{draft_dir}: drafter tokenizer has {len(dtok)} tokens, the target's has {len(tok)}; "
                              "the pair must share one tokenizer, use a drafter trained for this target")


def prepare(spec: BuildSpec, need_checkpoints: bool = True) -> Prepared:
    """All checks that need only configs; the memory plan. Raises DFlashError on the first problem."""
    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.runtime.drafters.families import is_speculators
    from dflash_trt.runtime.drafters.validate import validate_pair

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
    traits: DrafterTraits | None = None
    layer_ids: list[int] = []
    if ddir is not None:
        if not ddir.is_dir():
            raise DFlashError(f"drafter directory {ddir} not found; pass --draft DIR with config.json and model.safetensors")
        draft_cfg = read_json(ddir / "config.json", what="drafter config")
        if is_speculators(draft_cfg):  # the engine ships draft/ as it is; TensorRT-LLM reads z-lab's
            raise DFlashError(f"{ddir} is a drafter in the speculators format, which TensorRT-LLM does not read; "
                              f"convert it first: dflash-trt convert-draft {ddir} OUT --to zlab, then --draft OUT")

        class _Cfg:  # validate_pair reads attributes
            hidden_size, num_hidden_layers, vocab_size = arch.hidden_size, arch.num_layers, arch.vocab_size

        settings = validate_pair(draft_cfg, _Cfg, where=str(ddir))
        block_size, mask, layer_ids = settings.block_size, settings.mask_token_id, list(settings.target_layer_ids)
        traits = drafter_traits(draft_cfg, ddir)
    source_format = None
    if tdir is not None:
        _check_tokenizers(tdir, ddir, arch.vocab_size)
        source_format = _source_format(tdir)
    elif arch.native_expert_format:
        source_format = arch.native_expert_format.upper()
    check_mapping(arch, spec)
    check_quant(spec)
    check_dtype(spec)
    dtype_name = resolve_dtype_name(spec, tcfg.get("dtype") or tcfg.get("torch_dtype"))
    recipe = resolve_recipe(spec.quant, spec.recipe, spec.keep_layers, is_moe=arch.is_moe,
                            native_experts=arch.native_expert_format, num_layers=arch.num_layers,
                            keep_modules=spec.keep_modules)
    experts = expert_format(arch, spec.quant, dtype_name) if arch.is_moe else None
    if experts:
        check_moe_backend(arch, spec, experts)
    draft_len, num_tokens = check_limits(spec, block_size)
    release = engine_release(spec)  # a release that is not published, or has no DFlash, fails now
    shape = DraftShape.from_config(draft_cfg) if draft_cfg else DraftShape.estimate(arch, spec.draft_num_layers)
    # a refused backend fails now
    dflash_attention_backend(spec, traits.non_causal_sliding if traits else False, shape.head_dim, release)
    plan = plan_memory(arch, spec, shape, draft_len, num_tokens, recipe)
    schedule = decide_schedule(spec, arch, shape, block_size, draft_len, recipe, experts, release=release)
    return Prepared(spec, arch, tdir, ddir, draft_cfg, block_size, mask, layer_ids, draft_len, num_tokens, plan,
                    recipe, dtype_name, experts, source_format, traits, schedule, release, shape.head_dim)


def _source_format(tdir: Path) -> str | None:
    """MXFP4 (gpt-oss as released) or None; any other quantized checkpoint (a ModelOpt export,
    transformers' FP8) is refused as a build input."""
    from dflash_trt.checkpoints.dequant import read_quant_algo

    algo = read_quant_algo(tdir)
    if algo is not None and algo != "MXFP4":
        raise DFlashError(f"{tdir} is already quantized ({algo}); `build` quantizes a 16-bit checkpoint (or "
                          "gpt-oss's released MXFP4 one): pass the original checkpoint")
    return algo


def print_spec(spec: BuildSpec, console: Any) -> None:
    import yaml

    console.print("[bold]resolved build spec[/bold]")
    console.print(yaml.safe_dump(spec.model_dump(), sort_keys=False).rstrip(), markup=False, highlight=False)


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


def resolve_dtype_name(spec: BuildSpec, checkpoint_dtype: str | None) -> str:
    """The engine's unquantized dtype: --dtype, else the checkpoint's 16-bit one (bfloat16 for a
    float32 checkpoint on a GPU engine); the CPU recipe keeps a float32 checkpoint in float32
    (runtime_options.engine_dtype_name)."""
    return engine_dtype_name(spec.dtype, checkpoint_dtype, GPUS[spec.gpu].emulated)


def resolve_compute_dtype(spec: BuildSpec, engine_dtype: Any, device: BuildDevice) -> Any:
    """The dtype the build runs its models in: --compute-dtype, else the engine's dtype where the
    build device multiplies it natively, float32 elsewhere (runtime_options.compute_dtype)."""
    return resolve_compute_dtype_for(spec.compute_dtype, engine_dtype, device.kind)


def _run_in(model: Any, dtype: Any) -> Any:
    """`model` upcast in place to `dtype` (exact), untouched when it is in `dtype` already (a model
    spread over GPUs by accelerate refuses to be moved)."""
    return model if next(model.parameters()).dtype == dtype else model.to(dtype)


def default_name(p: Prepared) -> str:
    s = p.spec
    return p.spec.name or f"{p.arch.name}-{s.quant}-{s.gpu}-tp{s.tp}" + (f"pp{s.pp}" if s.pp > 1 else "") + (
        f"ep{s.ep}" if s.ep > 1 else "")


def _gate_and_calibration_ids(p: Prepared, tokenizer: Any, gate_on: bool
                              ) -> tuple[list[list[int]], list[list[int]], int]:
    """Calibration ids, the gate's prompt ids (its first look's `gate.num_prompts`, then as many more
    as its later looks can decode in waves: engine/gate_looks.py) and how many its source has."""
    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts

    spec = p.spec
    calib: list[list[int]] = []
    if spec.quant != "none":
        prompts = load_calibration_prompts(spec.calibration.prompts, spec.calibration.num_samples, split="train")
        calib = encode_prompts(tokenizer, prompts, p.arch.vocab_size, spec.calibration.max_length)
    gate: list[list[int]] = []
    available: list[str] = []
    if gate_on:
        available = load_calibration_prompts(spec.gate.prompts, sys.maxsize, split="held-out")
        if len(available) < spec.gate.num_prompts and "num_prompts" in spec.gate.model_fields_set:
            where = "the held-out prompts" if spec.gate.prompts is None else "gate.prompts"
            raise DFlashError(f"--gate-prompts {spec.gate.num_prompts}: {where} has {len(available)} prompts; ask for "
                              "fewer, or give more in gate.prompts (a JSONL/JSON/TXT file in the build spec)")
        prompts = available[: spec.gate.num_prompts * spec.gate.max_looks]
        gate = encode_prompts(tokenizer, prompts, p.arch.vocab_size, spec.calibration.max_length)
        if len(gate) < 2:
            raise DFlashError(f"the acceptance gate needs at least 2 prompts for an interval, got {len(gate)}; "
                              "give more gate prompts")
    return calib, gate, len(available)


@dataclass
class BuildModels:
    """The models a quantized or gated build runs (calibration, the acceptance gate): the target
    placed by `placement` (one device, or a device map over the GPUs), the drafter on the target's
    home device, and the target's tokenizer (None for tiny random pairs)."""

    target: Any
    draft: Any
    placement: dict[str, Any]
    tokenizer: Any


def load_models(p: Prepared, dtype: Any, device: BuildDevice, compute: Any) -> BuildModels:
    """The target loaded in `dtype` on `device` (spread over every visible GPU by a device map when it
    is cuda) and the drafter where the target's inputs go, both run in `compute` (an exact upcast)."""
    from dflash_trt.checkpoints.placement import home_device
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.devices import device_map_for
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.targets.loading import load_tokenizer

    assert p.target_dir is not None and p.draft_dir is not None
    placement = device_map_for(p.target_dir, dtype, device)
    target = _run_in(load_checkpoint(p.target_dir, dtype, device_map=placement), compute)
    draft = _run_in(load_drafter(p.draft_dir, dtype=dtype, device=home_device(target)), compute)
    tokenizer = load_tokenizer(p.target_dir)
    return BuildModels(target, draft, placement, tokenizer)


@dataclass
class BuildRun:
    """What every phase of one build reads: the prepared build, the temporary engine directory
    it writes, the engine dtype, the dtype its models run in, the device, and how it reports."""

    p: Prepared
    tmp: Path
    dtype: Any  # the engine's: checkpoints load (rounded to it) and export in it
    compute: Any  # what the models run in: `dtype`, or float32 where `dtype` is not native (resolve_compute_dtype)
    device: BuildDevice
    progress: bool
    console: Any = None
    schedule: ScheduleDecision | None = None  # the schedule and K the engine writes (after the gate)

    @property
    def compute_name(self) -> str:
        return dtype_name(self.compute)

    def say(self, msg: str) -> None:  # plain text: paths and [low, high] intervals are not rich markup
        if self.console is not None:  # one line stays one line (the gate's verdict), whatever the width
            self.console.print(msg, markup=False, highlight=False, soft_wrap=True)


def build_engine(p: Prepared, out: Path, overwrite: bool = False, progress: bool = True,
                 console: Any = None, profile: Profile | None = None, device: BuildDevice | None = None) -> Path:
    """Write the engine directory for a prepared (validated, planned) build. Returns its path.

    Phases (each timed in the profile): load -> tau_before -> quantize_export -> tau_after for a
    quantized build, export for --quant none, then write, hash and the manifest, last.

    Host memory: a --quant none build streams the checkpoint shard by shard (no model loaded
    unless the gate is asked for). A quantized build holds ONE model at a time: the target in the
    engine dtype for the gate's "before" and calibration, then, after the export is written and
    that model freed, the exported checkpoint (dequantized, same dtype) for the gate's "after".
    """
    from dflash_trt.checkpoints.hf_config_compat import rewrite_for_both_generations
    from dflash_trt.engine.devices import resolve_device
    from dflash_trt.engine.host_memory import release_freed_memory, return_large_frees_to_os
    from dflash_trt.engine.manifest import MANIFEST_NAME
    from dflash_trt.engine.verify import hash_tree
    from dflash_trt.fsutil import atomic_directory, write_json_atomic

    spec, prof = p.spec, profile or Profile()
    return_large_frees_to_os()  # before any model: see dflash_trt.engine.host_memory
    _refuse_early(p, out, overwrite)
    quantized = spec.quant != "none"
    gate_on = spec.gate.enabled if spec.gate.enabled is not None else quantized
    device = device or resolve_device(spec.device)
    quantize_and_export = _import_quantizer(spec.quant) if quantized else None
    acceptance: dict[str, Any] | None = None
    quant_report: dict[str, Any] = {}
    looks = None  # the gate's looks, when it runs

    with sigterm_as_interrupt(), atomic_directory(out, overwrite=overwrite) as tmp:
        dtype = torch_dtype(p.dtype_name)
        run = BuildRun(p, tmp, dtype, resolve_compute_dtype(spec, dtype, device), device, progress, console)
        models: BuildModels | None = None
        if quantized or gate_on:
            with prof.phase("load"):
                run.say(f"loading target {p.target_dir} ({p.dtype_name}, {device.describe()}) and drafter {p.draft_dir}"
                        + (f"; running them in {run.compute_name} (--compute-dtype; twice the host memory of "
                           f"{p.dtype_name}, several times faster where {p.dtype_name} is not native)"
                           if run.compute != dtype else ""))
                models = load_models(p, run.dtype, device, run.compute)
                calib_ids, gate_ids, source_prompts = _gate_and_calibration_ids(p, models.tokenizer, gate_on)
            if gate_on:
                looks = _gate_looks(run, models.draft, gate_ids, source_prompts)
                with prof.phase("tau_before"):
                    looks.decode("before", models.target)
                acceptance = _before_verdict(run, looks.before)
                if quantized:  # the drop's looks, planned on the pass just timed
                    run.say(looks.plan_line())
        if quantized:
            assert models is not None and quantize_and_export is not None
            with prof.phase("quantize_export"):
                quant_report = _quantize_export(run, quantize_and_export, models.target, calib_ids)
            models.target = None  # the export holds the quantized weights now: free the float model
            release_freed_memory()
            if gate_on:
                with prof.phase("tau_after"):
                    slot = _gate_after_export(run, models, looks)
                if looks.looks[-1].look.decision == "continue":
                    with prof.phase("gate_looks"):  # the models alternate: one held at a time
                        looks.go_on(slot)
                slot = None
                release_freed_memory()
                acceptance = _after_verdict(run, looks, acceptance)
        else:
            models = None
            release_freed_memory()
            with prof.phase("export"):
                _convert_target(run)
        # TensorRT-LLM reads config.json and the tokenizer with transformers 4.57: ModelOpt's export
        # (and a source saved by transformers 5) spells them in transformers 5's form only
        rewrite_for_both_generations(tmp / "target", source_dir=p.target_dir)
        models = None
        # the engine's own weights' acceptance: after quantization when it quantized
        run.schedule = _final_schedule(run, None if looks is None else looks.after if looks.after.n else looks.before)
        with prof.phase("write"):
            opts = _write_draft_and_launch(run)
        with prof.phase("hash"):
            files = hash_tree(tmp)
        manifest = _manifest(run, out, opts, files, quant_report, acceptance, prof)
        write_json_atomic(tmp / MANIFEST_NAME, manifest.model_dump(mode="json"))
    return out


def _refuse_early(p: Prepared, out: Path, overwrite: bool) -> None:
    """An existing --out without --force, or a disk without room for the engine: refused now, not
    when the disk fills."""
    from dflash_trt.fsutil import reserve_space, tree_bytes

    assert p.target_dir is not None and p.draft_dir is not None
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} already exists; pass --force to replace it, or choose another --out")
    reserve_space(out, tree_bytes(p.target_dir) * {"fp8": 0.55, "nvfp4": 0.3}.get(p.spec.quant, 1.0)
                  + tree_bytes(p.draft_dir), "the engine")


def _import_quantizer(quant: str) -> Any:
    """ModelOpt's quantize-and-export, imported before any model exists (see
    dflash_trt.engine.quantize on ModelOpt's first import)."""
    try:
        from dflash_trt.engine.quantize import quantize_and_export
    except ImportError as e:
        raise DFlashError(f"--quant {quant} needs nvidia-modelopt ({e}); pip install 'dflash-trt[quant]'")
    return quantize_and_export


def _gate_looks(run: BuildRun, draft: Any, gate_ids: list[list[int]], source_prompts: int) -> Any:
    """The gate's looks over its prompts (engine/gate_looks.GateLooks), as the spec plans them."""
    from dflash_trt.engine.gate_looks import GateLooks, GatePlan

    g = run.p.spec.gate
    plan = GatePlan(g.num_prompts, g.max_new_tokens, g.max_looks, g.budget_s, g.max_tau_drop, run.p.max_draft_len)
    return GateLooks(plan, gate_ids, draft, run.progress, run.say, source_prompts)


def _before_verdict(run: BuildRun, before: Any) -> dict[str, Any]:
    """The unquantized tau, and whether the drafter fits this target at all."""
    from dflash_trt.engine import gate as gate_mod

    spec = run.p.spec
    fit = gate_mod.check_fit(before, spec.gate.min_tau)
    lo, hi = before.interval()
    run.say(f"unquantized tau {before.tau:.3f} [{lo:.3f}, {hi:.3f}] (95%, {before.n} prompts x "
            f"{spec.gate.max_new_tokens} tokens, look 1)")
    return {"before": before.summary(), "fit": fit, "compute_dtype": run.compute_name}


def _quantize_export(run: BuildRun, quantize_and_export: Any, target: Any, calib_ids: list[list[int]]
                     ) -> dict[str, Any]:
    """Calibrate and quantize `target` with ModelOpt and export it to target/ (the tokenizer files
    beside it); the quantization report."""
    from dflash_trt.checkpoints.streaming import copy_aux_files

    p, spec = run.p, run.p.spec
    assert p.recipe is not None and p.target_dir is not None
    run.say(f"quantizing with ModelOpt: {spec.quant} weights, recipe {p.recipe.describe()}, KV cache "
            f"{spec.kv_cache_quant}, {len(calib_ids)} calibration prompts")
    report = quantize_and_export(
        target, spec.quant, spec.kv_cache_quant, p.recipe, calib_ids, run.tmp / "target", run.dtype, run.progress,
        mxfp4_source=p.target_dir if p.source_format == "MXFP4" else None)
    copy_aux_files(p.target_dir, run.tmp / "target")
    cast = report.get("mxfp4_cast")
    if cast:
        run.say(f"MXFP4 -> NVFP4 expert cast: {cast['lossless_blocks']}/{cast['mxfp4_blocks']} blocks bit-exact")
    return report


def _gate_after_export(run: BuildRun, models: BuildModels, looks: Any) -> Any:
    """Look 1's tau of the EXPORTED weights (dequantized, placed as the float target was), judged;
    the slot that holds that model (the only reference to it), and reloads either side for later looks."""
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.gate_looks import ModelSlot
    from dflash_trt.engine.host_memory import release_freed_memory

    assert run.p.target_dir is not None
    dirs = {"before": run.p.target_dir, "after": run.tmp / "target"}
    slot = ModelSlot("after", None, lambda side: _run_in(load_checkpoint(dirs[side], run.dtype,
                                                                          device_map=models.placement), run.compute),
                     release_freed_memory)
    slot.model = slot.load("after")
    looks.decode("after", slot.model)
    looks.decide()
    run.say(looks.progress_line())
    return slot


def _after_verdict(run: BuildRun, looks: Any, acceptance: dict[str, Any] | None) -> dict[str, Any]:
    """The gate's decision, its one line, and its record; DFlashError on a failed or undecided gate."""
    from dflash_trt.engine.gate_looks import verdict_record

    spec = run.p.spec
    decided = {**verdict_record(looks, spec.quant, spec.gate.min_tau, spec.gate.accept_tau_drop, run.say),
               "fit": acceptance["fit"] if acceptance else None, "compute_dtype": run.compute_name}
    return decided


def _convert_target(run: BuildRun) -> None:
    """--quant none: the checkpoint cast to the engine dtype shard by shard (MXFP4 experts kept)."""
    from dflash_trt.checkpoints.streaming import convert_checkpoint

    p = run.p
    assert p.target_dir is not None
    stats = convert_checkpoint(p.target_dir, run.tmp / "target", run.dtype, run.progress)
    run.say(f"target written shard by shard: {stats['cast']} tensors in {p.dtype_name}, {stats['kept']} kept "
            "byte for byte" + (" (MXFP4 experts as shipped)" if p.source_format == "MXFP4" else ""))


def _final_schedule(run: BuildRun, sample: Any) -> ScheduleDecision | None:
    """The schedule the engine writes: the planned one, re-derived from the acceptance gate's
    per-position acceptance (the engine's own weights: after quantization when it quantized) when
    the plan derived it from the default profile."""
    from dflash_trt.engine.acceptance_profile import AcceptanceProfile
    from dflash_trt.engine.schedule_plan import render

    p, spec = run.p, run.p.spec
    planned = p.schedule
    if planned is None or planned.source != "derived" or spec.acceptance_profile is not None or sample is None:
        return planned
    measured = AcceptanceProfile.measured(
        sample.position_drafted, sample.position_accepted,
        f"acceptance gate: {sample.n} prompts x {spec.gate.max_new_tokens} tokens, greedy, "
        f"{'after ' + spec.quant + ' quantization' if spec.quant != 'none' else 'unquantized'}")
    if measured is None:
        return planned
    decided = decide_schedule(spec, p.arch, DraftShape.from_config(p.draft_cfg) if p.draft_cfg else
                              DraftShape.estimate(p.arch, spec.draft_num_layers), p.block_size, p.max_draft_len,
                              p.recipe, p.expert_format, measured, release=p.release)
    if run.console is not None:
        render(decided, run.console)
    return decided


def _write_draft_and_launch(run: BuildRun) -> dict[str, Any]:
    """draft/ (byte for byte, not requantized), llm_api_options.yaml and the launch scripts; the
    LLM-API options written."""
    import yaml

    from dflash_trt.checkpoints.hf_config_compat import rewrite_for_both_generations
    from dflash_trt.engine.llm_api import launch_scripts, llm_api_options, render_yaml
    from dflash_trt.engine.trtllm_versions import min_version
    from dflash_trt.fsutil import write_text_atomic

    p, spec, tmp = run.p, run.p.spec, run.tmp
    assert p.draft_dir is not None
    (tmp / "draft").mkdir()
    for f in sorted(p.draft_dir.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".md", ".txt"):
            shutil.copy2(f, tmp / "draft" / f.name)
    rewrite_for_both_generations(tmp / "draft")  # only a transformers-5-only config changes
    K, schedule = _written_k(run), run.schedule.schedule if run.schedule else None
    opts = llm_api_options(spec, is_moe=p.arch.is_moe, max_draft_len=K,
                           max_num_tokens=p.max_num_tokens, mask_token_id=int(p.mask_token_id or 0),
                           target_layer_ids=p.target_layer_ids, dtype=p.dtype_name,
                           expert_format=p.expert_format, schedule=schedule, release=p.release,
                           fields=_fields(run))
    min_trtllm = min_version(opts)  # the oldest release that has every key written
    header = (f"TensorRT-LLM LLM-API options (>= {min_trtllm}, one-model DFlash; written for {p.release}), generated "
              "by dflash-trt build.\nPaths are relative to the engine directory (TensorRT-LLM takes them from its working "
              "directory):\nrun launch/trtllm-serve.sh from anywhere, or trtllm-serve ./target --config "
              "./llm_api_options.yaml from here.")
    if spec.gpu == "cpu":
        header += ("\nCPU engine (float32, the reference runtime): TensorRT-LLM's DFlash kernels take "
                   "float16/bfloat16 only; dflash-trt never hands it this file.")
    write_text_atomic(tmp / "llm_api_options.yaml", render_yaml(opts, header))
    assert yaml.safe_load((tmp / "llm_api_options.yaml").read_text()) == opts
    for rel, text in launch_scripts(spec, is_moe=p.arch.is_moe, max_draft_len=K,
                                    block_size=int(p.block_size or p.max_draft_len + 1), schedule=schedule,
                                    family=p.drafter.family if p.drafter else "dflash",
                                    vllm_schedule=run.schedule.peers if run.schedule else None).items():
        write_text_atomic(tmp / rel, text)
        (tmp / rel).chmod(0o755)
    return opts


def _fields(run: BuildRun) -> list[Any]:
    """The DFlashDecodingConfig fields beyond the drafter's for the engine's release, with why
    (engine/release_fields.py; context_recompute_tail from the committed measurement, if any)."""
    from dflash_trt.engine.llm_api import speculative_fields
    from dflash_trt.engine.recompute_tail import load_measurement

    p = run.p
    return speculative_fields(p.spec, p.release, non_causal_sliding=bool(p.drafter and p.drafter.non_causal_sliding),
                              head_dim=p.draft_head_dim, measurement=load_measurement())


def _written_k(run: BuildRun) -> int:
    """K as the engine writes it: the schedule's (which may lower the requested one), else the plan's."""
    return run.schedule.max_draft_len if run.schedule else run.p.max_draft_len


def _speculation_info(run: BuildRun) -> Any:
    from dflash_trt.engine.manifest import SpeculationInfo

    spec, K = run.p.spec, _written_k(run)
    decided = run.schedule
    record = decided.to_record() if decided else {"source": "none", "max_draft_len": K,
                                                  "requested_max_draft_len": run.p.max_draft_len}
    return SpeculationInfo(**record, rejection_sampling=spec.rejection_sampling,
                           acceptance_rate_window=spec.acceptance_rate_window,
                           acceptance_rate_threshold=spec.acceptance_rate_threshold,
                           fields={f.key: f.to_dict() for f in _fields(run)})


def _manifest(run: BuildRun, out: Path, opts: dict[str, Any], files: Any, quant_report: dict[str, Any],
              acceptance: dict[str, Any] | None, prof: Profile) -> Any:
    """The engine's manifest: what was built, from what, how, and every file's sha256."""
    from dflash_trt.engine.manifest import DraftInfo, EngineManifest, Limits, Mapping, Quantization, TargetInfo
    from dflash_trt.engine.trtllm_versions import min_version, requirements

    p, spec = run.p, run.p.spec
    return EngineManifest(
        name=default_name(p),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu=spec.gpu,
        mapping=Mapping(tp=spec.tp, pp=spec.pp, ep=spec.ep, gpus_per_node=spec.gpus_per_node),
        quantization=Quantization(weights=spec.quant, kv_cache=spec.kv_cache_quant,
                                  recipe=p.recipe.name if p.recipe else None,
                                  keep_layers=list(p.recipe.keep_layers) if p.recipe else [],
                                  keep_modules=list(p.recipe.keep_modules) if p.recipe else [],
                                  source_format=p.source_format, expert_format=p.expert_format,
                                  dtype=p.dtype_name, report=quant_report or None),
        limits=Limits(max_batch_size=spec.max_batch_size, max_seq_len=spec.max_seq_len,
                      max_draft_len=_written_k(run), max_num_tokens=p.max_num_tokens),
        target=TargetInfo(architecture=p.arch.architecture, num_layers=p.arch.num_layers,
                          hidden_size=p.arch.hidden_size, vocab_size=p.arch.vocab_size),
        draft=DraftInfo(block_size=int(p.block_size or 0), mask_token_id=int(p.mask_token_id or 0),
                        target_layer_ids=p.target_layer_ids, family=p.drafter.family if p.drafter else None),
        min_tensorrt_llm_version=min_version(opts),
        tensorrt_llm_requirements=requirements(opts),
        tensorrt_llm_release=p.release,
        versions=library_versions(("nvidia-modelopt",) if spec.quant != "none" else ()),
        # the resolved spec, re-runnable as is with `build --spec` (the Slurm build job does that)
        spec={**spec.model_dump(), "target": str(p.target_dir), "draft": str(p.draft_dir), "out": str(out),
              "dtype": p.dtype_name},
        files=files,
        plan=p.plan.to_dict(),
        acceptance=acceptance,
        timings_s={k: round(v, 3) for k, v in prof.phases.items()},
        build_device=run.device.describe(),
        speculation=_speculation_info(run),
    )


def show_plan(p: Prepared, console: Any) -> None:
    from dflash_trt.engine.schedule_plan import render

    render_plan(p.plan, p.arch, console)
    if p.schedule is not None:
        render(p.schedule, console)
