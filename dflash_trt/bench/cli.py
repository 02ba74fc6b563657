"""`dflash-trt bench`: DFlash vs plain decoding (tau, TTFT, TPOT, tokens/s, concurrency sweep)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_trt.cli_helpers import friendly_errors, max_draft_len_option, policy_option


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,2,4,8") from None


def _str_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    return None if value is None else [x.strip() for x in value.split(",") if x.strip()]


@click.command("bench")
@click.option("--engine", type=click.Path(file_okay=False), help="Engine directory from `dflash-trt build` (in process).")
@click.option("--target", type=click.Path(file_okay=False), help="Target HF checkpoint directory (with --draft).")
@click.option("--draft", type=click.Path(file_okay=False), help="DFlash drafter directory (with --target).")
@click.option("--url", help="Measure a Triton gRPC endpoint host:port (tritonserver or `dflash-trt serve`) instead.")
@click.option("--plain-url", help="Endpoint mode: a server of the same target WITHOUT speculation, for the baseline.")
@click.option("--model", help="Triton model name at --url [default: dflash].")
@click.option("--category", callback=_str_list, help="Project prompt sets, comma-separated [default: code,math,chat].")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line (instead of --category).')
@click.option("--split", type=click.Choice(["eval", "train"]), help="Split of the project sets [default: eval].")
@click.option("--num-prompts", type=int, help="Only the first N prompts (round-robin over categories).")
@click.option("--max-new-tokens", type=int, help="Tokens to generate per request [default: 128].")
@click.option("--temperature", type=float, help="Sampling temperature; 0 = greedy [default: 0].")
@click.option("--seed", type=int, help="Seed of the first request; request i uses seed + i [default: 0].")
@max_draft_len_option("In process: K, the most drafts a step verifies (1..block_size-1) [default: the engine's "
                      "limits.max_draft_len, else the drafter's block_size - 1]. A server has its own.")
@policy_option(None, "In process: fixed = the reference loop (K drafts every step) [default]; adaptive = the "
                     "batched runtime at one sequence, choosing k <= K per step as `serve` does.")
@click.option("--concurrency", callback=_int_list, help="Concurrency levels to sweep, e.g. 1,2,4,8 [default: 1].")
@click.option("--device", help="In process: cpu or cuda[:N] [default: cpu].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="In process weights [default: float32].")
@click.option("--gpu", help="GPU of the run for the bandwidth ceiling (b300, b200, h200, h100) [default: detected].")
@click.option("--threads", type=int, help="torch CPU threads in process [default: torch's].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds per endpoint request [default: 600].")
@click.option("--out", type=click.Path(file_okay=False), help="Write bench.json, table.md and PNG plots here.")
@click.option("--plots/--no-plots", default=None, help="Write PNG plots into --out [default: yes].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML file of these options (keys as in bench.json's config); flags override it.")
@friendly_errors
def bench(config_file: str | None, **flags) -> None:
    """Measure DFlash against plain decoding of the same target on the same prompts.

    Reports tau, acceptance_rate, per_position_acceptance, ttft_s, tpot_s, tokens_per_s (per user),
    total_tokens_per_s and speedup, for every --concurrency level, next to the physical ceiling.
    With no model arguments it runs the embedded default pair in process.
    """
    from rich.console import Console

    from dflash_trt.bench.config import resolve_config
    from dflash_trt.config import config_line

    cfg = resolve_config(config_file, flags)
    console = Console(stderr=True)
    console.print(config_line("bench", cfg), markup=False, highlight=False, soft_wrap=True)
    result, records = _run_with_progress(cfg, console)

    from dflash_trt.bench.report import markdown, print_table

    # a pipe or CI log gets rich's 80 columns by default, too narrow for the table
    stdout = Console()
    print_table(result, stdout if stdout.is_terminal else Console(width=160))
    if cfg.out:
        from dflash_trt.fsutil import write_json_atomic, write_text_atomic

        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        if cfg.plots:
            from dflash_trt.bench.plots import write_plots

            result["plots"] = write_plots(result, records, out)
        write_text_atomic(out / "table.md", markdown(result))
        write_json_atomic(out / "bench.json", result)  # last: its presence means the run completed
        console.print(f"[bench] wrote {out / 'bench.json'}", highlight=False)


def _run_with_progress(cfg, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dflash_trt.bench.run import run_bench

    with Progress(TextColumn("[bench] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("loading", total=None)

        def progress(kind, value):
            if kind == "total":
                bar.update(task, total=value, description="warm-up")
            else:
                bar.update(task, advance=1, description=f"{value.mode} C={value.concurrency} tau={value.tau:.2f}")

        return run_bench(cfg, progress)


COMMANDS = [bench]
