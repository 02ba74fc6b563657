"""docs/results/ in a budget: tables that cite their run, summaries small and compressed, nothing a
table cites lost.

- the folder stays under 2 MB (every clone carries it, and every stop that measures adds to it);
- JSON is kept compressed and small: no plain ``.json``, each ``.json.gz`` at most 64 KiB (a
  run's summary is 5-20 KiB; a whole bench.json gzip'd is ~150 KiB and fails here);
- every ``table.md`` beside a kept summary has the figures that ``dflash-trt bench report`` makes
  from that summary today, in order (the wording around them may have changed since: stop 52's
  caption names a margin that was reverted), so a table is never left without its source;
- every path under docs/results/ that a page of docs/ or the README names exists.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.bench.archive import NAME, REQUEST_FIELDS, read_json
from dflash_trt.bench.report import load_result, markdown
from dflash_trt.cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BUDGET_BYTES = 2_000_000
SUMMARY_MAX_BYTES = 64 * 1024


def _files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def figures(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?", text)


def test_docs_results_stays_under_its_budget():
    total = sum(p.stat().st_size for p in _files())
    biggest = sorted(_files(), key=lambda p: -p.stat().st_size)[:3]
    assert 0 < total < BUDGET_BYTES, (f"docs/results/ holds {total / 1e6:.2f} MB (budget {BUDGET_BYTES / 1e6:.0f} MB); "
                                      f"largest: {[f'{p.relative_to(ROOT)} {p.stat().st_size}' for p in biggest]}: "
                                      f"keep a run's summary (`dflash-trt bench summary`), not its bench.json")


def test_json_is_kept_compressed_and_small():
    plain = [str(p.relative_to(ROOT)) for p in _files() if p.suffix == ".json"]
    assert not plain, f"uncompressed JSON in docs/results/: {plain}; keep `dflash-trt bench summary`'s {NAME}"
    kept = [p for p in _files() if p.name.endswith(".json.gz")]
    assert len(kept) >= 30
    for p in kept:
        assert p.stat().st_size <= SUMMARY_MAX_BYTES, f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes"
        read_json(p)  # a whole gzip member of JSON


def _tables_with_summaries() -> list[tuple[Path, Path]]:
    return [(t, t.with_name(NAME)) for t in sorted(RESULTS.rglob("table.md")) if t.with_name(NAME).is_file()]


def test_the_pairs_of_tables_and_summaries_are_found():
    assert len(_tables_with_summaries()) >= 14


@pytest.mark.parametrize("table, kept", _tables_with_summaries(), ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_each_table_is_made_from_the_summary_beside_it(table, kept):
    made = markdown(load_result(kept))
    assert figures(made) == figures(table.read_text(encoding="utf-8"))


def test_every_results_path_the_docs_name_exists():
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    named = set()
    for page in pages:
        for m in re.finditer(r"(?:docs/)?results/[\w./-]*[\w/]", page.read_text(encoding="utf-8")):
            named.add(m.group(0).removeprefix("docs/"))
    assert len(named) >= 10
    missing = sorted(n for n in named if not (ROOT / "docs" / n).exists())
    assert not missing, f"docs name results that are not in docs/results/: {missing}"


def test_a_summary_keeps_the_tables_source_and_each_requests_sizes_and_times(tmp_path):
    """`dflash-trt bench summary` on a whole run (a kept summary given back its requests' token ids
    and per-step lists): the report is unchanged, the requests keep REQUEST_FIELDS only, the file is
    gzip'd compact JSON, and summarising a summary changes nothing."""
    kept = RESULTS / "cpu-vllm-peer" / NAME
    result = read_json(kept)
    whole = {**result, "requests": [{**r, "output_ids": list(range(128)), "acceptance_lengths": [1] * 127,
                                     "position_drafted": [3] * 15, "text": None} for r in result["requests"]]}
    src = tmp_path / "run" / "bench.json"
    src.parent.mkdir()
    src.write_text(json.dumps(whole, indent=2))
    res = CliRunner().invoke(main, ["bench", "summary", str(src)])
    assert res.exit_code == 0, res.output
    out = src.with_name(NAME)
    again = json.loads(gzip.decompress(out.read_bytes()))
    assert markdown(again) == markdown(whole)
    assert {tuple(r) for r in again["requests"]} == {REQUEST_FIELDS}
    assert len(again["requests"]) == len(whole["requests"]) > 100
    assert out.stat().st_size * 10 < src.stat().st_size
    res = CliRunner().invoke(main, ["bench", "summary", str(out), "--out", str(tmp_path / "twice.json.gz")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "twice.json.gz").read_bytes() == out.read_bytes()


def test_a_multi_turn_summary_keeps_the_records_tau_is_bootstrapped_from(tmp_path):
    """The multi-turn summary drops the turns' token ids and keeps their acceptance lengths: tau's
    interval (docs/runtime.md's table: 0.012 / 0.007 on the adaptive run) comes back from it."""
    from dflash_trt.bench.multiturn import TurnRecord, steps_by_conversation, tau_halfwidth

    result = read_json(RESULTS / "cpu-prefix-cache-issue57" / "multiturn-adaptive" / NAME)
    for side, half in (("on", 0.012), ("off", 0.007)):
        turns = [TurnRecord(**t) for t in result["records"][side]["4"]]
        assert all(t.acceptance_lengths and not t.output_ids for t in turns)
        assert round(tau_halfwidth(steps_by_conversation(turns)), 3) == half


def test_summary_of_a_file_that_is_not_a_run_is_one_line(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(main, ["bench", "summary", str(bad)])
    assert res.exit_code != 0 and "is not JSON" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["bench", "summary", str(tmp_path / "missing.json")])
    assert res.exit_code != 0 and "not found" in res.output
