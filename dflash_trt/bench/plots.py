"""PNG plots of a bench run (matplotlib, Agg backend: no display needed), one line per side and mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = {"throughput": "throughput.png", "tokens_per_s_by_concurrency": "tokens_per_s_by_concurrency.png",
         "tau_histogram": "tau_histogram.png", "per_position_acceptance": "per_position_acceptance.png",
         "frontier": "frontier.png"}
SIDE_COLORS = {"reference": "tab:green", "batched": "tab:blue", "vllm": "tab:red", "vllm-eager": "tab:orange",
               "endpoint": "tab:purple"}
# several policies side by side: sides "batched <policy>" (bench/run.py), one colour per policy kind
POLICY_COLORS = {"fixed": "tab:cyan", "schedule": "tab:olive", "adaptive": "tab:purple"}


def side_color(side: str) -> str:
    """A side's colour in every chart; a policy's side ("batched fixed:3") by its policy kind."""
    if side.startswith("batched "):
        return POLICY_COLORS.get(side.removeprefix("batched ").split(":")[0], "tab:gray")
    return SIDE_COLORS.get(side, "tab:gray")


MODE_STYLE = {"dflash": "o-", "plain": "s--"}
MODE_MARKER = {"dflash": "o", "plain": "s"}


def _save(fig: Any, path: Path) -> None:
    """Written through fsutil.atomic_file: a PNG at `path` is always complete."""
    from dflash_trt.fsutil import atomic_file

    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def _finish(fig: Any, ax: Any, out_dir: Path, name: str, written: dict[str, str], title: str, xlabel: str,
            ylabel: str, *, legend: bool = True, grid: bool = False) -> None:
    """Label, save atomically, close, and record plot `name` in `written`."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
    _save(fig, out_dir / PLOTS[name])
    plt.close(fig)
    written[name] = PLOTS[name]


def _series(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["side"], r["mode"]), []).append(r)
    return out


def write_plots(result: dict[str, Any], records: list[Any], out_dir: Path) -> dict[str, str]:
    """throughput.png (per-user vs total tokens/s across the sweep), tokens_per_s_by_concurrency.png,
    tau_histogram.png, per_position_acceptance.png (where steps were seen), frontier.png (the
    interactivity / throughput Pareto chart, bench/frontier.py). Returns {plot: file name}."""
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
                color=side_color(side), label=f"{labels[side]}, {mode}")
        for r in rs:
            ax.annotate(f"C={r['concurrency']}", (r["total_tokens_per_s"], r["tokens_per_s"]["mean"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    _finish(fig, ax, out_dir, "throughput", written, "Throughput vs per-user speed across concurrency",
            "total_tokens_per_s (all users)", "tokens_per_s per user (mean)", grid=True)

    # 2. Total tokens/s by concurrency, one line per side and mode: the side-by-side figure.
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for (side, mode), rs in series.items():
        ax.plot([r["concurrency"] for r in rs], [r["total_tokens_per_s"] for r in rs], MODE_STYLE[mode],
                color=side_color(side), label=f"{labels[side]}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}), [str(c) for c in sorted({r["concurrency"] for r in rows})])
    _finish(fig, ax, out_dir, "tokens_per_s_by_concurrency", written, "Output tokens/s of all users",
            "concurrency C (users)", "total_tokens_per_s", grid=True)

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
                    color=side_color(side), label=labels.get(side, side))
        xlabel = "acceptance_length per step (tokens committed, bonus included)"
    else:
        ax.hist([r.tau for r in dflash] or [0.0], bins=20, color="tab:blue")
        xlabel = "tau per request"
    _finish(fig, ax, out_dir, "tau_histogram", written, f"DFlash acceptance length at C={level}", xlabel, "steps",
            legend=bool(per_step))

    # 4. Per-position acceptance: how deep into the block the drafter stays right, per side.
    ppa = [(r["side"], r["per_position_acceptance"]) for r in rows
           if r["mode"] == "dflash" and r["concurrency"] == level and r.get("per_position_acceptance")]
    if ppa:
        fig, ax = plt.subplots(figsize=(7, 4.6))
        width = 0.8 / len(ppa)
        for i, (side, values) in enumerate(ppa):
            ax.bar([j + 1 + (i - (len(ppa) - 1) / 2) * width for j in range(len(values))], values, width=width,
                   color=side_color(side), label=labels.get(side, side))
        ax.set_ylim(0, 1)
        _finish(fig, ax, out_dir, "per_position_acceptance", written, f"Acceptance by draft position at C={level}",
                "draft slot (1 = first token after the anchor)", "per_position_acceptance")
    if result.get("frontier") and result["frontier"]["series"]:
        _frontier_plot(result["frontier"], out_dir, written)
    return written


def _frontier_plot(front: dict[str, Any], out_dir: Path, written: dict[str, str]) -> None:
    """Every measured point of every side and mode on one chart, each series' Pareto front drawn
    through its points, and a dashed line at each asked interactivity."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for s in front["series"]:
        color = side_color(s["side"])
        pts = s["points"]
        ax.scatter([p["interactivity"] for p in pts], [p["throughput"] for p in pts], marker=MODE_MARKER[s["mode"]],
                   color=color, alpha=0.5)
        for p in pts:
            ax.annotate(f"C={p['concurrency']}", (p["interactivity"], p["throughput"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        front_pts = sorted((p for p in pts if p["pareto"]), key=lambda p: p["interactivity"])
        ax.plot([p["interactivity"] for p in front_pts], [p["throughput"] for p in front_pts], MODE_STYLE[s["mode"]],
                color=color, label=f"{s['label']}, {s['mode']} (Pareto front)")
    for e in {e["interactivity"] for e in front["at"]}:
        ax.axvline(e, color="black", linestyle=":", linewidth=1)
    per = front["per"]
    _finish(fig, ax, out_dir, "frontier", written, "Throughput vs interactivity: each mode's Pareto front",
            "interactivity: tokens/s per user (1 / mean TPOT)", f"output tokens/s {per} (all users)", grid=True)
