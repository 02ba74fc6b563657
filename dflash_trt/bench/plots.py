"""PNG plots of a bench run (matplotlib, Agg backend: no display needed), one line per side and mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = {"throughput": "throughput.png", "tokens_per_s_by_concurrency": "tokens_per_s_by_concurrency.png",
         "tau_histogram": "tau_histogram.png", "per_position_acceptance": "per_position_acceptance.png"}
SIDE_COLORS = {"reference": "tab:green", "batched": "tab:blue", "vllm": "tab:red", "vllm-eager": "tab:orange",
               "endpoint": "tab:purple"}
MODE_STYLE = {"dflash": "o-", "plain": "s--"}


def _save(fig: Any, path: Path) -> None:
    """Write beside `path` and rename: a PNG at `path` is always complete."""
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def _series(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["side"], r["mode"]), []).append(r)
    return out


def write_plots(result: dict[str, Any], records: list[Any], out_dir: Path) -> dict[str, str]:
    """throughput.png (per-user vs total tokens/s across the sweep), tokens_per_s_by_concurrency.png,
    tau_histogram.png, per_position_acceptance.png (where steps were seen). Returns {plot: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, str] = {}
    rows = result["rows"]
    labels = {r["side"]: r["label"] for r in rows}
    series = _series(rows)

    # 1. Throughput vs per-user speed: where the curves part is where speculation stops paying.
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for (side, mode), rs in series.items():
        ax.plot([r["total_tokens_per_s"] for r in rs], [r["tokens_per_s"]["mean"] for r in rs], MODE_STYLE[mode],
                color=SIDE_COLORS.get(side, "tab:gray"), label=f"{labels[side]}, {mode}")
        for r in rs:
            ax.annotate(f"C={r['concurrency']}", (r["total_tokens_per_s"], r["tokens_per_s"]["mean"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("total_tokens_per_s (all users)")
    ax.set_ylabel("tokens_per_s per user (mean)")
    ax.set_title("Throughput vs per-user speed across concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out_dir / PLOTS["throughput"])
    plt.close(fig)
    written["throughput"] = PLOTS["throughput"]

    # 2. Total tokens/s by concurrency, one line per side and mode: the side-by-side figure.
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for (side, mode), rs in series.items():
        ax.plot([r["concurrency"] for r in rs], [r["total_tokens_per_s"] for r in rs], MODE_STYLE[mode],
                color=SIDE_COLORS.get(side, "tab:gray"), label=f"{labels[side]}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}), [str(c) for c in sorted({r["concurrency"] for r in rows})])
    ax.set_xlabel("concurrency C (users)")
    ax.set_ylabel("total_tokens_per_s")
    ax.set_title("Output tokens/s of all users")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out_dir / PLOTS["tokens_per_s_by_concurrency"])
    plt.close(fig)
    written["tokens_per_s_by_concurrency"] = PLOTS["tokens_per_s_by_concurrency"]

    # 3. tau per step at the lowest level, per side (at temperature 0 the other levels repeat the steps).
    level = min((r["concurrency"] for r in rows), default=1)
    dflash = [r for r in records if r.mode == "dflash" and r.concurrency == level and r.error is None]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    per_step = [s for s in dict.fromkeys(r.side for r in dflash)
                if all(r.acceptance_lengths is not None for r in dflash if r.side == s)]
    if per_step:
        top = max((a for r in dflash for a in r.acceptance_lengths or [1]), default=1)
        for side in per_step:
            values = [a for r in dflash if r.side == side for a in r.acceptance_lengths]
            ax.hist(values, bins=range(1, top + 2), align="left", histtype="step", linewidth=1.5,
                    color=SIDE_COLORS.get(side, "tab:gray"), label=labels.get(side, side))
        ax.set_xlabel("acceptance_length per step (tokens committed, bonus included)")
    else:
        ax.hist([r.tau for r in dflash] or [0.0], bins=20, color="tab:blue")
        ax.set_xlabel("tau per request")
    ax.set_ylabel("steps")
    ax.set_title(f"DFlash acceptance length at C={level}")
    if per_step:
        ax.legend(fontsize=7)
    _save(fig, out_dir / PLOTS["tau_histogram"])
    plt.close(fig)
    written["tau_histogram"] = PLOTS["tau_histogram"]

    # 4. Per-position acceptance: how deep into the block the drafter stays right, per side.
    ppa = [(r["side"], r["per_position_acceptance"]) for r in rows
           if r["mode"] == "dflash" and r["concurrency"] == level and r.get("per_position_acceptance")]
    if ppa:
        fig, ax = plt.subplots(figsize=(7, 4.6))
        width = 0.8 / len(ppa)
        for i, (side, values) in enumerate(ppa):
            ax.bar([j + 1 + (i - (len(ppa) - 1) / 2) * width for j in range(len(values))], values, width=width,
                   color=SIDE_COLORS.get(side, "tab:gray"), label=labels.get(side, side))
        ax.set_xlabel("draft slot (1 = first token after the anchor)")
        ax.set_ylabel("per_position_acceptance")
        ax.set_ylim(0, 1)
        ax.set_title(f"Acceptance by draft position at C={level}")
        ax.legend(fontsize=7)
        _save(fig, out_dir / PLOTS["per_position_acceptance"])
        plt.close(fig)
        written["per_position_acceptance"] = PLOTS["per_position_acceptance"]
    return written
