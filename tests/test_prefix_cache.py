"""Prefix caching in the batched runtime (runtime/batched/prefix_cache.py): lossless, acceptance kept, bounded.

1. The cache itself: chained block hashes (a block's name covers everything before it), the last
   prompt token always computed, LRU eviction that never takes the chain being inserted, a budget
   below one block refused in one line, a request never failing because the cache is full.
2. On tiny float64 pairs, requests sent one after another so the later ones hit what the earlier
   ones cached (a shared prefix ending mid-block, and exactly at a block boundary): every request's
   tokens AND per-step acceptance equal the reference loop's (runtime/reference/generate.py), greedy on the
   rigged pairs of test_batched_dflash2 (long accepted runs: DFlash2, v1 with the newer fields) and
   seeded sampling with every draft method; the prompt tokens served from the cache are what the
   blocks say.
3. The drafter keeps its context: after a hit its cache holds, for every prompt position, the
   context K/V a run without the cache computes (the rigged drafters ignore their context, so
   acceptance alone would not show a hit that skipped it; a random drafter's K/V do).
4. A prompt that hits a cached prefix and then fails (too long; sampling values with no
   distribution) leaves the cache as it was: the same blocks in the same LRU order, the same counters.
5. Bit for bit: with the panel kernel (batch-invariant linear layers), a prompt prefilled after its
   cached prefix leaves the same K/V and features as its whole prefill.

The embedded pair's check (the same identities on SmolLM2 and the trained drafter) is
tests/test_embedded_prefix_cache.py.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
from dflash_trt.runtime.batched.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DRAFT_METHODS, SpeculationSettings

from tests.test_batched_dflash2 import rigged_pair

BT = BLOCK_TOKENS
SYSTEM = [(7 * i + 3) % 97 + 1 for i in range(2 * BT + 6)]  # two full blocks and 6 tokens
# (prompts in the order they arrive, the prompt tokens each must find cached)
SHARED = {
    # the shared prefix (70 tokens) ends mid-block: its two full blocks are reused, the rest computed
    "mid-block": ([SYSTEM + [11, 12, 13], SYSTEM + [21, 22], SYSTEM[:40] + [5]], [0, 2 * BT, BT]),
    # it ends exactly at a block boundary (64); a prompt of exactly 64 tokens recomputes its last block
    "boundary": ([SYSTEM[:2 * BT] + [5, 6], SYSTEM[:2 * BT] + [8], SYSTEM[:2 * BT]], [0, 2 * BT, BT]),
}


def runtime(target, draft, mib: float = 8.0, spec=None, extras=RuntimeExtras(), max_batch: int = 2) -> BatchedRuntime:
    return BatchedRuntime(target, draft, RuntimeOptions(max_batch=max_batch, max_seq_len=256, prefix_cache_mib=mib),
                          spec, extras).start()


def one_after_another(rt: BatchedRuntime, prompts, params) -> list:
    """Each request alone, after the previous one finished (what a conversation's turns do)."""
    out = []
    for p, sp in zip(prompts, params):
        h = rt.add(SequenceRequest(list(p), sp))
        rt.run()
        assert h.error is None, h.error
        out.append(h.result)
    return out


# -- 1. the cache ----------------------------------------------------------------------------------
def test_a_blocks_hash_names_everything_before_it():
    a, b = list(range(1, 1 + BT)), list(range(100, 100 + BT))
    ha, hb = block_hashes(a + b), block_hashes(b)
    assert len(ha) == 2 and len(hb) == 1
    assert ha[1] != hb[0]  # the same tokens after another prefix: another block
    assert block_hashes(a + b + [7] * (BT - 1)) == ha  # only full blocks are named
    assert block_hashes(a + b, parent=ha[0], first=1) == [ha[1]]  # continuing a chain from its last block


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(10 * 100, 100)
    tokens = list(range(2 * BT))
    cache.lru.update({h: i for i, h in enumerate(block_hashes(tokens))})  # both blocks cached
    assert len(cache.lookup(tokens).blocks) == 1  # 64 tokens: the second block holds the last one
    assert len(cache.lookup(tokens + [1]).blocks) == 2
    assert cache.lookup(tokens[:BT]).blocks == []


def test_a_budget_below_one_block_is_one_line_at_start_up():
    target, draft = tiny_target("llama", seed=1), None
    draft = random_draft(target.config, block_size=8, seed=3)
    with pytest.raises(DFlashError) as err:
        runtime(target, draft, mib=0.01)
    msg = str(err.value)
    assert "\n" not in msg and "cannot hold one block" in msg and "--prefix-cache-mib" in msg


def test_a_full_cache_evicts_the_least_recently_used_never_the_chain_being_inserted_and_never_fails():
    """Capacity 4 blocks. A's prompt (2 blocks) is cached; B repeats it and adds 3 blocks: the insert
    refreshes A's two, adds two, and stops -- evicting A's first block would orphan every block after
    it. C then evicts the least recently used blocks (B's tail first), and every request decodes."""
    target = tiny_target("llama", seed=1).double()
    draft = random_draft(target.config, block_size=8, seed=3).double()
    rt = runtime(target, draft)
    block_bytes = rt.prefix_cache.block_bytes
    rt = runtime(target, draft, mib=4.5 * block_bytes / 2**20)
    assert rt.prefix_cache.capacity == 4
    a = SYSTEM[: 2 * BT] + [1]
    b = SYSTEM[: 2 * BT] + [(3 * i) % 90 + 2 for i in range(3 * BT)] + [1]
    c = [(5 * i) % 80 + 9 for i in range(2 * BT)] + [1]
    params = SamplingParams(max_tokens=4)
    one_after_another(rt, [a, b], [params] * 2)
    assert len(rt.prefix_cache) == 4
    again = one_after_another(rt, [b], [params])[0]
    assert again.stats.num_cached_tokens == 4 * BT  # A's two blocks and two of B's: the chain held
    one_after_another(rt, [c], [params])  # two blocks evicted for C's: the chain's tail first
    assert one_after_another(rt, [a], [params])[0].stats.num_cached_tokens == 2 * BT
    assert rt.prefix_cache.counters.evicted_blocks >= 2


# -- 2. lossless, acceptance kept ------------------------------------------------------------------
@pytest.mark.parametrize("shared", list(SHARED))
@pytest.mark.parametrize("case", ["dflash2", "v1+fields"])
def test_greedy_tokens_and_steps_equal_the_reference_loops_with_hits(case, shared):
    target, draft = rigged_pair(case)
    prompts, cached = SHARED[shared]
    params = [SamplingParams(max_tokens=m) for m in (30, 24, 17)]
    ref = [dflash_generate(draft, target, p, sp) for p, sp in zip(prompts, params)]
    assert sum(sum(r.stats.acceptance_lengths) for r in ref) > 2 * sum(r.stats.num_steps for r in ref)  # accepted runs
    got = one_after_another(runtime(target, draft), prompts, params)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert [g.stats.acceptance_lengths for g in got] == [r.stats.acceptance_lengths for r in ref]
    assert [g.stats.num_cached_tokens for g in got] == cached
    assert [g.stats.num_reused_blocks for g in got] == [c // BT for c in cached]
    assert [g.stats.num_missed_blocks for g in got] == [-(-len(p) // BT) - c // BT for p, c in zip(prompts, cached)]


def test_a_conversations_next_turn_reuses_the_answer_too():
    """Turn 2 = turn 1's prompt + its answer + more: the answer's full blocks come from the cache."""
    target, draft = rigged_pair("v1+fields")
    first = SYSTEM + [11, 12]
    turn1 = dflash_generate(draft, target, first, SamplingParams(max_tokens=40))
    second = first + turn1.output_ids + [31, 32, 33]
    ref = dflash_generate(draft, target, second, SamplingParams(max_tokens=20))
    rt = runtime(target, draft)
    got = one_after_another(rt, [first, second], [SamplingParams(max_tokens=40), SamplingParams(max_tokens=20)])
    assert got[0].output_ids == turn1.output_ids
    assert got[1].output_ids == ref.output_ids and got[1].stats.acceptance_lengths == ref.stats.acceptance_lengths
    assert got[1].stats.num_cached_tokens == (len(first) + len(turn1.output_ids) - 1) // BT * BT > len(first)


@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("case", ["dflash2", "v1+fields"])
def test_seeded_sampling_with_hits_draws_what_the_reference_loop_draws(case, method):
    target, draft = rigged_pair(case)
    spec = SpeculationSettings.for_block(draft.block_size, draft_method=method)
    prompts, cached = SHARED["mid-block"]
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=40 + i)
              for i, m in enumerate((25, 20, 15))]
    ref = [dflash_generate(draft, target, p, sp, spec) for p, sp in zip(prompts, params)]
    got = one_after_another(runtime(target, draft, spec=spec), prompts, params)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert [g.stats.acceptance_lengths for g in got] == [r.stats.acceptance_lengths for r in ref]
    assert [g.stats.num_cached_tokens for g in got] == cached


def test_hits_in_a_running_batch_decode_as_the_reference_loop():
    """Requests joining a batch that decodes (max_batch 3), several of them hitting at once."""
    target, draft = rigged_pair("dflash2")
    prompts = [SYSTEM + [i, i + 1] for i in range(1, 7)]
    budgets = [9, 25, 14, 30, 11, 20]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, budgets)]
    rt = runtime(target, draft, max_batch=3)
    one_after_another(rt, [SYSTEM + [99]], [SamplingParams(max_tokens=2)])  # caches the shared blocks
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=m))) for p, m in zip(prompts, budgets)]
    rt.run()
    assert [h.result.output_ids for h in handles] == [r.output_ids for r in ref]
    assert [h.result.stats.acceptance_lengths for h in handles] == [r.stats.acceptance_lengths for r in ref]
    assert all(h.result.stats.num_cached_tokens == 2 * BT for h in handles)


# -- 3. the drafter keeps its context --------------------------------------------------------------
def _after_first_draft(rt: BatchedRuntime, prompt: list[int]):
    """Prefill `prompt` and run the first drafting step; (its slot, drafter K/V of layer 0 [kv, P, hd])."""
    h = rt.add(SequenceRequest(prompt, SamplingParams(max_tokens=30)))
    rt.step()  # prefill
    rt.step()  # the first draft consumes the prompt's context (the part not cached)
    kv = rt.draft_cache.kv
    return h, kv.keys[0][h.slot, :, : len(prompt)].clone(), kv.values[-1][h.slot, :, : len(prompt)].clone()


OTHER = [(5 * i) % 80 + 9 for i in range(2 * BT + 6)]  # shares nothing with SYSTEM


def warmed(target, draft, max_tokens: int = 3) -> BatchedRuntime:
    """A runtime whose cache holds SYSTEM's two blocks, and whose slots were overwritten since by
    another prompt (a hit must copy everything it needs: the slot's leftovers are another request's)."""
    rt = runtime(target, draft)
    one_after_another(rt, [SYSTEM + [7], OTHER], [SamplingParams(max_tokens=max_tokens), SamplingParams(max_tokens=3)])
    return rt


def test_a_hit_leaves_the_drafter_the_context_k_v_of_every_prompt_position():
    target = tiny_target("qwen3", seed=2).double()
    draft = random_draft(target.config, block_size=8, seed=5).double()
    prompt = SYSTEM + [40, 41, 42]
    plain = runtime(target, draft, mib=8.0)
    _, k_ref, v_ref = _after_first_draft(plain, prompt)
    warm = warmed(target, draft)
    h, k, v = _after_first_draft(warm, prompt)
    assert h.stats.num_cached_tokens == 2 * BT
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-12)
    warm.run()
    plain.run()


def test_a_blind_drafter_attends_to_nothing_before_its_floor_and_changes_no_token():
    """context_recompute_tail = N (the measurement of scripts/context_recompute_tail.py): after a hit
    of c tokens the drafter's pass ignores whatever its cache holds before c - N (garbage there
    changes nothing), while with its floor at 0 it reads it; the tokens stay the target's."""
    from dflash_trt.runtime.batched.scheduling import row_table

    target = tiny_target("qwen3", seed=2).double()
    draft = random_draft(target.config, block_size=8, seed=5).double()
    prompt = SYSTEM + [40, 41, 42]
    ref = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=20))
    rt = runtime(target, draft, extras=RuntimeExtras(context_recompute_tail=16))
    one_after_another(rt, [SYSTEM + [7]], [SamplingParams(max_tokens=3)])
    h = rt.add(SequenceRequest(prompt, SamplingParams(max_tokens=20)))
    rt.step()  # its prefill, after the hit
    floor = 2 * BT - 16
    assert (h.cached, h.context_floor) == (2 * BT, floor)

    @torch.inference_mode()
    def hidden(at_floor: int) -> torch.Tensor:
        h.context_floor = at_floor
        table = rt.transfers.upload(row_table([h], 1))
        return rt.proposer.hidden(table, rt.features, 3, h.backlog, rt.shapes.draft_width(h.start), first_slot=h.slot)

    blind, seeing = hidden(floor), hidden(0)
    kv = rt.draft_cache.kv
    with torch.inference_mode():
        for t in (*kv.keys, *kv.values):
            t[h.slot, :, :floor] = torch.randn_like(t[h.slot, :, :floor])
    assert torch.equal(hidden(floor), blind)  # nothing before the floor reaches it
    assert not torch.allclose(hidden(0), seeing)  # without a floor the same garbage does
    h.context_floor = floor
    rt.run()
    assert h.result.output_ids == ref.output_ids


def test_a_hash_that_ignored_the_prefix_would_serve_another_offsets_k_v():
    """B's first block has the tokens of A's second: a block named by its tokens alone would hand B
    the K/V A computed at positions 32..63 after A's first block."""
    target, draft = rigged_pair("v1+fields")
    x, y = SYSTEM[:BT], SYSTEM[BT: 2 * BT]
    a, b = x + y + [3, 4], y + [5, 6, 7]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=12)) for p in (a, b)]
    got = one_after_another(runtime(target, draft), [a, b], [SamplingParams(max_tokens=12)] * 2)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert got[1].stats.num_cached_tokens == 0


# -- 4. failures leave the cache as it was -------------------------------------------------------
def _state(rt: BatchedRuntime):
    pc = rt.prefix_cache
    return list(pc.lru.items()), vars(pc.counters).copy()


def test_a_hit_that_fails_leaves_the_cache_as_it_was():
    target, draft = rigged_pair("v1+fields")
    rt = runtime(target, draft)
    one_after_another(rt, [SYSTEM + [1, 2], [(3 * i) % 90 + 2 for i in range(BT + 1)]], [SamplingParams(max_tokens=5)] * 2)
    before = _state(rt)
    assert len(before[0]) == 3
    with pytest.raises(InvalidRequest):  # too long: refused before anything is looked up
        rt.add(SequenceRequest(SYSTEM + [3], SamplingParams(max_tokens=200)))
    h = rt.add(SequenceRequest(SYSTEM + [3], SamplingParams(max_tokens=10, temperature=1e-300)))
    rt.run()
    assert h.error is not None and "temperature=1e-300" in h.error
    assert _state(rt) == before  # the same blocks, in the same LRU order, the same counters
    ok = one_after_another(rt, [SYSTEM + [3]], [SamplingParams(max_tokens=10)])[0]
    assert ok.stats.num_cached_tokens == 2 * BT and rt.prefix_cache.counters.hits == before[1]["hits"] + 2 * BT


def test_the_counters_count_tokens_as_vllm_does():
    target, draft = rigged_pair("v1+fields")
    rt = runtime(target, draft)
    prompts, cached = SHARED["mid-block"]
    one_after_another(rt, prompts, [SamplingParams(max_tokens=4)] * 3)
    c = rt.prefix_cache.counters
    assert (c.requests, c.queries, c.hits) == (3, sum(map(len, prompts)), sum(cached))
    assert rt.stats()["prefix_cache"]["hit_rate"] == pytest.approx(sum(cached) / sum(map(len, prompts)))


def test_off_means_off():
    target, draft = rigged_pair("v1+fields")
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=256, prefix_cache=False)).start()
    got = one_after_another(rt, SHARED["mid-block"][0], [SamplingParams(max_tokens=4)] * 3)
    assert rt.prefix_cache is None and [g.stats.num_cached_tokens for g in got] == [0, 0, 0]


# -- 5. bit for bit with the panel kernel -----------------------------------------------------------
def test_a_prefill_after_a_cached_prefix_leaves_the_same_bits_on_the_panel_kernel():
    from dflash_trt.runtime.cpu import panel_gemm
    from dflash_trt.runtime.cpu.packing import pack_cpu_linears

    if panel_gemm.unavailable() is not None:
        pytest.skip(f"panel kernel: {panel_gemm.unavailable()}")
    target = tiny_target("qwen3", seed=2)
    draft = random_draft(target.config, block_size=8, seed=5)
    assert pack_cpu_linears(target) and pack_cpu_linears(draft)
    prompt = SYSTEM + [40, 41, 42]
    plain = runtime(target, draft)
    cold, k_ref, v_ref = _after_first_draft(plain, prompt)
    warm = warmed(target, draft)
    hot, k, v = _after_first_draft(warm, prompt)
    assert hot.stats.num_cached_tokens == 2 * BT
    P = len(prompt)
    for layer in range(len(warm.cache.kv.keys)):
        assert torch.equal(warm.cache.kv.keys[layer][hot.slot, :, :P], plain.cache.kv.keys[layer][cold.slot, :, :P])
        assert torch.equal(warm.cache.kv.values[layer][hot.slot, :, :P], plain.cache.kv.values[layer][cold.slot, :, :P])
    assert torch.equal(warm.features[hot.slot, BT * 2: P], plain.features[cold.slot, BT * 2: P])
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_a_request_that_never_drafted_still_leaves_its_blocks_with_the_drafters_context():
    """max_tokens = 1 ends at the prefill: the drafter catches up on the row before it leaves, so the
    next request hits, and its drafter holds the same context K/V as a run without the cache."""
    target = tiny_target("qwen3", seed=2).double()
    draft = random_draft(target.config, block_size=8, seed=5).double()
    prompt = SYSTEM + [40, 41, 42]
    _, k_ref, v_ref = _after_first_draft(runtime(target, draft), prompt)
    warm = warmed(target, draft, max_tokens=1)
    assert len(warm.prefix_cache) == 4  # SYSTEM's two blocks and OTHER's
    assert warm.prefix_cache.counters.drafter_catch_ups == 1  # the first request's; OTHER drafted
    h, k, v = _after_first_draft(warm, prompt)
    assert h.stats.num_cached_tokens == 2 * BT
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-12)
