"""`dflash-trt bench` in process on a tiny pair: bench.json schema, the relations between its
figures, the plots, and the summary arithmetic on hand-built records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from dflash_trt.bench.runners import RequestRecord
from dflash_trt.bench.summary import summarize_records
from dflash_trt.cli import main

pytestmark = pytest.mark.timeout(180)

NUM_PROMPTS, LEVELS = 3, (1, 2)


@pytest.fixture(scope="module")
def run(tiny_pair_dirs, tmp_path_factory) -> tuple[dict, Path, str]:
    tdir, ddir = tiny_pair_dirs
    out = tmp_path_factory.mktemp("bench")
    res = CliRunner().invoke(main, [
        "bench", "--target", str(tdir), "--draft", str(ddir), "--num-prompts", str(NUM_PROMPTS),
        "--max-new-tokens", "12", "--concurrency", ",".join(map(str, LEVELS)), "--out", str(out), "--threads", "1",
    ])
    assert res.exit_code == 0, res.output
    return json.loads((out / "bench.json").read_text()), out, res.output


def test_schema_sources_and_environment(run):
    result, out, output = run
    assert result["schema_version"] == 1
    assert result["config"]["concurrency"] == list(LEVELS) and result["config"]["num_prompts"] == NUM_PROMPTS
    assert result["source"]["kind"] == "in_process" and result["source"]["modes"] == ["dflash", "plain"]
    assert result["source"]["parallel"] is False  # the reference loop is serial, and says so
    env = result["environment"]
    assert {"torch", "transformers", "dflash_trt", "python"} <= set(env["versions"]) and env["cpu_count"] >= 1
    # round-robin over the three project categories, eval split
    assert [p["category"] for p in result["prompts"]] == ["code", "math", "chat"]
    assert [row["concurrency"] for row in result["sweep"]] == list(LEVELS)
    assert len(result["requests"]) == NUM_PROMPTS * 2 * len(LEVELS)
    for row in result["sweep"]:
        for mode in ("dflash", "plain"):
            s = row[mode]
            assert s["num_requests"] == NUM_PROMPTS
            for dist in ("ttft_s", "tpot_s", "tokens_per_s"):
                assert set(s[dist]) == {"mean", "p50", "p90", "p99"}
                assert 0 < s[dist]["p50"] <= s[dist]["p90"] <= s[dist]["p99"]
    # the terminal table uses the metrics vocabulary
    for name in ("tau", "acceptance_rate", "tpot_s", "total_tokens_per_s", "speedup"):
        assert name in output
    assert (out / "table.md").read_text().startswith("| C | mode | tau |")


def test_relations_between_fields(run):
    result, _, _ = run
    reqs = result["requests"]
    for r in reqs:
        n = r["num_output_tokens"]
        assert r["tpot_s"] == pytest.approx((r["t_end"] - r["t_first"]) / (n - 1))
        assert r["ttft_s"] == pytest.approx(r["t_first"] - r["t_submit"])
        assert r["tokens_per_s"] == pytest.approx(n / (r["t_end"] - r["t_submit"]))
        assert r["queue_s"] >= 0 and r["t_submit"] <= r["t_first"] <= r["t_end"]
        assert r["tau"] == pytest.approx(1 + r["total_accepted_draft_tokens"] / r["num_steps"])
        assert sum(r["acceptance_lengths"]) == r["num_steps"] + r["total_accepted_draft_tokens"]
        if r["mode"] == "plain":
            assert r["tau"] == 1 and r["total_draft_tokens"] == 0
    for row in result["sweep"]:
        rs = [r for r in reqs if r["concurrency"] == row["concurrency"]]
        for mode in ("dflash", "plain"):
            s, mine = row[mode], [r for r in rs if r["mode"] == mode]
            steps = sum(r["num_steps"] for r in mine)
            accepted = sum(r["total_accepted_draft_tokens"] for r in mine)
            assert s["num_steps"] == steps and s["total_accepted_draft_tokens"] == accepted
            assert s["tau"] == pytest.approx(1 + accepted / steps)  # pooled over steps, bonus included
            drafted = sum(r["total_draft_tokens"] for r in mine)
            assert s["acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
            assert s["tpot_s"]["mean"] == pytest.approx(sum(r["tpot_s"] for r in mine) / len(mine))
            wall = max(r["t_end"] for r in mine) - min(r["t_submit"] for r in mine)
            assert s["total_tokens_per_s"] == pytest.approx(sum(r["num_output_tokens"] for r in mine) / wall)
        assert row["speedup"] == pytest.approx(row["plain"]["tpot_s"]["mean"] / row["dflash"]["tpot_s"]["mean"])
        ppa = row["dflash"]["per_position_acceptance"]
        assert len(ppa) == 7 and all(0 <= x <= 1 for x in ppa)  # block 8 -> 7 draft slots
    c = result["ceiling"]
    assert c["tau_bound_speedup"] == result["sweep"][0]["dflash"]["tau"]
    assert c["measured_speedup"] == pytest.approx(result["sweep"][0]["speedup"])
    assert c["measured_speedup"] == pytest.approx(c["tau_bound_speedup"] / c["step_cost_ratio"])
    assert c["gpu"] == "cpu" and c["bandwidth_bound_tokens_per_s"] is None  # no HBM figure for a CPU
    assert c["achieved_gb_s"] == pytest.approx(c["bytes_per_step_loaded"] / c["plain_step_s"] / 1e9)


def test_greedy_dflash_reproduces_plain_decoding(run):
    result, _, _ = run
    ident = result["identical_to_plain"]
    assert ident == {"checked": NUM_PROMPTS * len(LEVELS), "identical": NUM_PROMPTS * len(LEVELS)}


def test_serial_runtime_queues_concurrent_requests(run):
    """C=2 over the serial reference loop: some request waited for the other (queue_s > 0)."""
    result, _, _ = run
    c2 = [r for r in result["requests"] if r["concurrency"] == 2]
    assert max(r["queue_s"] for r in c2) > 0
    for mode in ("dflash", "plain"):  # one decoding thread, first come first served
        rs = sorted((r for r in c2 if r["mode"] == mode), key=lambda r: r["t_submit"])
        starts = [r["t_submit"] + r["queue_s"] for r in rs]
        assert starts == sorted(starts)
    c1 = [r for r in result["requests"] if r["concurrency"] == 1]
    assert all(r["queue_s"] < 0.05 for r in c1)  # alone, a request never waits for another


def test_max_draft_len_option(tiny_pair_dirs, tmp_path):
    tdir, ddir = tiny_pair_dirs
    base = ["bench", "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "1", "--max-new-tokens", "10"]
    res = CliRunner().invoke(main, [*base, "--max-draft-len", "3", "--out", str(tmp_path), "--no-plots"])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["source"]["speculation"] == {"block_size": 8, "max_draft_len": 3, "policy": "fixed"}
    assert len(result["sweep"][0]["dflash"]["per_position_acceptance"]) == 3
    assert max(r["total_draft_tokens"] / r["num_steps"] for r in result["requests"] if r["mode"] == "dflash") <= 3
    res = CliRunner().invoke(main, [*base, "--max-draft-len", "8"])
    assert res.exit_code != 0 and "max_draft_len=8 (--max-draft-len) must be between 1 and block_size-1=7" in res.output
    # --policy adaptive: the batched runtime at one sequence chooses k <= K; output stays plain greedy
    out = tmp_path / "adaptive"
    res = CliRunner().invoke(main, [*base, "--max-draft-len", "3", "--policy", "adaptive", "--out", str(out),
                                    "--no-plots"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "bench.json").read_text())
    assert result["source"]["speculation"]["policy"] == "adaptive"
    assert result["identical_to_plain"]["identical"] == result["identical_to_plain"]["checked"]
    assert max(r["total_draft_tokens"] / r["num_steps"] for r in result["requests"] if r["mode"] == "dflash") <= 3


def test_plots_are_valid_pngs(run):
    result, out, _ = run
    assert set(result["plots"]) == {"throughput", "tau_histogram", "per_position_acceptance"}
    for name in result["plots"].values():
        path = out / name
        assert path.stat().st_size > 0
        with Image.open(path) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def _rec(lengths: list[int], drafted: int, t_submit: float, t_first: float, t_end: float, n: int) -> RequestRecord:
    accepted = sum(lengths) - len(lengths)
    return RequestRecord(
        mode="dflash", concurrency=1, prompt_id="p", category="c", num_prompt_tokens=5, num_output_tokens=n,
        num_steps=len(lengths), total_draft_tokens=drafted, total_accepted_draft_tokens=accepted,
        tau=sum(lengths) / len(lengths), acceptance_rate=accepted / drafted, t_submit=t_submit, t_first=t_first,
        t_end=t_end, queue_s=0.0, finish_reason="length", acceptance_lengths=lengths,
        position_drafted=[len(lengths)] * 3, position_accepted=[sum(a > j + 1 for a in lengths) for j in range(3)],
    )


def test_summary_pools_steps_not_request_means():
    """Two requests, tau 3.0 (1 step) and 1.0 (3 steps): pooled tau = 6/4 steps, not (3+1)/2."""
    a = _rec([3], drafted=3, t_submit=0.0, t_first=0.1, t_end=0.5, n=4)
    b = _rec([1, 1, 1], drafted=9, t_submit=0.0, t_first=0.2, t_end=1.0, n=4)
    s = summarize_records([a, b])
    assert s["tau"] == pytest.approx(6 / 4) and s["acceptance_rate"] == pytest.approx(2 / 12)
    assert s["per_position_acceptance"] == pytest.approx([1 / 4, 1 / 4, 0.0])
    assert s["tpot_s"]["mean"] == pytest.approx(((0.5 - 0.1) / 3 + (1.0 - 0.2) / 3) / 2)
    assert s["total_tokens_per_s"] == pytest.approx(8 / 1.0)
    assert s["tokens_per_s"]["p50"] == pytest.approx((4 / 0.5 + 4 / 1.0) / 2)
    assert not math.isnan(s["ttft_s"]["p99"])
