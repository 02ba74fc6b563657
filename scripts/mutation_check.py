"""The guards' mutation check: every mutant in tests/mutants.toml must fail its guard's tests.

A guard proves itself on the smallest change that breaks its claim (docs: the project's test
rules). The mutants are kept as data so that they keep proving it: for each one this script

1. finds its `original` text in its `file` of this tree, exactly once (missing or ambiguous: the
   code moved, the entry must follow it; an entry is never retired silently);
2. writes the mutant into a scratch copy of the tree (tracked and untracked files as they are on
   disk, uncommitted edits included; this tree is never touched) and runs its `tests` there with
   pytest, in a forked child of this process (torch and transformers imported once, before the
   forks: they were most of a small guard's run) that imports the copy's `dflash_trt`;
3. counts it KILLED when a test fails, SURVIVED when they pass (the guard does not catch what it
   claims), and an ERROR when they cannot say (a collection error, a node id that names no test,
   a hang past --timeout); SKIPPED when every test skipped here (say, no C++ compiler): its guard
   went unchecked, which fails the check, naming it, unless --allow-skipped accepts it.

Beside the mutants, a baseline runs every mutant's tests on an unmutated copy: a guard failing on
the tree itself would "kill" its mutants for nothing. Exit status 1 when any mutant survived, any
entry is an error, any mutant's tests all skipped (without --allow-skipped), or the baseline
fails. The table's seconds are per mutant, on a shared machine noisy.

    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py              # all (make mutants)
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py -k host-read  # names containing it
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py --list
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py --data my_mutants.toml  # another file
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py --allow-skipped  # no compiler here: say so, pass
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "mutants.toml"
FIELDS = ("file", "original", "mutant", "tests", "why")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutant: str
    tests: tuple[str, ...]
    why: str


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # KILLED, SURVIVED, SKIPPED, ERROR
    detail: str  # the test that failed, or what went wrong
    seconds: float = 0.0


def load_mutants(path: Path = DATA) -> list[Mutant]:
    """The entries of the data file, each checked for its five fields."""
    with path.open("rb") as f:
        doc = tomllib.load(f)
    mutants = []
    for name, entry in doc.items():
        entry = entry if isinstance(entry, dict) else {}
        missing = [k for k in FIELDS if k not in entry]
        extra = sorted(set(entry) - set(FIELDS))
        if missing or extra:
            raise SystemExit(f"{path.name} [{name}]: fields {list(FIELDS)} (missing {missing}, unknown {extra})")
        tests = (entry["tests"],) if isinstance(entry["tests"], str) else tuple(entry["tests"])
        mutants.append(Mutant(name, entry["file"], entry["original"], entry["mutant"], tests, entry["why"]))
    return mutants


def locate(m: Mutant, root: Path = ROOT) -> str | None:
    """None when the mutant applies to this tree (its original found exactly once), else why not."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    count = path.read_text().count(m.original)
    if count != 1:
        return (f"its original text is {'not in' if count == 0 else f'{count} times in'} {m.file}: the code moved; "
                "update the entry's original (and mutant) to the code's new form")
    if m.original == m.mutant:
        return "its mutant is its original"
    return None


def tree_files(root: Path = ROOT) -> list[str]:
    """Tracked and untracked (not ignored) files of the tree, as they are on disk."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file() and not (root / f).is_symlink()]


def scratch_copy(dest: Path, files: list[str], root: Path = ROOT) -> Path:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    return dest


# Imported once here, before any fork, with pytest's plugins (hypothesis' alone is 2.4 s): each
# mutant's pytest starts in a forked child that has them already (seconds a mutant, most of a small
# guard's run). Never dflash_trt: every child imports it from its own scratch copy.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "safetensors.torch", "pydantic", "click",
           "numpy", "yaml", "pytest", "_pytest.assertion.rewrite")


def preload() -> None:
    import importlib
    from importlib.metadata import entry_points

    for name in (*PRELOAD, *(ep.module for ep in entry_points(group="pytest11"))):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if any(m == "dflash_trt" or m.startswith("dflash_trt.") for m in sys.modules):
        raise SystemExit("mutation check: dflash_trt was imported before the forks; the mutants would not be seen")


@dataclass
class Job:
    """One pytest run in a scratch copy: a mutant's (mutant set) or the baseline's (None)."""

    mutant: Mutant | None
    tests: tuple[str, ...]
    timeout: float


@dataclass
class Running:
    job: Job
    copy: Path
    log: Path
    started: float
    restore: str | None  # the mutated file's original text
    timed_out: bool = False


def _child(copy: Path, job: Job, log: Path) -> None:
    """In the forked child: pytest over the job's tests, the copy's dflash_trt first; never returns."""
    status = 3
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills the tests' subprocesses too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(copy)
        os.environ.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        sys.dont_write_bytecode = True
        this_tree = {ROOT, ROOT / "scripts"}  # PYTHONPATH=$PWD and this script's folder: the copy's instead
        sys.path[:] = [str(copy)] + [p for p in sys.path if p and Path(p).resolve() not in this_tree]
        import dflash_trt

        if not Path(dflash_trt.__file__).resolve().is_relative_to(copy.resolve()):
            print(f"the scratch copy imports dflash_trt from {dflash_trt.__file__}, not from {copy}")
        else:
            import pytest

            args = ["-q", "-rfEs", "-p", "no:cacheprovider", *(["-x"] if job.mutant is not None else []), *job.tests]
            status = int(pytest.main(args))
    except BaseException as e:  # noqa: BLE001 -- a child must exit, whatever happened
        print(f"mutation check child: {type(e).__name__}: {e}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_jobs(jobs: list[Job], copies: list[Path], logs: Path, on_done) -> None:
    """Run `jobs` in forked children, one per free copy; `on_done(job, status, output, seconds)` as
    each ends (status None: killed past its timeout)."""
    pending, free = list(jobs), list(copies)
    running: dict[int, Running] = {}
    try:
        _schedule(pending, free, running, logs, on_done)
    finally:  # interrupted: no child outlives the check
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)


def _schedule(pending: list[Job], free: list[Path], running: dict[int, Running], logs: Path, on_done) -> None:
    while pending or running:
        while pending and free:
            job, copy = pending.pop(0), free.pop()
            restore = None
            if job.mutant is not None:
                path = copy / job.mutant.file
                restore = path.read_text()
                path.write_text(restore.replace(job.mutant.original, job.mutant.mutant, 1))
            log = logs / f"{len(running)}-{os.getpid()}-{time.monotonic_ns()}.log"
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(copy, job, log)
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)  # as the child does: whichever runs first
            running[pid] = Running(job, copy, log, time.perf_counter(), restore)
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, r in running.items():
                if time.perf_counter() - r.started > r.job.timeout:
                    r.timed_out = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child, signal.SIGKILL)
            time.sleep(0.1)
            continue
        r = running.pop(pid)
        seconds = time.perf_counter() - r.started
        code = os.waitstatus_to_exitcode(wait_status)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # anything the tests left running
        if r.restore is not None:
            (r.copy / r.job.mutant.file).write_text(r.restore)
        output = r.log.read_text(errors="replace") if r.log.exists() else ""
        on_done(r.job, None if r.timed_out else code, output, seconds)
        free.append(r.copy)


def _first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - (.*))?$", output, re.M)
    if not found:
        return "a test failed"
    return found.group(1) + (f" ({found.group(2)[:100]})" if found.group(2) else "")


def judge(m: Mutant, status: int | None, output: str, seconds: float) -> Outcome:
    if status is None:
        return Outcome(m, "ERROR", "its tests ran past --timeout (make the guard fail fast on this mutant)", seconds)
    if status == 1:
        return Outcome(m, "KILLED", _first_failure(output), seconds)
    if status == 0:
        passed = re.search(r"(\d+) passed", output)
        if passed is None and re.search(r"(\d+) skipped", output):
            reasons = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", output, re.M)
            return Outcome(m, "SKIPPED", f"every test skipped here ({reasons[0] if reasons else 'no reason'})", seconds)
        return Outcome(m, "SURVIVED", f"{', '.join(m.tests)} pass with it: {m.why}", seconds)
    tail = " | ".join(output.strip().splitlines()[-3:])
    return Outcome(m, "ERROR", f"pytest exit status {status} (not a test failure): {tail[-300:]}", seconds)


def failures(outcomes: list[Outcome], allow_skipped: bool = False) -> list[Outcome]:
    """The outcomes that fail the check: a survivor, an error, and a mutant whose tests all skipped
    here (its guard unchecked on this machine) unless that is allowed."""
    bad = ("SURVIVED", "ERROR") if allow_skipped else ("SURVIVED", "ERROR", "SKIPPED")
    return [o for o in outcomes if o.verdict in bad]


def table(outcomes: list[Outcome]) -> str:
    rows = ["| mutant | file | verdict | killed by | s |", "|---|---|---|---|---:|"]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|")  # a markdown cell
        rows.append(f"| {o.mutant.name} | {o.mutant.file} | {o.verdict} | {detail} | {o.seconds:.1f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="select", action="append", default=[], help="only mutants whose name contains this")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutants run side by side, one scratch copy each [2]")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one mutant's tests may take [300]")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of every guard on the unmutated tree")
    ap.add_argument("--list", action="store_true", help="print the mutants and where they apply, run nothing")
    ap.add_argument("--data", type=Path, default=DATA, help="the mutants' file [tests/mutants.toml]")
    ap.add_argument("--allow-skipped", action="store_true",
                    help="pass although some mutants' tests all skip here (no compiler, no panel kernel): "
                         "their guards go unchecked on this machine, and are named")
    args = ap.parse_args()

    mutants = [m for m in load_mutants(args.data) if not args.select or any(s in m.name for s in args.select)]
    if not mutants:
        print(f"mutation check: no mutant in {args.data} matches {args.select}", file=sys.stderr)
        return 1
    misplaced = [Outcome(m, "ERROR", why) for m in mutants if (why := locate(m)) is not None]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.file} -> {', '.join(m.tests)}  [{locate(m) or 'applies'}]")
        return 0
    runnable = [m for m in mutants if locate(m) is None]
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    baseline: list[tuple[int | None, str]] = []
    jobs = [Job(m, m.tests, args.timeout) for m in runnable]
    if not args.no_baseline and jobs:
        # every guard on the unmutated tree, side by side with the first mutants (judged at the end)
        jobs.insert(0, Job(None, tuple(dict.fromkeys(t for m in runnable for t in m.tests)), args.timeout * 2))

    def done(job: Job, status: int | None, output: str, seconds: float) -> None:
        if job.mutant is None:
            baseline.append((status, output))
            print(f"baseline: {len(job.tests)} guard tests on the unmutated tree, {seconds:.0f} s "
                  f"({'pass' if status == 0 else 'FAIL'})", flush=True)
            return
        outcome = judge(job.mutant, status, output, seconds)
        print(f"{outcome.verdict:>8}  {outcome.mutant.name} ({seconds:.0f} s)", flush=True)
        outcomes.append(outcome)

    n_jobs = max(1, min(args.jobs, len(jobs)))
    if jobs:
        preload()
        with tempfile.TemporaryDirectory(prefix="dflash-mutants-") as tmp:
            files = tree_files()
            copies = [scratch_copy(Path(tmp) / f"copy{i}", files) for i in range(n_jobs)]
            (Path(tmp) / "logs").mkdir()
            run_jobs(jobs, copies, Path(tmp) / "logs", done)
    if baseline and baseline[0][0] != 0:
        print(baseline[0][1][-3000:], file=sys.stderr)
        print("mutation check: the guards fail on the unmutated tree (above); no mutant's verdict means anything "
              "until they pass", file=sys.stderr)
        return 1
    order = {m.name: i for i, m in enumerate(runnable)}
    outcomes.sort(key=lambda o: order[o.mutant.name])
    outcomes = misplaced + outcomes
    print()
    print(table(outcomes))
    bad = failures(outcomes, args.allow_skipped)
    skipped = [o for o in outcomes if o.verdict == "SKIPPED"]
    print(f"\n{len(outcomes)} mutants: {sum(o.verdict == 'KILLED' for o in outcomes)} killed, "
          f"{len(skipped)} skipped here{' (allowed)' if skipped and args.allow_skipped else ''}, "
          f"{sum(o.verdict in ('SURVIVED', 'ERROR') for o in outcomes)} survived or in error; "
          f"{time.perf_counter() - t0:.0f} s, {n_jobs} side by side")
    for o in bad:
        print(f"{o.verdict}: [{o.mutant.name}] {o.detail}", file=sys.stderr)
    if skipped:
        names = ", ".join(o.mutant.name for o in skipped)
        print(f"unchecked on this machine (every test skipped): {names}; "
              + ("allowed by --allow-skipped" if args.allow_skipped else
                 "run where their tests run (a C++ compiler, the panel kernel), or pass --allow-skipped"),
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
