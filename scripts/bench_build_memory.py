"""Peak host RSS of `dflash-trt build`, per phase, against the checkpoint's size on disk.

Random Llama targets of ~60M, ~240M and ~830M parameters are saved as real checkpoints are (bf16
safetensors, untied lm_head) with a random drafter; each build runs in a FRESH process (peak RSS
is per process) with `--profile --json`, and the table prints the peak RSS after each phase and
two ratios to the checkpoint size (the goal is <= 1.5):

- (peak - imports) / checkpoint: imports = a process that imports torch, transformers and
  ModelOpt and loads nothing;
- (peak - fixed) / (checkpoint - tiny checkpoint): fixed = the peak of the SAME build of a ~4M
  parameter model (`--size 4M`, 8 MiB), i.e. what the build costs whatever the model: the imports
  plus what it loads lazily and keeps (oneDNN's JIT kernels, ModelOpt's export modules, the
  tokenizer, the drafter, a gate step's buffers). This is the ratio that tells what a larger model
  needs; on a 60M model the fixed part is as large as the model.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_build_memory.py
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_build_memory.py --size 60M --build fp8-h100

A random drafter never fits its target (tau is 1), so the gate runs with --min-tau 1.0 and a few
short prompts: it still loads what it loads in a real build (the exported target, dequantized in
the engine dtype), which is what memory is about.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

# name -> (hidden, layers, intermediate, heads, kv heads); vocab 32000, untied embeddings
SIZES = {
    "4M": (64, 2, 192, 2, 2),  # the fixed cost of a build: ~all of it is the 32000-token embeddings
    "60M": (512, 8, 1536, 8, 8),
    "240M": (1024, 15, 2816, 16, 8),
    "830M": (2048, 15, 5888, 32, 8),
}
# name -> build flags (a GPU engine built on this host, and the CPU recipe)
BUILDS = {
    "none-h100": ["--quant", "none", "--gpu", "h100"],
    "fp8-h100": ["--quant", "fp8", "--gpu", "h100"],
    "nvfp4-b200": ["--quant", "nvfp4", "--gpu", "b200"],
}
GATE = ["--gate-prompts", "2", "--gate-tokens", "8", "--min-tau", "1.0", "--calib-size", "4",
        "--calib-max-length", "64"]
BASELINE = ("import torch, transformers, modelopt.torch.quantization, modelopt.torch.export, accelerate; "
            "from dflash_trt.process import peak_rss_mib; print(peak_rss_mib())")


def make_pair(root: Path, size: str) -> tuple[Path, Path, int]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dflash_trt.runtime.tiny import random_draft

    hidden, layers, inter, heads, kv = SIZES[size]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    tdir, ddir = root / f"llama-{size}", root / f"draft-{size}"
    model.save_pretrained(tdir)
    random_draft(model.config, num_layers=1, block_size=8).save_pretrained(ddir)
    del model
    return tdir, ddir, n


def run_build(cli: list[str], tdir: Path, ddir: Path, out: Path, flags: list[str], extra: list[str]) -> dict:
    cmd = [*cli, "build", "--target", str(tdir), "--draft", str(ddir), "--out", str(out), "--max-seq-len", "512",
           "--no-progress", "--profile", "--json", *flags, *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"build failed ({shlex.join(cmd)}):\n{r.stderr[-2000:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "dflash_trt.json").read_text())
    return {"cmd": shlex.join(cmd), "wall_s": time.perf_counter() - t0, "timings_s": summary["timings_s"],
            "peak_rss_mib": summary["peak_rss_mib"], "profile": _profile_rows(r.stderr),
            "engine_target_bytes": sum(f.stat().st_size for f in (out / "target").glob("*.safetensors")),
            "manifest_timings": manifest.get("timings_s")}


def _profile_rows(stderr: str) -> dict[str, tuple[float, float]]:
    """phase -> (peak RSS so far, RSS at the end of the phase) in MiB, from the `--profile` table."""
    rows = {}
    for line in stderr.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) >= 4 and cells[0] and cells[0] not in ("phase", "total"):
            try:
                rows[cells[0]] = (float(cells[2]), float(cells[3]))
            except ValueError:
                continue
    return rows


@click.command(help=__doc__)
@click.option("--size", "sizes", multiple=True, type=click.Choice(list(SIZES)), default=tuple(SIZES),
              show_default=True, help="repeat for several (4M, the fixed cost, is always built first)")
@click.option("--build", "builds", multiple=True, type=click.Choice(list(BUILDS)), default=tuple(BUILDS),
              show_default=True, help="repeat for several")
@click.option("--cli", default=f"{sys.executable} -m dflash_trt.cli",
              help="the dflash-trt command to measure (another checkout's python -m dflash_trt.cli)")
@click.option("--extra", default=" ".join(GATE + ["--device", "cpu"]), show_default=True,
              help="flags added to every build (default: a short gate, --device cpu)")
@click.option("--workdir", type=click.Path(path_type=Path), help="keep the checkpoints here (default: a temporary directory)")
@click.option("--out", type=click.Path(path_type=Path), help="write every figure as JSON")
def main(**options: Any) -> None:
    args = SimpleNamespace(**options)
    cli, extra = shlex.split(args.cli), shlex.split(args.extra)
    python = cli[0] if cli[0].endswith(("python", "python3")) else sys.executable
    baseline = float(subprocess.run([python, "-c", BASELINE], capture_output=True, text=True, check=True).stdout)
    print(f"interpreter baseline (torch + transformers + ModelOpt imported): {baseline:.0f} MiB", flush=True)
    results: list[dict] = []
    fixed: dict[str, dict] = {}  # build -> the 4M row
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        engines = Path(tempfile.mkdtemp(prefix="engines-", dir=root))  # a kept --workdir may hold older ones
        for size in ["4M", *(s for s in args.sizes if s != "4M")]:
            tdir, ddir, n = make_pair(root, size)
            ckpt = sum(f.stat().st_size for f in tdir.glob("*.safetensors"))
            for build in args.builds:
                res = run_build(cli, tdir, ddir, engines / f"{size}-{build}", BUILDS[build], extra)
                row = {"size": size, "params": n, "checkpoint_bytes": ckpt, "build": build, "baseline_mib": baseline,
                       "ratio": (res["peak_rss_mib"] - baseline) * 2**20 / ckpt, **res}
                tiny = fixed.setdefault(build, row)
                if tiny is not row:
                    row["fixed_mib"] = tiny["peak_rss_mib"]
                    row["ratio_above_fixed"] = ((res["peak_rss_mib"] - tiny["peak_rss_mib"]) * 2**20
                                                / (ckpt - tiny["checkpoint_bytes"]))
                results.append(row)
                phases = "  ".join(f"{k} {pk:.0f}/{now:.0f}" for k, (pk, now) in res["profile"].items())
                above = f"  above the fixed cost: {row['ratio_above_fixed']:.2f}" if "fixed_mib" in row else ""
                print(f"{size:>5s} {n / 1e6:6.1f}M params  ckpt {ckpt / 2**20:6.0f} MiB  {build:11s} peak RSS "
                      f"{res['peak_rss_mib']:6.0f} MiB  (peak - imports) / ckpt = {row['ratio']:.2f}{above}  "
                      f"wall {res['wall_s']:.0f} s | after each phase, peak/current MiB: {phases}", flush=True)
    print()
    print("| params | checkpoint (MiB) | build | peak RSS (MiB) | (peak - imports) / checkpoint | "
          "(peak - fixed) / (checkpoint - 4M's) | wall (s) |")
    print("|---:|---:|:---|---:|---:|---:|---:|")
    for r in results:
        above = f"{r['ratio_above_fixed']:.2f}" if "fixed_mib" in r else "(the fixed cost)"
        print(f"| {r['params'] / 1e6:.0f}M | {r['checkpoint_bytes'] / 2**20:.0f} | {r['build']} | "
              f"{r['peak_rss_mib']:.0f} | {r['ratio']:.2f} | {above} | {r['wall_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
