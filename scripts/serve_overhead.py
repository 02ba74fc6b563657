"""What serving on tritonserver costs per request: the same prompts, in process and through
`dflash-trt serve` (Triton's gRPC, and the OpenAI front), TTFT and TPOT side by side.

Starts `dflash-trt serve ENGINE --decoupled --policy fixed --no-prefix-cache` (K drafts every
step, so every side decodes the same tokens in the same steps; no prefix cache, because every side
sends the same prompts and a warm cache would flatter whichever side runs later), then runs `dflash-trt bench` three times on the same
prompt ids and concurrency levels, rotating their order per level so that drift on a shared
machine lands on every side alike:

- in process: `--engine ENGINE --runtime batched --policy fixed --no-prefix-cache` (the runtime `serve` runs);
- Triton gRPC: `--url host:grpc_port` (tritonclient stream; the model applies the chat template);
- the OpenAI front: `--url http://host:openai_port` (SSE chat completions).

Prints TTFT and TPOT means per side and level and the server's extra cost (server - in process),
and the peak RSS of tritonserver plus its Python backend stub (VmHWM, summed).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/serve_overhead.py ENGINE --concurrency 1,4 --num-prompts 8
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from serve_child import serve_child  # scripts/, beside this file

CLI = [sys.executable, "-m", "dflash_trt.cli"]


def _bench(out: Path, args: list[str]) -> dict:
    subprocess.run(CLI + ["bench", *args, "--out", str(out), "--no-plots"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())


@click.command(help=__doc__)
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--concurrency", default="1,4", show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
def main(engine: str, concurrency: str, num_prompts: int, max_new_tokens: int) -> None:
    levels = [int(c) for c in concurrency.split(",")]
    common = ["--num-prompts", str(num_prompts), "--max-new-tokens", str(max_new_tokens)]
    with tempfile.TemporaryDirectory() as tmp, serve_child([engine, "--decoupled", "--policy", "fixed",
                                                            "--no-prefix-cache"]) as served:
        sides = {"in process": ["--engine", engine, "--runtime", "batched", "--policy", "fixed", "--no-prefix-cache"],
                 "Triton gRPC": ["--url", served.grpc], "OpenAI front": ["--url", served.openai_base]}
        rows: dict[tuple[str, int], dict] = {}
        for i, c in enumerate(levels):
            names = list(sides)
            for name in names[i % 3:] + names[: i % 3]:  # each level starts with another side
                report = _bench(Path(tmp) / f"{name}-{c}".replace(" ", "_"),
                                [*sides[name], *common, "--concurrency", str(c)])
                rows[(name, c)] = next(r for r in report["rows"] if r["mode"] == "dflash")
        peak = served.server_mib("VmHWM")
    print(f"{num_prompts} prompts x {max_new_tokens} tokens, policy fixed (K every step), engine {engine}")
    print("| side | C | TTFT mean (ms) | TPOT mean (ms) | tau | TTFT - in process (ms) | TPOT - in process (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        base = rows[("in process", c)]
        for name in sides:
            r = rows[(name, c)]
            ttft, tpot = r["ttft_s"]["mean"] * 1e3, r["tpot_s"]["mean"] * 1e3
            extra = "" if name == "in process" else (f"{ttft - base['ttft_s']['mean'] * 1e3:+.1f} | "
                                                     f"{tpot - base['tpot_s']['mean'] * 1e3:+.2f}")
            print(f"| {name} | {c} | {ttft:.1f} | {tpot:.2f} | {r['tau']:.3f} | {extra or '- | -'} |")
    print(f"peak RSS of the server processes (tritonserver, its Python backend stub), VmHWM summed: {peak:.0f} MiB")


if __name__ == "__main__":
    main()
