"""bench/steady.py: total tokens/s while all C requests decode, counted from each request's per-step
progress, against the whole run's figure that ends in a drain (rows finishing on different steps
under DFlash)."""

from __future__ import annotations

import pytest

from dflash_trt.bench.runners import RequestRecord
from dflash_trt.bench.steady import full_batch_windows, steady_tokens_per_s
from dflash_trt.bench.summary import _ratios, summarize_records


def _req(t_first: float, paces: list[tuple[float, int]], step_s: float = 0.5, mode: str = "dflash",
         progress: bool = True) -> RequestRecord:
    """A request whose first token comes at t_first, then one step every step_s committing tokens at
    `paces` [(until, tokens/s), ...]: its progress, as the batched runtime records it."""
    i, n, t, steps = 0, 1, t_first, [(t_first, 1)]
    for until, rate in paces:
        while round(t_first + (i + 1) * step_s, 6) <= until:
            i += 1
            t = round(t_first + i * step_s, 6)
            n += int(rate * step_s)
            steps.append((t, n))
    return RequestRecord(mode=mode, concurrency=4, prompt_id="p", category="c", num_prompt_tokens=5,
                         num_output_tokens=n, num_steps=len(steps), total_draft_tokens=0,
                         total_accepted_draft_tokens=0, tau=1.0, acceptance_rate=0.0, t_submit=0.0,
                         t_first=t_first, t_end=t, queue_s=0.0, finish_reason="length",
                         progress=steps if progress else None)


def test_a_draining_batch_is_read_while_it_is_full():
    """Four rows: two finish at 5 s (20 tokens/s each), two at 10 s (10 tokens/s each). While all four
    decode the batch makes 60 tokens/s; the whole run's 404 tokens over 10 s read 40.4."""
    rows = [_req(0.0, [(5.0, 20)]), _req(0.0, [(5.0, 20)]), _req(0.0, [(10.0, 10)]), _req(0.0, [(10.0, 10)])]
    assert full_batch_windows(rows, 4) == [(0.0, 5.0)]
    assert steady_tokens_per_s(rows, 4) == pytest.approx(60.0)
    assert summarize_records(rows)["total_tokens_per_s"] == pytest.approx(404 / 10)


def test_a_rows_faster_tail_is_not_credited_to_the_full_batch():
    """The slow row makes 8 tokens/s while the batch is full and 30 once the fast row has left (a
    smaller batch steps faster). Counted by step: 20 + 8 tokens/s in the window; spread pro rata
    over its decode time it would read 20 + 100/7."""
    rows = [_req(0.0, [(5.0, 20)]), _req(0.0, [(5.0, 8), (7.0, 30)])]
    assert steady_tokens_per_s(rows, 2) == pytest.approx(28.0)


def test_the_window_opens_after_the_last_request_s_first_token():
    """Staggered prefills: the full batch starts at the last first token (2 s); that token, the
    prefill's, is not a decoding step of the full batch."""
    rows = [_req(0.0, [(8.0, 10)]), _req(2.0, [(8.0, 10)])]
    assert full_batch_windows(rows, 2) == [(2.0, 8.0)]
    assert steady_tokens_per_s(rows, 2) == pytest.approx(20.0)


def test_without_progress_or_overlap_there_is_no_steady_figure():
    assert steady_tokens_per_s([_req(0.0, [(1.0, 10)]), _req(1.0, [(2.0, 10)])], 2) is None  # never both at once
    assert steady_tokens_per_s([_req(0.0, [(1.0, 10)])], 2) is None
    assert steady_tokens_per_s([_req(0.0, [(1.0, 10)], progress=False), _req(0.0, [(1.0, 10)])], 2) is None


def test_a_users_next_request_refills_the_batch_after_its_prefill():
    """Closed loop: a user's next request decodes once its prefill is done (0.5 s here), so the batch
    is full again from its first token; the prefill's half second is outside the windows."""
    rows = [_req(0.0, [(3.0, 10)]), _req(3.5, [(6.5, 10)]), _req(0.0, [(6.0, 10)])]
    assert full_batch_windows(rows, 2) == [(0.0, 3.0), (3.5, 6.0)]
    assert steady_tokens_per_s(rows, 2) == pytest.approx(20.0)


def test_steady_ratio_is_dflash_over_its_plain_decoding():
    """The whole run reads DFlash at plain's pace (its batch drained); while full, DFlash is 1.5x plain."""
    dflash = [_req(0.0, [(5.0, 32)]), _req(0.0, [(10.0, 16)])]  # 48 tokens/s while both decode
    plain = [_req(0.0, [(10.0, 16)]), _req(0.0, [(10.0, 16)])]  # 32
    rows = []
    for mode, recs in (("dflash", dflash), ("plain", plain)):
        rows.append({"side": "batched", "baseline": "batched", "mode": mode, "concurrency": 2,
                     **summarize_records(recs), "steady_tokens_per_s": steady_tokens_per_s(recs, 2)})
    _ratios(rows)
    assert rows[0]["dflash_over_plain"] == pytest.approx(1.0)
    assert rows[0]["steady_dflash_over_plain"] == pytest.approx(48 / 32)
    assert rows[1]["steady_dflash_over_plain"] is None
