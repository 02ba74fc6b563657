"""Bad input to `dflash-trt bench` (and `bench report`) is one actionable line and a non-zero exit,
before any model loads."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

from dflash_trt.bench.prompts import BenchPrompt, from_jsonl
from dflash_trt.cli import main

pytestmark = pytest.mark.timeout(60)


def _fails(args: list[str], *needles: str) -> str:
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code != 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_missing_prompts_file(tmp_path):
    _fails(["--prompts", str(tmp_path / "nope.jsonl")], "nope.jsonl", "not found", '{"prompt"')


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', "not an object"),
    ('{"text": "no prompt key"}', 'no "prompt"'),
    ('{"messages": [{"role": "user"}]}', 'messages[0] needs string "role" and "content"'),
    ('{"prompt": ""}', "non-empty string"),
])
def test_malformed_jsonl_line_names_the_line(tmp_path, line, why):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + line + "\n")
    _fails(["--prompts", str(f)], "line 3", why)


def test_empty_prompts_file(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n")
    _fails(["--prompts", str(f)], "has no prompts")


def test_unknown_category():
    _fails(["--category", "code,poetry"], "'poetry'", "code, math, chat")


def test_unreachable_url():
    with socket.socket() as s:  # a port nobody listens on: bound, then released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails(["--url", f"127.0.0.1:{port}", "--num-prompts", "1"], f"127.0.0.1:{port}", "--url")


@pytest.mark.parametrize("args, needle", [
    (["--url", "127.0.0.1:1", "--target", "x", "--draft", "y"], "drop --target/--draft"),
    (["--url", "127.0.0.1:1", "--engine", "nowhere"], "not a dflash-trt engine directory"),
    (["--gpus", "2"], "--gpus counts the GPUs behind a server"),
    (["--url", "127.0.0.1:1", "--gpus", "0"], "--gpus"),
    (["--interactivity", "20,0"], "> 0"),
    (["--interactivity", "fast"], "comma-separated numbers"),
    (["--target", "x"], "both --target and --draft"),
    (["--plain-url", "127.0.0.1:1"], "add --url"),
    (["--concurrency", "0,2"], ">= 1"),
    (["--concurrency", "a,b"], "comma-separated"),
    (["--gpu", "tpu9"], "unknown gpu"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--policy", "fixed:x"], "use adaptive, schedule"),
    (["--policy", "greedy"], "use adaptive, schedule"),
    (["--runtime", "reference,fast"], "'fast' is not a runtime"),
    (["--runtime", "reference", "--policy", "adaptive"], "add --runtime batched"),
    (["--runtime", "reference,batched", "--policy", "fixed:0"], "needs --runtime batched"),
    (["--policy", "fixed:3", "--max-draft-len", "4"], "disagree"),
    (["--policy", "fixed,adaptive,fixed"], "names a policy twice"),
    (["--runtime", "reference", "--policy", "schedule"], "add --runtime batched"),
    (["--policy", "schedule", "--draft-len-schedule", "4-3"], "is not BATCH:DRAFT_LEN"),
    (["--policy", "adaptive", "--draft-len-schedule", "1:7,4:2"], "add schedule to --policy"),
    (["--url", "127.0.0.1:1", "--draft-len-schedule", "1:7"], "in process only"),
    (["--url", "127.0.0.1:1", "--peer", "vllm"], "in process only"),
    (["--url", "127.0.0.1:1", "--draft-method", "greedy"], "in process only"),
    (["--draft-method", "beam"], "'beam' is not one of"),
    (["--peer", "vllm", "--temperature", "0.7"], "greedy"),
    (["--peer", "vllm", "--tau-only"], "drop --peer"),
    (["--metrics-url", "http://127.0.0.1:1/metrics"], "OpenAI endpoint"),
    (["--url", "http://127.0.0.1:1", "--plain-url", "127.0.0.1:2"], "must speak what --url speaks"),
])
def test_conflicting_or_invalid_options(args, needle):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code != 0 and needle in res.output and "Traceback" not in res.output, res.output


def test_config_file_unknown_key_and_flag_override(tmp_path):
    from dflash_trt.bench.config import resolve_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("max_new_tokens: 8\nmax_new_tokenz: 9\n")
    _fails(["--config", str(bad)], "unknown key 'max_new_tokenz' (did you mean 'max_new_tokens'?)", str(bad))
    good = tmp_path / "good.yaml"
    good.write_text("max-new-tokens: 8\nconcurrency: [4, 1]\n")
    cfg = resolve_config(str(good), {"max_new_tokens": 16, "concurrency": None})
    assert cfg.max_new_tokens == 16 and cfg.concurrency == [1, 4]  # the flag wins; levels sorted


def test_jsonl_prompt_forms(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a", "id": "x", "category": "code"}) + "\n"
                 + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) + "\n")
    a, b = from_jsonl(f)
    assert a == BenchPrompt("x", "code", (("user", "a"),)) and a.single_user_text == "a"
    assert b.id == "p-2" and b.single_user_text is None and b.messages[1] == ("user", "u")


def test_absent_peer_is_one_line_before_loading_the_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("PEER_VENV", str(tmp_path / "nowhere"))
    _fails(["--peer", "vllm", "--target", str(tmp_path / "no-target"), "--draft", str(tmp_path / "no-draft")],
           "the vLLM peer is not set up", "make peer")


def test_unreachable_openai_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails(["--url", f"http://127.0.0.1:{port}", "--num-prompts", "1"], f"http://127.0.0.1:{port}", "fix --url")


@pytest.mark.parametrize("content, needle", [
    (None, "not found"),
    ("{not json", "is not JSON"),
    ('{"schema_version": 1, "sweep": []}', "schema 1"),
])
def test_report_of_a_bad_file(tmp_path, content, needle):
    f = tmp_path / "bench.json"
    if content is not None:
        f.write_text(content)
    res = CliRunner().invoke(main, ["bench", "report", str(f)])
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert res.exit_code != 0 and len(lines) == 1 and needle in lines[0] and "Traceback" not in res.output, res.output
