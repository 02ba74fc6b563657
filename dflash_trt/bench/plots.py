"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = {"throughput": "throughput.png", "tau_histogram": "tau_histogram.png",
         "per_position_acceptance": "per_position_acceptance.png"}
COLORS = {"dflash": "tab:blue", "plain": "tab:gray"}


def _save(fig: Any, path: Path) -> None:
    """Write beside `path` and rename: a PNG at `path` is always complete."""
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def write_plots(result: dict[str, Any], records: list[Any], out_dir: Path) -> dict[str, str]:
    """throughput.png (per-user vs total tokens/s across the sweep), tau_histogram.png,
    per_position_acceptance.png (in-process runs only). Returns {plot: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, str] = {}
    sweep = result["sweep"]

    # 1. Throughput vs per-user speed: where the two curves part is where speculation stops paying.
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode in ("dflash", "plain"):
        pts = [(row[mode]["total_tokens_per_s"], row[mode]["tokens_per_s"]["mean"], row["concurrency"])
               for row in sweep if row.get(mode)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[mode], label=mode)
        for x, y, c in pts:
            ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("total_tokens_per_s (all users)")
    ax.set_ylabel("tokens_per_s per user (mean)")
    ax.set_title("Throughput vs per-user speed across concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, out_dir / PLOTS["throughput"])
    plt.close(fig)
    written["throughput"] = PLOTS["throughput"]

    # 2. tau: per step where the runner saw the steps, else per request.
    # one concurrency level: at temperature 0 the others repeat the same steps
    level = sweep[0]["concurrency"] if sweep else 1
    dflash = [r for r in records if r.mode == "dflash" and r.concurrency == level]
    per_step = all(r.acceptance_lengths is not None for r in dflash)
    values = ([a for r in dflash for a in r.acceptance_lengths] if per_step else [r.tau for r in dflash])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    if per_step and values:
        ax.hist(values, bins=range(1, max(values) + 2), align="left", rwidth=0.85, color=COLORS["dflash"])
        ax.set_xlabel("acceptance_length per step (tokens committed, bonus included)")
    else:
        ax.hist(values or [0.0], bins=20, color=COLORS["dflash"])
        ax.set_xlabel("tau per request")
    mean_tau = sweep[0]["dflash"]["tau"] if sweep and sweep[0].get("dflash") else 0.0
    ax.axvline(mean_tau, color="black", ls="--", label=f"tau = {mean_tau:.2f}")
    ax.set_ylabel("count")
    ax.set_title("DFlash acceptance length")
    ax.legend()
    _save(fig, out_dir / PLOTS["tau_histogram"])
    plt.close(fig)
    written["tau_histogram"] = PLOTS["tau_histogram"]

    # 3. Per-position acceptance: how deep into the block the drafter stays right.
    ppa = sweep[0]["dflash"]["per_position_acceptance"] if sweep and sweep[0].get("dflash") else None
    if ppa:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        ax.bar(range(1, len(ppa) + 1), ppa, color=COLORS["dflash"])
        ax.set_xlabel("draft slot (1 = first token after the anchor)")
        ax.set_ylabel("per_position_acceptance")
        ax.set_ylim(0, 1)
        ax.set_title("Acceptance by draft position")
        _save(fig, out_dir / PLOTS["per_position_acceptance"])
        plt.close(fig)
        written["per_position_acceptance"] = PLOTS["per_position_acceptance"]
    return written
