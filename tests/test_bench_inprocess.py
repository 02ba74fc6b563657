"""`dflash-trt bench` in process on a tiny pair: both runtimes as sides, bench.json schema, the relations
between its figures (per request, per row, the limits decomposition), the closed loop, the identity
check, the report regenerated from bench.json, the plots, and the summary arithmetic on hand-built
records.

The module's run decodes a pair rigged to be accepted (tests/conftest.py rigged_pair_dirs): with a
random drafter nothing is accepted, so tau = 1 + accepted / steps would read 1 == 1. Its reference
loop drafts K every step; its batched runtime runs the adaptive policy (what serve runs), which
drafts or not as its timings on this shared machine say, so the claims that need drafting steps read
the reference loop, or a fixed-policy run beside it."""

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
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS, LEVELS = 3, (1, 2)


def _bench(tmp: Path, *args: str) -> tuple[dict, str]:
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(tmp), "--threads", "1", "--no-progress"])
    assert res.exit_code == 0, res.output
    return json.loads((tmp / "bench.json").read_text()), res.output


@pytest.fixture(scope="module")
def run(rigged_pair_dirs, tmp_path_factory) -> tuple[dict, Path, str]:
    tdir, ddir = rigged_pair_dirs
    out = tmp_path_factory.mktemp("bench")
    result, output = _bench(out, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", str(NUM_PROMPTS),
                            "--max-new-tokens", "12", "--concurrency", ",".join(map(str, LEVELS)),
                            "--runtime", "reference,batched", "--per-category")
    return result, out, output


def _rows(result: dict, side: str | None = None, mode: str | None = None) -> list[dict]:
    return [r for r in result["rows"] if (side is None or r["side"] == side) and (mode is None or r["mode"] == mode)]


def test_schema_sides_and_environment(run):
    result, out, output = run
    assert result["schema_version"] == 2
    assert result["config"]["concurrency"] == list(LEVELS) and result["config"]["num_prompts"] == NUM_PROMPTS
    assert result["source"]["kind"] == "in_process" and result["source"]["runtimes"] == ["reference", "batched"]
    sides = {s["name"]: s for s in result["source"]["sides"]}
    assert sides["reference"]["parallel"] is False and sides["batched"]["parallel"] is True  # each says what it is
    assert result["source"]["batched_policy"] == "adaptive"  # what `serve` runs, by default
    env = result["environment"]
    assert {"torch", "transformers", "dflash_trt", "python"} <= set(env["versions"]) and env["cpu_count"] >= 1
    assert len(env["loadavg_start"]) == 3 and len(env["loadavg_end"]) == 3  # how shared the machine was
    assert [p["category"] for p in result["prompts"]] == ["code", "math", "chat"]  # round-robin, eval split
    # one row per level x side x mode, in table order
    assert [(r["concurrency"], r["side"], r["mode"]) for r in result["rows"]] == [
        (c, s, m) for c in LEVELS for s in ("reference", "batched") for m in ("dflash", "plain")]
    assert len(result["requests"]) == NUM_PROMPTS * 4 * len(LEVELS)
    for r in result["rows"]:
        assert r["num_requests"] == NUM_PROMPTS and r["errors"] == 0
        for dist in ("ttft_s", "tpot_s", "tokens_per_s"):
            assert set(r[dist]) == {"mean", "p50", "p90", "p99"}
            assert 0 < r[dist]["p50"] <= r[dist]["p90"] <= r[dist]["p99"]
    for name in ("tau", "per-position acceptance", "TTFT", "TPOT", "tok/s total", "DFlash/plain", "identical"):
        assert name in output
    assert "vs vLLM" not in output  # no peer ran: no peer column


def test_relations_between_fields(run):
    result, _, _ = run
    reqs = result["requests"]
    for row in _rows(result, "reference", "dflash"):  # the relations below hold with drafts accepted, not as 1 == 1
        assert row["total_accepted_draft_tokens"] > 0 and row["tau"] > 2, row["concurrency"]
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
    for row in result["rows"]:
        mine = [r for r in reqs if (r["side"], r["mode"], r["concurrency"]) == (row["side"], row["mode"], row["concurrency"])]
        steps = sum(r["num_steps"] for r in mine)
        accepted = sum(r["total_accepted_draft_tokens"] for r in mine)
        drafted = sum(r["total_draft_tokens"] for r in mine)
        assert row["num_steps"] == steps and row["total_accepted_draft_tokens"] == accepted
        assert row["tau"] == pytest.approx(1 + accepted / steps)  # pooled over steps, bonus included
        assert row["acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
        assert row["tpot_s"]["mean"] == pytest.approx(sum(r["tpot_s"] for r in mine) / len(mine))
        wall = max(r["t_end"] for r in mine) - min(r["t_submit"] for r in mine)
        assert row["total_tokens_per_s"] == pytest.approx(sum(r["num_output_tokens"] for r in mine) / wall)
        if row["mode"] == "dflash":
            plain = next(p for p in _rows(result, row["side"], "plain") if p["concurrency"] == row["concurrency"])
            assert row["dflash_over_plain"] == pytest.approx(row["total_tokens_per_s"] / plain["total_tokens_per_s"])
            assert row["speedup"] == pytest.approx(plain["tpot_s"]["mean"] / row["tpot_s"]["mean"])
            fastest = max(p["total_tokens_per_s"] for p in _rows(result, mode="plain")
                          if p["concurrency"] == row["concurrency"])
            assert row["vs_fastest_plain"] == pytest.approx(row["total_tokens_per_s"] / fastest)
            if row["steady_dflash_over_plain"] is not None:
                assert row["steady_dflash_over_plain"] == pytest.approx(row["steady_tokens_per_s"]
                                                                        / plain["steady_tokens_per_s"])
        # the batched runtime keeps C = 2 requests decoding at once; the reference loop queues them
        if row["concurrency"] == 2:
            assert (row["steady_tokens_per_s"] is not None) is (row["side"] == "batched")
    ref = _rows(result, "reference", "dflash")[0]
    assert len(ref["per_position_acceptance"]) == 7  # block 8, K = 7: the reference loop drafts all of them
    c = result["ceiling"]
    assert c["tau_bound_speedup"] == ref["tau"]
    assert c["measured_speedup"] == pytest.approx(ref["speedup"])
    assert c["gpu"] == "cpu" and c["bandwidth_bound_tokens_per_s"] is None  # no HBM figure for a CPU


def test_every_output_is_the_reference_greedy_decoding(run):
    result, _, _ = run
    assert result["identical_all"] is True
    for row in result["rows"]:
        assert row["identical"] == {"checked": NUM_PROMPTS, "identical": NUM_PROMPTS,
                                    "against": "reference loop, plain greedy", "departures": []}
    by_prompt: dict[str, list] = {}
    for r in result["requests"]:
        by_prompt.setdefault(r["prompt_id"], []).append(r["output_ids"])
    assert all(all(ids == v[0] for ids in v) for v in by_prompt.values())  # and so equal to each other


def test_reference_loop_queues_and_batched_runtime_keeps_c_in_flight(run):
    result, _, _ = run
    reqs = result["requests"]
    ref2 = [r for r in reqs if r["side"] == "reference" and r["concurrency"] == 2]
    assert max(r["queue_s"] for r in ref2) > 0  # a request waited for the other
    for mode in ("dflash", "plain"):  # one decoding thread, first come first served
        rs = sorted((r for r in ref2 if r["mode"] == mode), key=lambda r: r["t_submit"])
        starts = [r["t_submit"] + r["queue_s"] for r in rs]
        assert starts == sorted(starts)
    assert all(r["queue_s"] < 0.05 for r in reqs if r["concurrency"] == 1 and r["side"] == "reference")
    for mode in ("dflash", "plain"):  # closed loop of 2 users: 2 in flight, the third sent when one ended
        rs = sorted((r for r in reqs if r["side"] == "batched" and r["concurrency"] == 2 and r["mode"] == mode),
                    key=lambda r: r["t_submit"])
        assert rs[0]["t_submit"] == pytest.approx(rs[1]["t_submit"], abs=0.05)
        assert rs[2]["t_submit"] >= min(rs[0]["t_end"], rs[1]["t_end"]) - 1e-3
        assert rs[2]["t_submit"] <= min(rs[0]["t_end"], rs[1]["t_end"]) + 0.05


def _assert_every_pass_timed(result: dict, side: str, c: int) -> None:
    """The side's DFlash steps at C = c drafted, and each of their passes was timed inside its step:
    the drafter's pass and its head (the limits' drafter term), the target's."""
    e = next(e for e in result["limits"] if (e["side"], e["concurrency"]) == (side, c))
    assert e["mean_k"] > 0 and e["drafter"] > 0, (side, c, e)
    row = next(r for r in _rows(result, side, "dflash") if r["concurrency"] == c)
    for k, t in row["info"]["step_timing"].items():
        passes = t["target_s"] + t["draft_s"] + t["head_s"]
        assert t["target_s"] > 0 and passes <= t["step_s"] * (1 + 1e-9), (side, c, k, t)
        if int(k) > 0:  # (a plain step may run the drafter too: shadow drafts)
            assert t["draft_s"] > 0 and t["head_s"] > 0, (side, c, k, t)


def test_limits_decompose_a_step_into_its_passes(run, rigged_pair_dirs, tmp_path):
    """cost = 1 + drafter + verify + other: a DFlash step in plain steps, from the per-pass timings.
    The sum is arithmetic ("other" is the step minus the timed passes); what is measured is that
    every pass of a drafting step was timed, on each side: the reference loop drafts every step, and
    the batched runtime does under fixed:7 (a run beside the module's, whose adaptive policy drafts
    or not as its timings say)."""
    result, _, _ = run
    entries = {(e["side"], e["concurrency"]): e for e in result["limits"]}
    assert set(entries) == {(s, c) for s in ("reference", "batched") for c in LEVELS}
    for e in entries.values():
        assert e["cost"] == pytest.approx(1 + e["drafter"] + e["verify"] + e["other"], abs=1e-6)
        assert e["predicted_dflash_over_plain"] == pytest.approx(e["tau"] / e["cost"])
    for c in LEVELS:
        _assert_every_pass_timed(result, "reference", c)
    ref = entries[("reference", 1)]
    row = _rows(result, "reference", "dflash")[0]
    assert sum(ref["k_steps"].values()) == row["num_steps"]  # every DFlash step of the row was timed
    batched = entries[("batched", 1)]
    assert batched["policy"]["candidates"][0] == {"k": 0, "cost_vs_plain": 1.0, "expected_tokens": 1.0,
                                                 "expected_gain": 1.0}
    assert [c["k"] for c in batched["policy"]["candidates"]] == [0, 1, 3, 7]
    # the batched runtime's target passes run the lean forward (runtime/targets/lean_forward.py): timed all the same
    for mode in ("dflash", "plain"):
        timing = _rows(result, "batched", mode)[0]["info"]["step_timing"]
        assert timing and all(t["target_s"] > 0 for t in timing.values()), (mode, timing)
    tdir, ddir = rigged_pair_dirs
    fixed, _ = _bench(tmp_path, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2", "--max-new-tokens",
                      "12", "--runtime", "batched", "--policy", "fixed:7", "--no-plots")
    assert list(_rows(fixed, "batched", "dflash")[0]["info"]["step_timing"]) == ["7"]
    _assert_every_pass_timed(fixed, "batched", 1)


def test_per_category_rows(run):
    result, _, _ = run
    for row in result["rows"]:
        cats = row["per_category"]
        assert set(cats) == {"code", "math", "chat"}
        assert sum(s["num_requests"] for s in cats.values()) == row["num_requests"]
        assert sum(s["num_steps"] for s in cats.values()) == row["num_steps"]


def test_report_is_regenerated_from_bench_json(run, tmp_path):
    """`bench report bench.json --markdown` writes what the run wrote into table.md, from the file alone,
    and from the run's bench.summary.json.gz alike."""
    _, out, _ = run
    res = CliRunner().invoke(main, ["bench", "report", str(out / "bench.json"), "--markdown"])
    assert res.exit_code == 0, res.output
    assert res.output == (out / "table.md").read_text()
    assert "What limits DFlash" in res.output and "Per category" in res.output
    target = tmp_path / "results.md"
    assert CliRunner().invoke(main, ["bench", "report", str(out / "bench.json"), "--out", str(target)]).exit_code == 0
    assert target.read_text() == res.output
    terminal = CliRunner().invoke(main, ["bench", "report", str(out / "bench.json")])
    assert terminal.exit_code == 0 and "ours, batched runtime" in terminal.output
    # and from the summary the run wrote beside it (what docs/results/ keeps: bench/archive.py)
    kept = CliRunner().invoke(main, ["bench", "report", str(out / "bench.summary.json.gz"), "--markdown"])
    assert kept.exit_code == 0 and kept.output == res.output


def test_frontier_of_the_run_and_its_report(run):
    """Every row is a point: interactivity = 1 / its mean TPOT, throughput = its total tokens/s over
    one device; DFlash / plain interactivity at the same C is the speedup; `bench report
    --interactivity` reads each mode's best throughput at X from bench.json alone."""
    result, out, _ = run
    front = result["frontier"]
    assert front["gpus"] == 1 and front["gpus_source"] == "in process: one device (cpu)" and front["at"] == []
    assert front["per"] == "per device" and front["throughput"] == "total tokens/s per device"
    points = {(s["side"], s["mode"], p["concurrency"]): p for s in front["series"] for p in s["points"]}
    assert len(points) == len(result["rows"])
    for row in result["rows"]:
        p = points[(row["side"], row["mode"], row["concurrency"])]
        assert p["interactivity"] == pytest.approx(1 / row["tpot_s"]["mean"])
        assert p["throughput"] == pytest.approx(row["total_tokens_per_s"])
        if row["mode"] == "dflash":
            plain = points[(row["side"], "plain", row["concurrency"])]
            assert p["interactivity"] / plain["interactivity"] == pytest.approx(row["speedup"])
    batched = [p for (side, mode, _), p in points.items() if side == "batched" and mode == "dflash"]
    inside = (min(p["interactivity"] for p in batched) + max(p["interactivity"] for p in batched)) / 2
    outside = 10 * max(p["interactivity"] for p in points.values())
    res = CliRunner().invoke(main, ["bench", "report", str(out / "bench.json"), "--interactivity",
                                    f"{inside},{outside}"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"at >= {inside:g} tokens/s per user, ours, batched runtime: DFlash " in text
    assert f"at >= {outside:g} tokens/s per user, ours, batched runtime: DFlash never reaches it" in text
    assert "linear in log2(C)" in text and "Interactivity / throughput frontier" in text
    bad = CliRunner().invoke(main, ["bench", "report", str(out / "bench.json"), "--interactivity", "0"])
    assert bad.exit_code != 0 and "> 0" in bad.output and "Traceback" not in bad.output


def test_plots_are_valid_pngs(run):
    result, out, _ = run
    assert set(result["plots"]) == {"throughput", "tokens_per_s_by_concurrency", "tau_histogram",
                                    "per_position_acceptance", "frontier"}
    for name in result["plots"].values():
        with Image.open(out / name) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_policies_and_max_draft_len(tiny_pair_dirs, tmp_path):
    tdir, ddir = tiny_pair_dirs
    base = ["--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2", "--max-new-tokens", "10", "--no-plots"]
    result, _ = _bench(tmp_path / "k3", *base, "--max-draft-len", "3")
    assert result["source"]["speculation"] == {"block_size": 8, "max_draft_len": 3, "policy": "fixed",
                                               "draft_method": DEFAULT_DRAFT_METHOD}
    assert result["source"]["runtimes"] == ["reference"]
    assert len(_rows(result, "reference", "dflash")[0]["per_position_acceptance"]) == 3
    assert max(r["total_draft_tokens"] / r["num_steps"] for r in result["requests"] if r["mode"] == "dflash") <= 3
    # fixed:2 on the batched runtime: exactly 2 drafts every step (1 at the budget's tail)
    result, _ = _bench(tmp_path / "f2", *base, "--runtime", "batched", "--policy", "fixed:2", "--draft-method", "greedy")
    assert result["source"]["batched_policy"] == "fixed:2" and result["source"]["speculation"]["max_draft_len"] == 2
    assert result["source"]["speculation"]["draft_method"] == "greedy"  # --draft-method reaches the runtime's settings
    steps = list(_rows(result, "batched", "dflash")[0]["info"]["step_timing"])
    assert steps == ["2"] and result["identical_all"] is True
    # fixed:0: the DFlash runtime decoding plainly (its own overhead against the plain runtime)
    result, _ = _bench(tmp_path / "f0", *base, "--policy", "fixed:0")
    assert result["source"]["runtimes"] == ["batched"]
    d = _rows(result, "batched", "dflash")[0]
    assert d["total_draft_tokens"] == 0 and d["tau"] == 1.0 and list(d["info"]["step_timing"]) == ["0"]
    assert result["identical_all"] is True  # against the reference greedy decoding computed first (--check)
    # adaptive on the batched runtime alone: K caps every step's k
    result, _ = _bench(tmp_path / "ad", *base, "--max-draft-len", "3", "--policy", "adaptive", "--no-calibrate")
    assert result["source"]["speculation"]["policy"] == "adaptive" and result["identical_all"] is True
    assert max(r["total_draft_tokens"] / r["num_steps"] for r in result["requests"] if r["mode"] == "dflash") <= 3


def test_policies_side_by_side_against_one_plain_runtime(tiny_pair_dirs, tmp_path):
    """--policy fixed,schedule,adaptive: one plain runtime, each policy a DFlash side measured against
    it in the same run; the schedule side drafts what the schedule says at each batch size."""
    from dflash_trt.draft_len_schedule import DraftLenSchedule

    tdir, ddir = tiny_pair_dirs
    schedule = "1:7,2:2"  # 1 row drafts K = 7, 2 rows 2, 3 and more none (the tiny drafter's K = block 8 - 1)
    result, output = _bench(tmp_path, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "3",
                            "--max-new-tokens", "10", "--concurrency", "1,3", "--no-calibrate", "--no-plots",
                            "--policy", "fixed,schedule,adaptive", "--draft-len-schedule", schedule,
                            "--interactivity", "1")
    assert result["source"]["runtimes"] == ["batched"] and result["source"]["batched_policy"] == "fixed:7,schedule,adaptive"
    assert result["source"]["speculation"]["draft_len_schedule"] == {"1": 7, "2": 2}
    policies = ["batched fixed:7", "batched schedule", "batched adaptive"]
    assert [(r["concurrency"], r["side"], r["mode"]) for r in result["rows"]] == [
        (c, s, m) for c in (1, 3) for s, m in [("batched", "plain"), *((p, "dflash") for p in policies)]]
    for c in (1, 3):
        plain = next(r for r in _rows(result, "batched", "plain") if r["concurrency"] == c)
        for side in policies:
            d = next(r for r in _rows(result, side, "dflash") if r["concurrency"] == c)
            assert d["baseline"] == "batched" and d["info"]["policy"] == side.split()[1]
            assert d["dflash_over_plain"] == pytest.approx(d["total_tokens_per_s"] / plain["total_tokens_per_s"])
    want = DraftLenSchedule.parse(schedule)
    for r in _rows(result, "batched schedule"):
        timing = r["info"]["step_timing"]
        for k, t in timing.items():  # every step at one batch size: k is the schedule's there (or the budget's tail)
            if t["rows_mean"] == int(t["rows_mean"]):
                assert int(k) <= want.draft_len(int(t["rows_mean"])), (k, t)
        if r["concurrency"] == 3:
            assert timing["0"]["rows_mean"] == 3  # three rows: speculation off
        else:
            assert r["total_draft_tokens"] > 0 and "7" in timing and timing["7"]["rows_mean"] == 1
    fixed3 = next(r for r in _rows(result, "batched fixed:7") if r["concurrency"] == 3)
    assert fixed3["info"]["step_timing"].keys() >= {"7"}  # the fixed policy drafts at three rows all the same
    assert result["identical_all"] is True
    assert "Policies side by side" in output and "fixed:7" in output
    at = result["frontier"]["at"]  # each policy read against the one plain runtime; the plain side alone is not
    assert [e["side"] for e in at] == policies and all(e["plain"] is not None for e in at)


def test_tau_only_decodes_dflash_alone(tiny_pair_dirs, tmp_path):
    tdir, ddir = tiny_pair_dirs
    result, output = _bench(tmp_path, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2",
                            "--max-new-tokens", "8", "--tau-only", "--no-plots")
    assert {r["mode"] for r in result["rows"]} == {"dflash"} and {r["mode"] for r in result["requests"]} == {"dflash"}
    assert result["rows"][0]["dflash_over_plain"] is None and result["identical_all"] is None
    assert result["rows"][0]["per_position_acceptance"] is not None


def test_every_user_has_a_request_unless_num_requests_says(tiny_pair_dirs, tmp_path):
    """2 prompts at C=3: 3 requests cycling over them (3 users busy, not 2); --num-requests is taken as given."""
    tdir, ddir = tiny_pair_dirs
    base = ["--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2", "--max-new-tokens", "6", "--tau-only",
            "--runtime", "batched", "--no-calibrate", "--no-plots", "--concurrency", "1,3"]
    result, _ = _bench(tmp_path / "default", *base)
    assert {r["concurrency"]: r["num_requests"] for r in result["rows"]} == {1: 2, 3: 3}
    assert [r["prompt_id"] for r in result["requests"] if r["concurrency"] == 3].count(result["prompts"][0]["id"]) == 2
    result, _ = _bench(tmp_path / "given", *base, "--num-requests", "2")
    assert {r["concurrency"]: r["num_requests"] for r in result["rows"]} == {1: 2, 3: 2}


def test_repeated_rounds_alternate_which_mode_runs_first(tiny_pair_dirs, tmp_path):
    """With --repeats, every other round runs in reverse order, counted across levels: DFlash, listed
    first, does not always meet a level's shapes and memory first. Every run is kept beside the
    fastest, which is the one the row counts."""
    tdir, ddir = tiny_pair_dirs
    result, _ = _bench(tmp_path, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2",
                       "--max-new-tokens", "4", "--runtime", "batched", "--no-calibrate", "--no-plots",
                       "--concurrency", "1,2", "--repeats", "2")
    for row in result["rows"]:
        runs = row["info"]["runs"]
        first_round = {1: 0, 2: 2}[row["concurrency"]]
        assert [r["round"] for r in runs] == [first_round, first_round + 1]
        listed = 0 if row["mode"] == "dflash" else 1  # position when the round runs in listed order
        assert [r["position"] for r in runs] == [listed, 1 - listed], row["mode"]
        assert row["total_tokens_per_s"] == pytest.approx(max(r["tokens_per_s"] for r in runs), rel=1e-3)


def test_the_warm_up_does_not_teach_the_adaptive_policy(tiny_pair_dirs):
    """The warm-up drafts a few steps on a greeting before any cost is known; its acceptance is not
    the traffic the timed runs measure, so the policy starts them from its prior (kept, it made the
    first run at C = 1 decode 8 steps plainly before drafting, stop 53). Costs it measured stay."""
    from dflash_trt.bench.config import BenchConfig
    from dflash_trt.bench.run import _in_process_sides, load_bench_prompts
    from dflash_trt.runtime.batched.policy import AdaptivePolicy

    tdir, ddir = tiny_pair_dirs
    cfg = BenchConfig(target=str(tdir), draft=str(ddir), runtime=["batched"], num_prompts=1, concurrency=[1],
                      max_new_tokens=4, threads=1, calibrate=False)
    (side,), *_ = _in_process_sides(cfg, load_bench_prompts(cfg), lambda msg: None)
    side.warmup()
    policy = side.runtime("dflash").policy
    assert isinstance(policy, AdaptivePolicy) and any(d.k > 0 for d in policy.decisions)  # it did draft
    assert policy.position_acceptance() == AdaptivePolicy(policy.block_size).position_acceptance()
    assert policy.costs.known(0) or any(policy.costs.known(k) for k in policy.candidates)


def _rec(lengths: list[int], drafted: int, t_submit: float, t_first: float, t_end: float, n: int) -> RequestRecord:
    accepted = sum(lengths) - len(lengths)
    return RequestRecord(
        mode="dflash", concurrency=1, prompt_id="p", category="c", num_prompt_tokens=5, num_output_tokens=n,
        num_steps=len(lengths), total_draft_tokens=drafted, total_accepted_draft_tokens=accepted,
        tau=sum(lengths) / len(lengths), acceptance_rate=accepted / drafted if drafted else 0.0, t_submit=t_submit, t_first=t_first,
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


def test_summary_of_server_counters_and_failed_requests():
    """A server's pooled counters give tau where its responses carry none; a failed request is counted apart."""
    ok = _rec([1], drafted=0, t_submit=0.0, t_first=0.1, t_end=1.1, n=11)
    ok.acceptance_lengths, ok.num_steps, ok.total_draft_tokens, ok.position_drafted = None, 0, 0, None
    failed = RequestRecord(mode="dflash", concurrency=1, prompt_id="q", category="c", num_prompt_tokens=0,
                           num_output_tokens=0, num_steps=0, total_draft_tokens=0, total_accepted_draft_tokens=0,
                           tau=0.0, acceptance_rate=0.0, t_submit=0.0, t_first=5.0, t_end=5.0, queue_s=0.0,
                           finish_reason="error", error="HTTP 503")
    counters = {"num_drafts": 4, "total_draft_tokens": 60, "total_accepted_draft_tokens": 6,
                "position_accepted": [3, 2, 1], "position_drafted": [4, 4, 4]}
    s = summarize_records([ok, failed], counters)
    assert s["num_requests"] == 1 and s["errors"] == 1 and s["wall_s"] == pytest.approx(1.1)
    assert s["tau"] == pytest.approx(1 + 6 / 4) and s["acceptance_rate"] == pytest.approx(6 / 60)
    assert s["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s["acceptance_source"].startswith("server metrics")


def test_static_shapes_are_captured_before_the_timed_runs_and_reported(tiny_pair_dirs, tmp_path):
    """--cuda-graphs on a CPU: the batched runtime's static passes run eagerly through the graphs'
    dispatch. Every shape is captured when a side's runtime is built (reported with its time), and
    the timed runs, calibration included before them, capture and miss none."""
    tdir, ddir = tiny_pair_dirs
    result, output = _bench(tmp_path, "--target", str(tdir), "--draft", str(ddir), "--num-prompts", "2",
                            "--max-new-tokens", "8", "--concurrency", "1,2", "--runtime", "batched", "--cuda-graphs")
    assert result["identical_all"] is True
    for row in result["rows"]:
        info = row["info"]
        startup = info["startup"]["graphs"]
        assert startup["captured"] > 0 and startup["cuda_graphs"] is False
        run = info["graphs_in_run"]
        assert run["captured"] == 0 and run["misses"] == 0 and run["replays"] > 0
        assert run["eager_passes"]["prefill"] >= 1  # every request's prefill is eager
        assert info["decode_step_s"]["p50"] > 0
    assert "shapes set up at start-up" in output and "0 captured, 0 missed;" in output
