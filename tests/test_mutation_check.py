"""The mutation check's data and verdicts (scripts/mutation_check.py; `make mutants` runs it).

Here, in the fast tier: every mutant of tests/mutants.toml still applies (its original text found
exactly once, so a refactor that moves a guarded line fails this suite, not only `make mutants`),
names test files that exist, and pytest's outcomes map to the right verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mutation_check = sys.modules.setdefault("mutation_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mutation_check)

MUTANTS = mutation_check.load_mutants()


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_still_applies_to_this_tree(mutant):
    assert mutation_check.locate(mutant) is None
    for test in mutant.tests:
        assert (ROOT / test.split("::")[0]).is_file(), test
    assert mutant.why.strip()


def test_a_moved_original_is_an_error_not_a_retired_mutant(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\nb = 1\n")
    m = mutation_check.Mutant("m", "x.py", "= 1", "= 2", ("tests/test_x.py",), "why")
    assert "2 times in x.py" in mutation_check.locate(m, tmp_path)
    gone = mutation_check.Mutant("m", "x.py", "c = 1", "c = 2", ("tests/test_x.py",), "why")
    assert "not in x.py: the code moved" in mutation_check.locate(gone, tmp_path)
    assert "does not exist" in mutation_check.locate(mutation_check.Mutant("m", "y.py", "a", "b", (), "w"), tmp_path)


def test_an_entry_with_a_missing_or_unknown_field_is_refused(tmp_path):
    data = tmp_path / "mutants.toml"
    data.write_text('[m]\nfile = "x.py"\noriginal = "a"\nmutant = "b"\ntests = ["t"]\nwhy = "w"\nwhere = "?"\n')
    with pytest.raises(SystemExit, match=r"\[m\]: fields .*unknown \['where'\]"):
        mutation_check.load_mutants(data)


@pytest.mark.parametrize("status, output, verdict, detail", [
    (1, "FAILED tests/test_x.py::test_y[cuda:99] - AssertionError: no\n1 failed", "KILLED",
     "tests/test_x.py::test_y[cuda:99] (AssertionError: no)"),
    (0, "3 passed in 1.0s", "SURVIVED", "tests/test_x.py pass with it: w"),
    (0, "SKIPPED [2] tests/test_x.py:9: no C++ compiler\n2 skipped in 0.1s", "SKIPPED",
     "every test skipped here (no C++ compiler)"),
    (4, "ERROR: not found: tests/test_x.py::test_z\n", "ERROR", "pytest exit status 4 (not a test failure)"),
    (2, "ERROR tests/test_x.py - SyntaxError\n1 error", "ERROR", "pytest exit status 2 (not a test failure)"),
    (None, "", "ERROR", "ran past --timeout"),
])
def test_pytests_outcome_is_the_verdict(status, output, verdict, detail):
    m = mutation_check.Mutant("m", "x.py", "a", "b", ("tests/test_x.py",), "w")
    got = mutation_check.judge(m, status, output, 1.0)
    assert got.verdict == verdict and detail in got.detail


def test_a_mutant_whose_tests_all_skip_fails_the_check_unless_allowed():
    """Skipped tests check nothing: such a guard goes unchecked on this machine. The check fails
    on it (naming it) unless --allow-skipped says that is accepted; survivors and errors fail either way."""
    def outcome(name: str, verdict: str):
        return mutation_check.Outcome(mutation_check.Mutant(name, "x.py", "a", "b", ("t",), "w"), verdict, "")

    outcomes = [outcome("k", "KILLED"), outcome("s", "SKIPPED"), outcome("v", "SURVIVED"), outcome("e", "ERROR")]
    assert [o.mutant.name for o in mutation_check.failures(outcomes)] == ["s", "v", "e"]
    assert [o.mutant.name for o in mutation_check.failures(outcomes, allow_skipped=True)] == ["v", "e"]
    assert mutation_check.failures([outcome("k", "KILLED")]) == []
