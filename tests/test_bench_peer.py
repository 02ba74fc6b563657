"""`dflash-trt bench` against the real vLLM peer (opt-in: needs `make peer`; `make test-peer` runs it).

1. ``--peer vllm``: our reference loop, our batched runtime and vLLM (enforce_eager, to load in
   ~1 min) in one run, one report: every row's output ids equal the reference loop's greedy
   decoding, vLLM's engine counters equal its per-request step records, each side keeps at most C
   requests in flight (the closed loop), and the ours/vLLM ratios are the rows' throughputs.
2. ``--url http://...``: `vllm serve` started from an engine's ``launch/vllm.sh`` in the peer's
   environment, measured by the OpenAI streaming client; its DFlash statistics come from the
   server's Prometheus counters, and they must equal what vLLM's offline engine counts for the
   same prompt ids (the same implementation), and its output ids (vLLM's ``return_token_ids``)
   the reference loop's.

Skipped, with the reason and `make peer`, where the peer environment is absent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.bench.peer_vllm import peer_missing_reason, peer_venv_dir
from dflash_trt.cli import main

pytestmark = [pytest.mark.peer, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(peer_missing_reason() is not None, reason=str(peer_missing_reason()))]

NUM_PROMPTS, MAX_NEW_TOKENS = 3, 32


def _bench(out: Path, *args: str) -> dict:
    res = CliRunner().invoke(main, ["bench", *args, "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens",
                                    str(MAX_NEW_TOKENS), "--no-progress", "--no-plots", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "bench.json").read_text())


def _max_in_flight(reqs: list[dict]) -> int:
    return max(sum(q["t_submit"] <= r["t_submit"] < q["t_end"] for q in reqs) for r in reqs)


def test_ours_and_vllm_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # one core per side on a shared machine
    result = _bench(tmp_path, "--peer", "vllm", "--vllm-mode", "eager", "--runtime", "reference,batched",
                    "--concurrency", "1,2", "--threads", "1")
    sides = ("reference", "batched", "vllm-eager")
    assert {(r["side"], r["mode"], r["concurrency"]) for r in result["rows"]} == {
        (s, m, c) for s in sides for m in ("dflash", "plain") for c in (1, 2)}
    assert result["identical_all"] is True and result["environment"]["versions"]["vllm"] == "0.32.0"
    for row in result["rows"]:
        assert row["identical"]["identical"] == row["identical"]["checked"] == NUM_PROMPTS
        reqs = [r for r in result["requests"]
                if (r["side"], r["mode"], r["concurrency"]) == (row["side"], row["mode"], row["concurrency"])]
        assert _max_in_flight(reqs) <= row["concurrency"]
        if row["side"] == "vllm-eager":
            assert row["vs_peer"] is None
            if row["mode"] == "dflash":
                assert row["info"]["counters_agree"] and row["info"]["engine"]["context_k_norm_fix"] == "applied"
                assert row["info"]["engine"]["num_speculative_tokens"] == 15
        else:
            peer = next(p for p in result["rows"] if (p["side"], p["mode"], p["concurrency"]) ==
                        ("vllm-eager", row["mode"], row["concurrency"]))
            assert row["vs_peer"] == pytest.approx(row["total_tokens_per_s"] / peer["total_tokens_per_s"])
    assert any(line.startswith("C=1: our fastest DFlash") for line in _report_lines(tmp_path))


def _report_lines(out: Path) -> list[str]:
    res = CliRunner().invoke(main, ["bench", "report", str(out / "bench.json"), "--markdown"])
    assert res.exit_code == 0, res.output
    return [ln.removeprefix("- ") for ln in res.output.splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """`vllm serve` from the embedded pair's engine directory (launch/vllm.sh), in the peer's environment."""
    import httpx

    engine = tmp_path_factory.mktemp("engine") / "embedded"
    res = CliRunner().invoke(main, ["build", "--quant", "none", "--gpu", "cpu", "--dtype", "float32",
                                    "--max-batch-size", "4", "--out", str(engine), "--no-progress"])
    assert res.exit_code == 0, res.output
    port = _free_port()
    log = open(tmp_path_factory.mktemp("vllm-serve") / "serve.log", "w")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")}
    env["PORT"] = str(port)
    proc = subprocess.Popen([str(peer_venv_dir() / "bin" / "peer-env"), "env", "VLLM_CPU_OMP_THREADS_BIND=0",
                             "VLLM_CPU_KVCACHE_SPACE=1", str(engine / "launch" / "vllm.sh"), "--dtype", "float32",
                             "--enforce-eager"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"vllm serve exited {proc.returncode}; see {log.name}"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not ready in 600 s; see {log.name}"
            time.sleep(3)
        yield url, engine
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()


def test_openai_endpoint_figures_come_from_the_servers_counters(vllm_server, tmp_path):
    from dflash_trt.bench.peer_vllm import PeerSettings, VllmEngine, encode_bench_prompts
    from dflash_trt.bench.prompts import from_categories
    from dflash_trt.pairs import PairSource, load_pair

    url, engine = vllm_server
    result = _bench(tmp_path, "--url", url, "--concurrency", "1")
    assert result["source"]["protocol"] == "openai" and result["source"]["model"] == "./target"
    (row,) = result["rows"]
    assert row["acceptance_source"] == "server metrics (pooled over the run)" and row["errors"] == 0

    pair = load_pair(PairSource(engine=engine))
    prompts = encode_bench_prompts(pair.codec, from_categories(["code", "math", "chat"])[:NUM_PROMPTS])
    settings = PeerSettings(target=engine / "target", draft=engine / "draft", enforce_eager=True,
                            max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=list(pair.codec.stop_token_ids))
    offline = VllmEngine("dflash", settings, prompts[0].prompt_ids, tmp_path / "offline.log", progress=False)
    try:
        run = offline.run(prompts, 1)
    finally:
        offline.close()
    c = run.counters
    assert row["num_steps"] == c["vllm:spec_decode_num_drafts"]
    assert row["total_draft_tokens"] == c["vllm:spec_decode_num_draft_tokens"]
    assert row["total_accepted_draft_tokens"] == c["vllm:spec_decode_num_accepted_tokens"]
    assert row["tau"] == pytest.approx(1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"])
    per_pos = c["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert row["per_position_acceptance"] == pytest.approx([a / c["vllm:spec_decode_num_drafts"] for a in per_pos])
    # the server applied the chat template itself: same prompt ids, so the same greedy output ids
    served = {r["prompt_id"]: r["output_ids"] for r in result["requests"]}
    assert served == {p.id: r.output_ids for p, r in zip(prompts, run.records)}
