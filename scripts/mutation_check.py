"""The guards' mutation check: every mutant in tests/mutants.toml must fail its guard's tests.

A guard proves itself on the smallest change that breaks its claim (docs: the project's test
rules). The mutants are kept as data so that they keep proving it: for each one this script

1. finds its `original` text in its `file` of this tree, exactly once (missing or ambiguous: the
   code moved, the entry must follow it; an entry is never retired silently);
2. writes the mutant into a scratch copy of the tree (tracked and untracked files as they are on
   disk, uncommitted edits included; this tree is never touched) and runs its `tests` there with
   pytest, that copy's `dflash_trt` first on the path;
3. counts it KILLED when a test fails, SURVIVED when they pass (the guard does not catch what it
   claims), and an ERROR when they cannot say (a collection error, a node id that names no test,
   a hang past --timeout); SKIPPED when every test skipped here (say, no C++ compiler).

Before the mutants, a baseline runs every mutant's tests on the unmutated copy: a guard failing
on the tree itself would "kill" its mutants for nothing. Exit status 1 when any mutant survived or
any entry is an error. Figures on a shared machine are noisy: the table's seconds are per mutant.

    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py              # all (make mutants)
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py -k host-read  # names containing it
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py --list
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import re
import shutil
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
        missing = [k for k in FIELDS if k not in entry]
        extra = sorted(set(entry) - set(FIELDS))
        if missing or extra or not isinstance(entry, dict):
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


def _env(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def check_imports_copy(copy: Path) -> None:
    """The copy's package is the one its tests import (else every mutant would survive)."""
    r = subprocess.run([sys.executable, "-c", "import dflash_trt; print(dflash_trt.__file__)"], cwd=copy,
                       env=_env(copy), capture_output=True, text=True)
    got = Path(r.stdout.strip() or "?").resolve()
    if r.returncode != 0 or copy.resolve() not in got.parents:
        raise SystemExit(f"mutation check: the scratch copy imports dflash_trt from {got}, not from {copy} "
                         f"({r.stderr.strip()[-300:]})")


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float, stop_at_first: bool = True) -> tuple[int | None, str]:
    """pytest's exit status over `tests` in the copy (None: past the timeout) and its output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *(["-x"] if stop_at_first else []),
           *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, ""
    return r.returncode, r.stdout + r.stderr


def _first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", output, re.M)
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


def mutate_and_run(m: Mutant, copy: Path, timeout: float) -> Outcome:
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.original, m.mutant, 1))
    t = time.perf_counter()
    try:
        status, output = run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(original)
    return judge(m, status, output, time.perf_counter() - t)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| mutant | file | verdict | killed by | s |", "|---|---|---|---|---:|"]
    for o in outcomes:
        rows.append(f"| {o.mutant.name} | {o.mutant.file} | {o.verdict} | {o.detail} | {o.seconds:.1f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="select", action="append", default=[], help="only mutants whose name contains this")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutants run side by side, one scratch copy each [2]")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one mutant's tests may take [300]")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of every guard on the unmutated tree")
    ap.add_argument("--list", action="store_true", help="print the mutants and where they apply, run nothing")
    args = ap.parse_args()

    mutants = [m for m in load_mutants() if not args.select or any(s in m.name for s in args.select)]
    if not mutants:
        print(f"mutation check: no mutant in {DATA.relative_to(ROOT)} matches {args.select}", file=sys.stderr)
        return 1
    misplaced = [Outcome(m, "ERROR", why) for m in mutants if (why := locate(m)) is not None]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.file} -> {', '.join(m.tests)}  [{locate(m) or 'applies'}]")
        return 0
    runnable = [m for m in mutants if locate(m) is None]
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="dflash-mutants-") as tmp:
        files = tree_files()
        jobs = max(1, min(args.jobs, len(runnable)))
        paths = [scratch_copy(Path(tmp) / f"copy{i}", files) for i in range(jobs)]
        copies: queue.Queue[Path] = queue.Queue()
        for copy in paths:
            copies.put(copy)
        check_imports_copy(paths[0])
        if not args.no_baseline and runnable:
            tests = tuple(dict.fromkeys(t for m in runnable for t in m.tests))
            t = time.perf_counter()
            status, output = run_tests(paths[0], tests, args.timeout * 2, stop_at_first=False)
            print(f"baseline: {len(tests)} guard tests on the unmutated tree, {time.perf_counter() - t:.0f} s", flush=True)
            if status != 0:
                print(output[-3000:], file=sys.stderr)
                print("mutation check: the guards fail on the unmutated tree; fix that first", file=sys.stderr)
                return 1

        def one(m: Mutant) -> Outcome:
            copy = copies.get()
            try:
                return mutate_and_run(m, copy, args.timeout)
            finally:
                copies.put(copy)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for outcome in pool.map(one, runnable):
                print(f"{outcome.verdict:>8}  {outcome.mutant.name} ({outcome.seconds:.0f} s)", flush=True)
                outcomes.append(outcome)
    outcomes = misplaced + outcomes
    print()
    print(table(outcomes))
    bad = [o for o in outcomes if o.verdict in ("SURVIVED", "ERROR")]
    print(f"\n{len(outcomes)} mutants: {sum(o.verdict == 'KILLED' for o in outcomes)} killed, "
          f"{sum(o.verdict == 'SKIPPED' for o in outcomes)} skipped here, {len(bad)} survived or in error; "
          f"{time.perf_counter() - t0:.0f} s with {jobs if runnable else 0} job(s)")
    for o in bad:
        print(f"{o.verdict}: [{o.mutant.name}] {o.detail}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
