"""bench/steady.py: total tokens/s while all C requests decode, against the whole run's figure that
ends in a drain (rows finishing on different steps under DFlash)."""

from __future__ import annotations

import pytest

from dflash_trt.bench.runners import RequestRecord
from dflash_trt.bench.steady import full_batch_windows, steady_tokens_per_s
from dflash_trt.bench.summary import _ratios, summarize_records


def _req(t_first: float, t_end: float, n: int, mode: str = "dflash") -> RequestRecord:
    return RequestRecord(mode=mode, concurrency=4, prompt_id="p", category="c", num_prompt_tokens=5,
                         num_output_tokens=n, num_steps=n, total_draft_tokens=0, total_accepted_draft_tokens=0,
                         tau=1.0, acceptance_rate=0.0, t_submit=0.0, t_first=t_first, t_end=t_end, queue_s=0.0,
                         finish_reason="length")


def test_a_draining_batch_is_read_while_it_is_full():
    """Four rows: two finish at 5 s (20 tokens/s each), two at 10 s (10 tokens/s each). While all four
    decode the batch makes 60 tokens/s; the whole run's 404 tokens over 10 s read 40.4."""
    rows = [_req(0.0, 5.0, 101), _req(0.0, 5.0, 101), _req(0.0, 10.0, 101), _req(0.0, 10.0, 101)]
    assert full_batch_windows(rows, 4) == [(0.0, 5.0)]
    assert steady_tokens_per_s(rows, 4) == pytest.approx(60.0)
    assert summarize_records(rows)["total_tokens_per_s"] == pytest.approx(40.4)


def test_the_window_opens_when_the_last_request_has_its_first_token():
    """Staggered prefills: the full batch starts at the last first token (2 s), and each row's tokens
    are counted pro rata of its own decode time (row 1: 100 tokens over 8 s, 6 of them in the window)."""
    rows = [_req(0.0, 8.0, 101), _req(2.0, 8.0, 61)]
    assert full_batch_windows(rows, 2) == [(2.0, 8.0)]
    assert steady_tokens_per_s(rows, 2) == pytest.approx((100 * 6 / 8 + 60) / 6)


def test_requests_that_never_overlap_have_no_steady_figure():
    assert steady_tokens_per_s([_req(0.0, 1.0, 11), _req(1.0, 2.0, 11)], 2) is None
    assert steady_tokens_per_s([_req(0.0, 1.0, 11)], 2) is None


def test_a_users_next_request_refills_the_batch_after_its_prefill():
    """Closed loop: a user's next request decodes once its prefill is done (0.5 s here), so the batch
    is full again from its first token; the prefill's half second is outside the windows."""
    rows = [_req(0.0, 3.0, 31), _req(3.5, 6.5, 31), _req(0.0, 6.0, 61)]  # 10 tokens/s each
    assert full_batch_windows(rows, 2) == [(0.0, 3.0), (3.5, 6.0)]
    assert steady_tokens_per_s(rows, 2) == pytest.approx(20.0)


def test_steady_ratio_is_dflash_over_its_plain_decoding():
    """The whole run reads DFlash below plain (its batch drained); while full, DFlash is 1.5x plain."""
    dflash = [_req(0.0, 5.0, 151), _req(0.0, 10.0, 151)]  # 30 + 15 tokens/s while both decode
    plain = [_req(0.0, 10.0, 151), _req(0.0, 10.0, 151)]  # 15 + 15
    rows = []
    for mode, recs in (("dflash", dflash), ("plain", plain)):
        rows.append({"side": "batched", "baseline": "batched", "mode": mode, "concurrency": 2,
                     **summarize_records(recs), "steady_tokens_per_s": steady_tokens_per_s(recs, 2)})
    _ratios(rows)
    assert rows[0]["dflash_over_plain"] == pytest.approx(1.0)
    assert rows[0]["steady_dflash_over_plain"] == pytest.approx(45 / 30)
    assert rows[1]["steady_dflash_over_plain"] is None
