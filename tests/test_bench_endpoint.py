"""`dflash-trt bench --url` against the real tritonserver serving the project's repository (real
tritonclient over loopback) and the OpenAI front beside it: the same prompts give the same tau,
token counts and acceptance as the in-process run, since tau does not depend on the transport, and
each request's latency splits into the server's queue, its decoding and the rest (server
overhead). The session's decoupled server (tests/conftest.py `triton_streaming`) is pinned to the
reference loop's schedule (policy fixed: K drafts every step); the serving default, adaptive, picks
k from MEASURED step times, so its tau would depend on machine load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from tests.engine_fixtures import shared_tiny_engine

pytestmark = pytest.mark.timeout(240)

ARGS = ["--num-prompts", "4", "--max-new-tokens", "24", "--no-plots"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return shared_tiny_engine(tmp_path_factory)


@pytest.fixture(scope="module")
def server(triton_streaming):
    return triton_streaming


@pytest.fixture(scope="module")
def url(server):
    return server.grpc_url


def _bench(tmp_path, name, *args) -> dict:
    out = tmp_path / name
    res = CliRunner().invoke(main, ["bench", *args, *ARGS, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "bench.json").read_text())


def test_endpoint_tau_equals_in_process(engine, url, tmp_path):
    remote = _bench(tmp_path, "remote", "--url", url, "--concurrency", "1,2")
    local = _bench(tmp_path, "local", "--engine", str(engine))
    assert remote["source"]["kind"] == "endpoint" and remote["source"]["protocol"] == "triton_grpc"
    assert remote["source"]["sides"] == [{"name": "endpoint", "label": "endpoint (Triton gRPC)", "parallel": True,
                                          "modes": ["dflash"]}]
    # the endpoint has no plain-decoding baseline without --plain-url: no made-up speedup
    assert {row["mode"] for row in remote["rows"]} == {"dflash"}
    assert all(row["speedup"] is None and row["dflash_over_plain"] is None for row in remote["rows"])
    here = {r["prompt_id"]: r for r in local["requests"] if r["mode"] == "dflash"}
    for r in remote["requests"]:
        mine = here[r["prompt_id"]]
        # tau travels as FP32 (config.pbtxt); everything else is an exact count
        assert r["tau"] == float(np.float32(mine["tau"]))
        for key in ("num_output_tokens", "num_steps", "total_draft_tokens", "total_accepted_draft_tokens"):
            assert r[key] == mine[key], key
        # the per-position counts travel as the model's position_drafted / position_accepted outputs
        assert (r["position_drafted"], r["position_accepted"]) == (mine["position_drafted"], mine["position_accepted"])
    mine = next(r for r in local["rows"] if r["mode"] == "dflash")
    for row in remote["rows"]:
        assert row["tau"] == pytest.approx(mine["tau"], rel=1e-6)
        assert row["num_steps"] == mine["num_steps"]
        assert row["per_position_acceptance"] == pytest.approx(mine["per_position_acceptance"])
        # latency = the server's queue + its decoding + the rest (gRPC, the Python backend stub's IPC)
        assert row["server_decode_s"]["mean"] > 0 and row["server_overhead_s"]["mean"] > -1e-3
    # client-side timestamps keep the same relations as in process
    for r in remote["requests"]:
        assert r["tpot_s"] == pytest.approx((r["t_end"] - r["t_first"]) / (r["num_output_tokens"] - 1))
        assert r["t_submit"] <= r["t_first"] <= r["t_end"]
        assert 0 < r["server_decode_s"] <= r["latency_s"] - r["queue_s"] + 1e-3
    assert remote["ceiling"]["tau_bound_speedup"] == remote["rows"][0]["tau"]
    assert remote["ceiling"]["measured_speedup"] is None


def test_a_multi_turn_prompt_travels_as_messages_and_matches_in_process(engine, url, tmp_path):
    """A conversation goes to the model as text_input_format "messages" (its chat template applied
    there, as in process): the same prompt tokens, output tokens and tau as the in-process run."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}]}) + "\n")
    args = ["--prompts", str(f), "--max-new-tokens", "12", "--no-plots"]
    remote = json.loads(_run(tmp_path, "remote", "--url", url, *args))
    local = json.loads(_run(tmp_path, "local", "--engine", str(engine), *args))
    (r,) = [x for x in remote["requests"] if x["mode"] == "dflash"]
    (mine,) = [x for x in local["requests"] if x["mode"] == "dflash"]
    assert not r.get("error")
    for key in ("num_prompt_tokens", "num_output_tokens", "num_steps", "total_accepted_draft_tokens"):
        assert r[key] == mine[key], key


def _run(tmp_path, name, *args) -> str:
    out = tmp_path / name
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return (out / "bench.json").read_text()


@pytest.mark.parametrize("protocol", ["triton", "openai"])
def test_frontier_against_a_server_with_a_plain_url(server, engine, protocol, tmp_path):
    """The frontier at an endpoint, both protocols: --plain-url gives the plain side (here the same
    server: what it runs does not matter to the maths), --engine the GPU count (the tiny engine's
    tp x pp = 1), --gpus overrides it; each point divides the run's throughput by it, and
    --interactivity reads both modes at an X inside the measured range and one above it."""
    url = server.grpc_url if protocol == "triton" else server.openai_base
    args = ["--url", url, "--plain-url", url, "--concurrency", "1,2"]
    first = _bench(tmp_path, "engine", *args, "--engine", str(engine))
    front = first["frontier"]
    assert (front["gpus"], front["gpus_source"]) == (1, "the engine's manifest: tp 1 x pp 1")
    assert {(s["mode"], len(s["points"])) for s in front["series"]} == {("dflash", 2), ("plain", 2)}
    result = _bench(tmp_path, "gpus", *args, "--gpus", "4", "--interactivity", "1e9")
    front = result["frontier"]
    assert (front["gpus"], front["gpus_source"]) == (4, "--gpus") and front["throughput"] == "total tokens/s per GPU"
    for s in front["series"]:
        for p in s["points"]:
            row = next(r for r in result["rows"] if r["mode"] == s["mode"] and r["concurrency"] == p["concurrency"])
            assert p["throughput"] == pytest.approx(row["total_tokens_per_s"] / 4)
            assert p["interactivity"] == pytest.approx(1 / row["tpot_s"]["mean"])
    (above,) = front["at"]
    assert above["dflash"]["how"] == above["plain"]["how"] == "never" and above["dflash_over_plain"] is None
    # an X inside this run's own measured interactivities, read again from its bench.json
    xs = [p["interactivity"] for s in front["series"] for p in s["points"]]
    from dflash_trt.bench.report import with_targets

    (inside,) = with_targets(result, [(min(xs) + max(xs)) / 2])["frontier"]["at"]
    reached = [inside[m] for m in ("dflash", "plain") if inside[m]["throughput"] is not None]
    assert reached and all(r["throughput"] > 0 for r in reached)
    if len(reached) == 2:
        assert inside["dflash_over_plain"] == pytest.approx(reached[0]["throughput"] / reached[1]["throughput"])
