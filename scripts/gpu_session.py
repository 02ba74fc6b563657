"""One GPU session's checks, in order, each a subprocess of the project's own CLI; one table at the end.

    python scripts/gpu_session.py --work /tmp/gs --out "$OUT"            # scripts/gpu_session.sh wraps it

1. tiny-builds, builds: the tiny gpt-oss of tests/gptoss_fixtures.py (MXFP4 experts as shipped) with
   --quant none, nvfp4, fp8, then the embedded pair's default fp8 (h100) and nvfp4 (b200) builds, all with
   --device cuda and the acceptance gate on; `verify` on each engine. Per build: exit, wall time,
   gate pass time (tau_before + tau_after phases), peak GPU memory, peak host RSS, tau before/after.
2. bench: the batched runtime, DFlash vs plain at C = 1, 8, 32, eager, CUDA graphs, and CUDA graphs
   over torch.compile'd target layers (--graphs eager,graphs,compiled), bfloat16 and float32: plain
   TPOT at C=1, DFlash/plain per C, outputs equal to the reference loop's, and where
   the first one departs (bench.json's `first_divergence`, when the runtime reports it).
3. drafter (--train-seconds > 0): the target's greedy answers to the train prompts on the GPU, then
   scripts/gpu_drafter.sh (sampled answers, `train-draft --device cuda --features online` from the
   embedded drafter); the drafter lands in --out/drafter (z-lab format, bf16) for `dflash-trt bench
   --tau-only` on any machine.

Every stage runs under a deadline (--budget-s from the start): a stage that would start after it is
skipped and says so, so whatever ran still reaches the table and --out. --device cpu runs the same flow
slowly (a dry run of the script; tiny sizes with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "dflash_trt.cli"]
T0 = time.monotonic()
ERRORS: dict[str, str] = {}  # a failed call's last stderr line, by call name


def log(msg: str) -> None:
    print(f"[gpu-session {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def run(name: str, argv: list[str], logs: Path, timeout: float,
        env: dict[str, str] | None = None) -> tuple[int, float, str]:
    """(exit code, wall seconds, stdout) of one CLI call; stderr and stdout go to logs/NAME.log, a failure's
    last stderr line to ERRORS[name]."""
    t = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1.0),
                           env={**os.environ, **(env or {})})
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = ((e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n[timed out]"
    wall = time.monotonic() - t
    (logs / f"{name}.log").write_text(f"$ {' '.join(argv)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    if rc != 0:
        ERRORS[name] = (err.strip().splitlines() or [""])[-1][:300]
    log(f"{name}: rc={rc} {wall:.1f}s" + ("" if rc == 0 else f"  last: {ERRORS[name]}"))
    return rc, wall, out


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return {}


class Session:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = T0 + args.budget_s
        self.results: dict[str, Any] = {"builds": [], "bench": [], "drafter": None, "skipped": [],
                                        "device": args.device, "commit": _git("rev-parse", "HEAD"),
                                        "dirty": bool(_git("status", "--porcelain"))}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, stage: str, need_s: float) -> bool:
        if self.left() < need_s:
            self.results["skipped"].append(f"{stage} (needs ~{need_s:.0f}s, {self.left():.0f}s left)")
            log(f"skip {stage}: ~{need_s:.0f}s needed, {self.left():.0f}s left")
            return False
        return True

    # -- 1. builds ---------------------------------------------------------------------------------
    def builds(self, stage: str, pair: tuple[Path, Path] | None) -> None:
        """stage "tiny-builds": the tiny gpt-oss (no embedded target needed); "builds": the embedded pair's."""
        a = self.args
        if stage == "tiny-builds":
            tiny_t, tiny_d = self.tiny_gptoss()
            tiny = ["--target", str(tiny_t), "--draft", str(tiny_d), "--max-seq-len", "256", "--calib-size", "4",
                    "--calib-max-length", "32", "--gate-prompts", "3", "--gate-tokens", "8", "--min-tau", "1.0"]
            plan = [("gptoss-none", tiny + ["--quant", "none", "--gpu", "b200"]),
                    ("gptoss-nvfp4", tiny + ["--quant", "nvfp4", "--gpu", "b200"]),
                    ("gptoss-fp8", tiny + ["--quant", "fp8", "--gpu", "h100"])]
            need = 20.0
        else:
            assert pair is not None
            embedded = ["--target", str(pair[0]), "--draft", str(pair[1])]
            if a.quick:  # a dry run: a small gate sample instead of the default 39 x 96
                embedded += ["--gate-prompts", "3", "--gate-tokens", "16", "--calib-size", "4", "--accept-tau-drop"]
            plan = [("embedded-fp8", embedded + ["--quant", "fp8", "--gpu", "h100"]),
                    ("embedded-nvfp4", embedded + ["--quant", "nvfp4", "--gpu", "b200"])]
            need = a.build_need_s
        for name, flags in plan:
            if not self.fits(f"build {name}", need):
                continue
            engine = self.work / "engines" / name
            rc, wall, out = run(f"build-{name}", [*PY, "build", *flags, "--device", a.device, "--out", str(engine),
                                                  "--force", "--no-progress", "--json", "--profile"],
                                self.logs, min(self.left(), a.build_timeout_s))
            summary = last_json(out)
            vrc = run(f"verify-{name}", [*PY, "verify", str(engine)], self.logs, 120)[0] if rc == 0 else None
            self.results["builds"].append(build_row(name, rc, wall, vrc, summary))

    def tiny_gptoss(self) -> tuple[Path, Path]:
        sys.path.insert(0, str(ROOT))
        from tests.gptoss_fixtures import save_tiny_mxfp4_gpt_oss

        return save_tiny_mxfp4_gpt_oss(self.work / "gptoss")

    # -- 2. bench ----------------------------------------------------------------------------------
    def bench(self, target: Path, draft: Path) -> None:
        a = self.args
        for dtype in a.dtypes.split(","):
            for graphs in a.graphs.split(","):
                name = f"bench-{dtype}-{graphs}"
                if not self.fits(name, a.bench_need_s):
                    continue
                out_dir = self.work / name
                # "compiled": CUDA graphs over the target's torch.compile'd layers (runtime/gpu/compiled_layers.py)
                flag = {"graphs": ["--cuda-graphs"], "compiled": ["--cuda-graphs", "--torch-compile"]}.get(
                    graphs, ["--no-cuda-graphs"])
                rc, wall, _ = run(name, [*PY, "bench", "--runtime", "batched", "--device", a.device, "--dtype", dtype,
                                         *flag, "--target", str(target), "--draft", str(draft),
                                         "--num-prompts", str(a.bench_prompts), "--max-new-tokens", str(a.bench_tokens),
                                         "--concurrency", a.concurrency, "--no-progress", "--no-plots",
                                         "--out", str(out_dir)],
                                  self.logs, min(self.left(), a.bench_timeout_s))
                row = {"name": name, "dtype": dtype, "graphs": graphs, "exit": rc, "wall_s": round(wall, 1)}
                bench_json = out_dir / "bench.json"
                if bench_json.is_file():
                    row.update(bench_row(json.loads(bench_json.read_text())))
                    (self.out / f"{name}.json").write_text(bench_json.read_text())
                self.results["bench"].append(row)

    # -- 3. drafter leg ----------------------------------------------------------------------------
    def drafter(self, target: Path, draft: Path) -> None:
        """The target's greedy answers (train-draft's responses.pt), then scripts/gpu_drafter.sh: sampled
        answers and online-feature training from the embedded drafter."""
        a = self.args
        if a.train_seconds <= 0 or not self.fits("drafter leg", a.train_seconds + a.answer_seconds + 60):
            return
        greedy = self.work / "greedy"
        greedy.mkdir(parents=True, exist_ok=True)
        half = a.answer_seconds / 2
        rc_g = run("answers-greedy", [*PY, "train-data", str(target), str(greedy / "responses.pt"), "--device",
                                      a.device, "--dtype", "bfloat16", "--batch-prompts", str(a.answer_batch), "--time-limit",
                                      str(half), "--no-progress"], self.logs, half + 120)[0]
        leg = self.work / "drafter-leg"
        budget = max(30.0, min(a.train_seconds, self.left() - half - 45))
        env = {"PY": sys.executable, "TARGET": str(target), "GREEDY_DIR": str(greedy), "WORK": str(leg),
               "DEVICE": a.device, "DTYPE": "bfloat16", "SAMPLES": "4", "BATCH_PROMPTS": str(max(1, a.answer_batch // 4)),
               "GEN_SECONDS": str(half), "TRAIN_SECONDS": str(int(budget)), "INIT_FROM": str(draft)}
        rc, wall, stdout = run("gpu-drafter", ["bash", "scripts/gpu_drafter.sh"], self.logs, half + budget + 240, env)
        if (leg / "A" / "model.safetensors").is_file():
            shutil.copytree(leg / "A", self.out / "drafter", dirs_exist_ok=True)
        self.results["drafter"] = {"answers_greedy_exit": rc_g, "gpu_drafter_exit": rc, "wall_s": round(wall, 1),
                                   "summary": stdout.strip().splitlines()[-2:]}

    def finish(self) -> None:
        self.results["wall_s"] = round(time.monotonic() - T0, 1)
        self.results["errors"] = ERRORS
        self.results["peak_rss_children_mib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
        (self.out / "gpu_session.json").write_text(json.dumps(self.results, indent=1))
        table = render(self.results)
        (self.out / "gpu_session.md").write_text(table)
        print(table, flush=True)


def build_row(name: str, rc: int, wall: float, verify_rc: int | None, s: dict[str, Any]) -> dict[str, Any]:
    t = s.get("timings_s") or {}
    acc = s.get("acceptance") or {}
    gate = sum(v for k, v in t.items() if k.startswith("tau_"))
    return {"build": name, "exit": rc, "verify": verify_rc, "wall_s": round(wall, 1),
            "gate_pass_s": [t[k] for k in ("tau_before", "tau_after") if k in t], "gate_s": round(gate, 1) if t else None,
            "peak_gpu_mib": s.get("peak_gpu_mib"), "peak_rss_mib": s.get("peak_rss_mib"),
            "tau_before": _tau(acc.get("before")), "tau_after": _tau(acc.get("after")),
            "decision": acc.get("decision") or acc.get("verdict")}


def _tau(side: Any) -> float | None:
    return round(side["tau"], 3) if isinstance(side, dict) and isinstance(side.get("tau"), (int, float)) else None


def bench_row(b: dict[str, Any]) -> dict[str, Any]:
    """Plain TPOT per C, DFlash/plain per C, tau per C, identical rows per mode and C (bench.json rows)."""
    out: dict[str, Any] = {"ratio": {}, "identical": {}, "tau": {}, "plain_tpot_ms": {}}
    by = {(r["mode"], r["concurrency"]): r for r in b.get("rows", []) if r.get("side") == "batched"}
    for (mode, c), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tpot = (r.get("tpot_s") or {}).get("mean")
        ident = r.get("identical") or {}
        if ident:
            out["identical"][f"{mode}@{c}"] = f"{ident.get('identical')}/{ident.get('checked')}"
        if mode == "plain" and tpot:
            out["plain_tpot_ms"][str(c)] = round(tpot * 1e3, 2)
        if mode == "dflash":
            out["tau"][str(c)] = round(r.get("tau") or 0.0, 2)
            plain_tpot = ((by.get(("plain", c)) or {}).get("tpot_s") or {}).get("mean")
            if plain_tpot and tpot:
                out["ratio"][str(c)] = round(plain_tpot / tpot, 2)
    out["identical_all"] = b.get("identical_all")
    for key in ("first_divergence", "divergence", "graphs"):  # reported by newer runtimes
        if key in b:
            out[key] = b[key]
    return out


def render(res: dict[str, Any]) -> str:
    lines = [f"# GPU session: commit {res['commit'][:12]}{' (+ uncommitted)' if res['dirty'] else ''}, device {res['device']}",
             "", "| build | exit | verify | wall (s) | gate pass (s) | peak GPU (MiB) | peak host RSS (MiB) | tau before | tau after |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for b in res["builds"]:
        lines.append(f"| {b['build']} | {b['exit']} | {_f(b['verify'])} | {b['wall_s']} | "
                     f"{' / '.join(f'{x:.1f}' for x in b['gate_pass_s']) or '-'} | {_f(b['peak_gpu_mib'], 0)} | "
                     f"{_f(b['peak_rss_mib'], 0)} | {_f(b['tau_before'])} | {_f(b['tau_after'])} |")
    if res["bench"]:
        lines += ["", "| bench | exit | plain TPOT C=1 (ms) | DFlash/plain by C | tau by C | identical | wall (s) |",
                  "|---|---:|---:|---|---|---|---:|"]
        for r in res["bench"]:
            ratio = ", ".join(f"C={c}: {v:.2f}x" for c, v in r.get("ratio", {}).items()) or "-"
            tau = ", ".join(f"{v:.2f}" for v in r.get("tau", {}).values()) or "-"
            ident = ", ".join(f"{k} {v}" for k, v in r.get("identical", {}).items()) or "-"
            lines.append(f"| {r['name']} | {r['exit']} | {_f((r.get('plain_tpot_ms') or {}).get('1'))} | {ratio} | {tau} | "
                         f"{ident} | {r['wall_s']} |")
    if res["drafter"]:
        lines += ["", f"drafter leg: {json.dumps(res['drafter'])}"]
    for name, err in res.get("errors", {}).items():
        lines.append(f"- {name} failed: {err}")
    if res["skipped"]:
        lines += ["", "skipped: " + "; ".join(res["skipped"])]
    lines += ["", f"session wall {res['wall_s']} s"]
    return "\n".join(lines) + "\n"


def _f(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/gpu-session", help="scratch directory (engines, answers)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-session-out"), help="what to bring back: table, JSON, logs, drafter")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stages", default="tiny-builds,builds,bench,drafter",
                    help="comma-separated: tiny-builds (needs no embedded target), builds, bench, drafter")
    ap.add_argument("--budget-s", type=float, default=470, help="no stage starts after this many seconds")
    ap.add_argument("--build-need-s", type=float, default=45, help="time an embedded build is expected to need")
    ap.add_argument("--build-timeout-s", type=float, default=150)
    ap.add_argument("--bench-need-s", type=float, default=30)
    ap.add_argument("--bench-timeout-s", type=float, default=120)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--graphs", default="eager,graphs",
                    help="bench settings: eager, graphs (CUDA graphs), compiled (graphs + --torch-compile)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--bench-prompts", type=int, default=8)
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--train-seconds", type=float, default=0, help="drafter leg's training time (0: no drafter leg)")
    ap.add_argument("--answer-seconds", type=float, default=80, help="drafter leg: seconds of answer generation")
    ap.add_argument("--answer-batch", type=int, default=256, help="drafter leg: rows decoded together")
    ap.add_argument("--quick", action="store_true", help="small gate samples (a dry run on a CPU)")
    args = ap.parse_args()
    s = Session(args)
    stages = args.stages.split(",")
    unknown = set(stages) - {"tiny-builds", "builds", "bench", "drafter"}
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}")
    pair = None
    try:
        if "tiny-builds" in stages:
            s.builds("tiny-builds", None)
        if set(stages) & {"builds", "bench", "drafter"}:  # the embedded pair
            rc, _, out = run("setup-default", [*PY, "setup-default"], s.logs, 300)
            found = {k: line.split(":", 1)[1].split(" (")[0].strip() for line in out.splitlines()
                     for k in ("target", "draft") if line.startswith(k + ":")}
            if rc != 0 or len(found) != 2:
                log("setup-default failed: see logs/setup-default.log")
                return 2
            pair = (Path(found["target"]), Path(found["draft"]))
        if "builds" in stages:
            s.builds("builds", pair)
        if "bench" in stages:
            s.bench(*pair)
        if "drafter" in stages:
            s.drafter(*pair)
    finally:
        s.finish()
    return 0

if __name__ == "__main__":
    sys.exit(main())
