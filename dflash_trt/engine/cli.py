"""Commands of the build area: `dflash-trt build`, `plan`, `verify`.

Heavy libraries (torch, transformers, modelopt) are imported inside the commands only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash_trt.cli_helpers import friendly_errors, int_list, max_draft_len_option, no_progress_option, str_list
from dflash_trt.engine.spec import GateSpec
from dflash_trt.runtime_options import DTYPE_CHOICES

_GATE_BUDGET_S = GateSpec.model_fields["budget_s"].default  # one owner: the spec

# Flag name -> dotted build-spec key. Flags left unset (None) do not override the YAML.
FLAG_TO_KEY = {
    "target": "target", "draft": "draft", "out": "out", "name": "name", "tp": "tp", "pp": "pp", "ep": "ep",
    "gpu": "gpu", "gpus_per_node": "gpus_per_node", "nodes": "nodes", "quant": "quant",
    "kv_cache_quant": "kv_cache_quant", "dtype": "dtype", "max_batch_size": "max_batch_size",
    "max_seq_len": "max_seq_len", "max_draft_len": "max_draft_len", "max_num_tokens": "max_num_tokens",
    "free_gpu_memory_fraction": "free_gpu_memory_fraction", "draft_num_layers": "draft_num_layers",
    "calib_prompts": "calibration.prompts", "calib_size": "calibration.num_samples",
    "calib_max_length": "calibration.max_length", "max_tau_drop": "gate.max_tau_drop",
    "accept_tau_drop": "gate.accept_tau_drop", "gate": "gate.enabled", "gate_prompts": "gate.num_prompts",
    "recipe": "recipe", "keep_layers": "keep_layers", "keep_modules": "keep_modules", "device": "device", "min_tau": "gate.min_tau",
    "gate_tokens": "gate.max_new_tokens", "gate_looks": "gate.max_looks", "gate_budget": "gate.budget_s",
    "compute_dtype": "compute_dtype",
    "draft_len_schedule": "draft_len_schedule", "acceptance_profile": "acceptance_profile",
    "rejection_sampling": "rejection_sampling", "acceptance_rate_window": "acceptance_rate_window",
    "acceptance_rate_threshold": "acceptance_rate_threshold", "tensorrt_llm_release": "tensorrt_llm_release",
}


def spec_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The build-spec flags shared by `build` and `plan` (each overrides the YAML key it names)."""
    opts = [
        click.option("--spec", "spec_file", metavar="YAML",
                     help="Build spec YAML, or the name of a recipe under build/ (e.g. qwen3-8b-h100-fp8)."),
        click.option("--target", help="Target checkpoint dir (HF). `plan` also takes a known architecture name."),
        click.option("--draft", help="DFlash drafter dir (z-lab format)."),
        click.option("--tp", type=click.IntRange(min=1), help="Tensor parallel size."),
        click.option("--pp", type=click.IntRange(min=1), help="Pipeline parallel size."),
        click.option("--ep", type=click.IntRange(min=1), help="MoE expert parallel size (divides --tp)."),
        click.option("--quant", type=click.Choice(["none", "fp8", "nvfp4"]), help="Target weight quantization."),
        click.option("--recipe", type=click.Choice(["auto", "full", "mlp-only", "experts-only"]),
                     help="Which layers --quant applies to (auto: mlp-only, nvfp4 with down_proj kept in 16 bits; "
                          "on gpt-oss NVIDIA's nvfp4_mlp_only)."),
        click.option("--keep-layers", callback=int_list("0,29"), metavar="I,J",
                     help="Decoder layers left in 16 bits (comma-separated; negative from the end)."),
        click.option("--keep-modules", callback=str_list, metavar="NAME,NAME",
                     help="Linear layers left in 16 bits in every decoder layer, e.g. down_proj ('' for none; "
                          "default: the recipe's, down_proj for nvfp4)."),
        click.option("--kv-cache-quant", type=click.Choice(["none", "fp8"]), help="KV-cache quantization."),
        click.option("--gpu", type=click.Choice(["b300", "b200", "h200", "h100", "cpu"]),
                     help="GPU the engine is for (cpu: the reference runtime)."),
        click.option("--gpus-per-node", type=click.IntRange(min=1), help="GPUs per node (default 8)."),
        click.option("--nodes", type=click.IntRange(min=1), help="Nodes available (default 1)."),
        click.option("--max-batch-size", type=click.IntRange(min=1), help="Largest batch the engine serves."),
        click.option("--max-seq-len", type=click.IntRange(min=2), help="Prompt + output tokens per request."),
        max_draft_len_option("K: the most draft tokens one step verifies (1..block_size-1), recorded in the "
                             "manifest and used by every runtime [default: the drafter's block_size - 1]."),
        click.option("--max-num-tokens", type=click.IntRange(min=1), help="Tokens per scheduler iteration."),
        click.option("--free-gpu-memory-fraction", type=click.FloatRange(0, 1, min_open=True),
                     help="Share of free HBM given to the KV cache (default 0.9)."),
        click.option("--draft-num-layers", type=click.IntRange(min=1),
                     help="Drafter depth `plan` assumes when no --draft is given (default 5)."),
        click.option("--draft-len-schedule", metavar="auto|off|B:K,...",
                     help="TensorRT-LLM's draft_len_schedule: auto (default: derived for --gpu from the step-cost model "
                          "and the acceptance profile), off, or batch-size:draft-length pairs such as 4:7,16:3 "
                          "(batches up to 4 draft 7, 5-16 draft 3, above 16 none)."),
        click.option("--acceptance-profile", metavar="P1,P2,...|tau:X",
                     help="Per-position acceptance the schedule is derived from: P(a>=1),P(a>=2),... or tau:X "
                          "(geometric) [default: the acceptance gate's measurement, else a stated default]."),
        click.option("--tensorrt-llm-release", metavar="VERSION",
                     help="The TensorRT-LLM release the engine is for (e.g. 1.4.0rc1): llm_api_options.yaml carries "
                          "only what it accepts and the fields that serve from it [default: the dflash-trt "
                          "container's, deploy/container/image.json]."),
        click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _spec_path(spec_file: str | None) -> str | None:
    if spec_file is None or Path(spec_file).exists():
        return spec_file
    from dflash_trt.resources import resource_dir

    try:
        recipe = resource_dir("build") / f"{spec_file}.yaml"
    except FileNotFoundError:
        return spec_file
    return str(recipe) if recipe.is_file() else spec_file


def _resolve(spec_file: str | None, flags: dict[str, Any]):
    from dflash_trt.engine.spec import resolve_spec

    overrides = {FLAG_TO_KEY[k]: v for k, v in flags.items() if k in FLAG_TO_KEY and v is not None}
    return resolve_spec(_spec_path(spec_file), overrides)


def _console():
    from rich.console import Console

    console = Console(stderr=True)
    # Logs and CI are not terminals: rich would wrap the plan table at 80 columns.
    return console if console.is_terminal else Console(stderr=True, width=120)


@click.command("plan")
@spec_options
@friendly_errors
def plan(spec_file: str | None, as_json: bool, **flags: Any) -> None:
    """Validate a build and print the memory plan per GPU, without loading weights.

    Works with no checkpoint on disk for the architectures shipped under build/archs/, e.g.
    `dflash-trt plan --target gpt-oss-120b --tp 8 --ep 8 --quant nvfp4 --gpu b300`.
    """
    from dflash_trt.engine.builder import prepare, print_spec, show_plan

    from dflash_trt.engine.recompute_tail import load_measurement
    from dflash_trt.engine.release_plan import release_rows, render_rows

    spec = _resolve(spec_file, flags)
    console = _console()
    p = prepare(spec, need_checkpoints=False)
    print_spec(spec, console)
    show_plan(p, console)
    rows = release_rows(p, load_measurement())
    render_rows(rows, console)
    if as_json:
        schedule = p.schedule.to_record() if p.schedule else None
        click.echo(json.dumps({"arch": p.arch.to_dict(), "plan": p.plan.to_dict(),
                               "max_draft_len": p.schedule.max_draft_len if p.schedule else p.max_draft_len,
                               "max_num_tokens": p.max_num_tokens, "speculation": schedule,
                               "tensorrt_llm_release": p.release, "by_release": [r.to_dict() for r in rows]}))
    if not p.plan.fits:
        raise SystemExit(3)


@click.command("build")
@spec_options
@click.option("--out", type=click.Path(file_okay=False), help="Engine directory to write (default engines/NAME).")
@click.option("--name", help="Engine name recorded in the manifest.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES),
              help="dtype of unquantized tensors (auto: the checkpoint's 16-bit one; float32 only for --gpu cpu).")
@click.option("--compute-dtype", type=click.Choice(DTYPE_CHOICES),
              help="dtype calibration and the gate run in; the engine is in --dtype either way (auto: --dtype where "
                   "the build device multiplies it natively, else float32, e.g. on a CPU without AVX512-BF16).")
@click.option("--calib-prompts", type=click.Path(dir_okay=False), help="Calibration prompts (.jsonl/.json/.txt).")
@click.option("--calib-size", type=click.IntRange(min=1), help="Number of calibration prompts (default 16).")
@click.option("--calib-max-length", type=click.IntRange(min=8), help="Tokens per calibration prompt (default 256).")
@click.option("--max-tau-drop", type=click.FloatRange(0, 1, max_open=True),
              help="Largest relative tau drop the acceptance gate allows (default 0.10).")
@click.option("--accept-tau-drop", is_flag=True, default=None, help="Keep the engine even if tau drops more.")
@click.option("--gate/--no-gate", default=None,
              help="Run the acceptance gate (default: on when quantizing; with --quant none it only checks that the "
                   "drafter fits the target).")
@click.option("--gate-prompts", type=click.IntRange(min=2),
              help="Prompts each look of the acceptance gate decodes (default 39: the eval split, then waves of the "
                   "gate split's 117 more held-out prompts).")
@click.option("--gate-tokens", type=click.IntRange(min=2), help="Tokens per gate prompt (default 96).")
@click.option("--gate-looks", type=click.IntRange(min=1), help="Planned looks of the gate's sequential test (default "
              "4): an undecided look is followed by another with a wave of new prompts.")
@click.option("--gate-budget", type=click.FloatRange(min=0, min_open=True), help="Seconds the gate may decode "
              f"(default {_GATE_BUDGET_S:g}): the gate plans the looks it pays for, and a look that would end past it "
              "is not started.")
@click.option("--min-tau", type=click.FloatRange(min=1.0),
              help="Refuse a pair whose unquantized tau is surely below this (default 1.2: a drafter that does not "
                   "fit the target).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]),
              help="Where calibration and the gate run: auto (every visible GPU, else the CPU), cpu, cuda.")
@click.option("--rejection-sampling/--no-rejection-sampling", default=None,
              help="TensorRT-LLM's use_rejection_sampling (a prototype upstream): sampled requests verified by "
                   "rejection sampling instead of exact match; vLLM's command samples its drafts "
                   "(draft_sample_method probabilistic). Off by default, written only when on.")
@click.option("--acceptance-rate-window", type=click.IntRange(min=1), metavar="N",
              help="With --acceptance-rate-threshold: TensorRT-LLM turns speculation off for good once the "
                   "acceptance rate over the last N speculating steps falls below the threshold.")
@click.option("--acceptance-rate-threshold", type=click.FloatRange(0, 1), metavar="X",
              help="The acceptance-rate floor (accepted / drafted, 0..1) for --acceptance-rate-window.")
@click.option("--dry-run", is_flag=True, help="Stop after validation and planning.")
@click.option("--force", is_flag=True, help="Replace an existing --out directory (atomically).")
@click.option("--profile", is_flag=True, help="Print the time and peak RSS of each build phase.")
@no_progress_option()
@friendly_errors
def build(spec_file: str | None, as_json: bool, dry_run: bool, force: bool, profile: bool, no_progress: bool,
          **flags: Any) -> None:
    """Build an engine directory: validate, plan, quantize (ModelOpt), gate on tau, write atomically.

    With no --target/--draft the embedded default pair is used. Flags override --spec keys.
    """
    from dflash_trt.engine.builder import build_engine, default_name, prepare, print_spec, show_plan
    from dflash_trt.engine.devices import resolve_device
    from dflash_trt.process import Profile, render_profile

    spec = _resolve(spec_file, flags)
    console = _console()
    prof = Profile()
    with prof.phase("validate_plan"):
        p = prepare(spec, need_checkpoints=True)
        device = resolve_device(spec.device)  # --device cuda without a GPU fails here, in a second
    print_spec(spec, console)
    show_plan(p, console)
    if not p.plan.fits:
        from dflash_trt.errors import DFlashError

        raise DFlashError(f"memory plan: {p.plan.verdict}")
    if dry_run:
        console.print("dry run: validation and planning passed; nothing written")
        if as_json:
            click.echo(json.dumps({"dry_run": True, "plan": p.plan.to_dict()}))
        return
    out = Path(spec.out) if spec.out else Path("engines") / default_name(p)
    console.print(f"build device: {device.describe()}")
    build_engine(p, out, overwrite=force, progress=not no_progress, console=console, profile=prof, device=device)
    console.print(f"[green]engine written:[/green] {out}")
    if profile:
        render_profile(prof, console)
    if as_json:
        from dflash_trt.engine.manifest import load_manifest

        m = load_manifest(out)
        click.echo(json.dumps({"engine": str(out), "acceptance": m.acceptance, "timings_s": m.timings_s,
                               "peak_rss_mib": max(prof.peak_rss_mib.values(), default=0.0),
                               "peak_gpu_mib": max(prof.peak_gpu_mib.values(), default=None)}))


@click.command("verify")
@click.argument("engine", type=click.Path())
@friendly_errors
def verify(engine: str) -> None:
    """Re-check an engine directory: manifest schema, sha256 of every file, LLM-API YAML keys."""
    from dflash_trt.engine.verify import verify_engine

    m = verify_engine(engine)
    click.echo(f"ok: {engine} ({m.name}): {len(m.files)} files match {len(m.files)} sha256 in the manifest")


COMMANDS = [build, plan, verify]
