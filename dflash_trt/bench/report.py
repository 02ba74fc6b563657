"""The terminal table (rich) and the same table as markdown (table.md, for READMEs)."""

from __future__ import annotations

from typing import Any

# the metrics vocabulary as headers; latencies shown in milliseconds
COLUMNS = ("C", "mode", "tau", "acceptance_rate", "ttft_s p50 (ms)", "tpot_s mean (ms)", "tpot_s p90 (ms)",
           "tokens_per_s per user", "total_tokens_per_s", "speedup")


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for row in result["sweep"]:
        for mode in ("dflash", "plain"):
            s = row.get(mode)
            if not s:
                continue
            is_d = mode == "dflash"
            out.append([
                str(row["concurrency"]), mode,
                f"{s['tau']:.2f}" if is_d else "1",
                f"{s['acceptance_rate']:.3f}" if is_d else "-",
                _ms(s["ttft_s"]["p50"]), _ms(s["tpot_s"]["mean"]), _ms(s["tpot_s"]["p90"]),
                f"{s['tokens_per_s']['mean']:.1f}", f"{s['total_tokens_per_s']:.1f}",
                f"{row['speedup']:.2f}x" if is_d and row["speedup"] is not None else "",
            ])
    return out


def ceiling_lines(result: dict[str, Any]) -> list[str]:
    c = result["ceiling"]
    lines = [f"Leviathan bound (free drafting, verify = one step): speedup <= tau = {c['tau_bound_speedup']:.2f}"]
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
    elif c.get("gpu") in (None, "cpu"):
        lines.append("no GPU bandwidth ceiling for this run (CPU or unknown GPU; pass --gpu for an endpoint's GPU)"
                     if c.get("target_params") or c.get("gpu") is None else "")
    ident = result.get("identical_to_plain")
    if ident:
        lines.append(f"DFlash output identical to plain greedy decoding on {ident['identical']}/{ident['checked']} requests")
    if not result["source"]["parallel"] and len(result["sweep"]) > 1:
        lines.append("the in-process runner decodes one request at a time: concurrent requests queue "
                     "(total tokens/s flat, per-user tokens/s ~ 1/C)")
    return [x for x in lines if x]


def print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    src = result["source"]
    title = (f"dflash-trt bench: {len(result['prompts'])} prompts, max_new_tokens={result['config']['max_new_tokens']}, "
             f"temperature={result['config']['temperature']}, {src['runner']}")
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows(result):
        table.add_row(*r)
    console.print(table)
    for line in ceiling_lines(result):
        console.print(f"  {line}", soft_wrap=True, highlight=False)


def markdown(result: dict[str, Any]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "|".join("---:" if c != "mode" else ":---" for c in COLUMNS) + "|\n"
    body = "".join("| " + " | ".join(r) + " |\n" for r in rows(result))
    return head + body + "\n" + "".join(f"- {line}\n" for line in ceiling_lines(result))
