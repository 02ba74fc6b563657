"""Static shapes (the CUDA-graph path of the batched runtime) decode exactly as the reference loop.

With ``cuda_graphs=True`` the draft and verify passes of greedy batches run padded: rows to a
power of two on free slots that write only to the dump index, mask widths to multiples of 128,
the drafter's context to the block. On a CUDA device each shape is then captured once and
replayed (dflash_trt/runtime/gpu/cuda_graphs.py); there is no GPU here, so these tests run the padded
passes eagerly on CPU through the same dispatch and check them token for token, and check that
every pass captured at start-up traces as ONE graph (torch.compile fullgraph=True, eager backend):
a host sync or a data-dependent Python branch inside a pass would make CUDA-graph capture fail,
and fails here. The capture and replay calls themselves (torch.cuda.graph) only run on a GPU.
tests/test_batched_graphs.py checks what start-up captures and what a step then does.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest, batched_generate
from dflash_trt.runtime.gpu.cuda_graphs import StaticPasses
from dflash_trt.runtime.drafters.dflash import make_draft_config
from dflash_trt.runtime.batched.policy import AdaptivePolicy, FixedPolicy
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

from tests.test_batched_runtime import BUDGETS, PROMPTS, BatchedOracle, _pair


def _policy(policy, draft) -> dict:
    """batched_generate kwargs: a policy object, or "adaptive" (the policy SpeculationSettings names)."""
    if policy == "adaptive":
        return {"speculation": SpeculationSettings.for_block(draft.block_size, policy="adaptive")}
    return {"policy": policy}


@pytest.mark.parametrize("policy", [FixedPolicy(3), FixedPolicy(1), "adaptive"], ids=["k3", "k1", "adaptive"])
def test_static_shapes_equal_the_reference_with_joins_stops_and_queueing(policy):
    target, draft = _pair("llama", seed=11)
    plain = dflash_generate(draft, target, PROMPTS[2], SamplingParams(max_tokens=BUDGETS[2])).output_ids
    stop = [plain[5]]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m, stop_token_ids=stop)).output_ids
           for p, m in zip(PROMPTS, BUDGETS)]
    # max_batch 5: passes of 1, 2, 4 and 5 rows (the cap is no power of two); arrivals spread joins
    results = batched_generate(draft, target, PROMPTS, [SamplingParams(max_tokens=m, stop_token_ids=stop) for m in BUDGETS],
                               max_batch=5, arrivals=[0, 2, 1, 5, 0, 3], cuda_graphs=True, **_policy(policy, draft))
    assert [r.output_ids for r in results] == ref


class ShapeRecordingOracle(BatchedOracle):
    """The perfect drafter, recording the (rows, context + block) shape of every pass."""

    shapes: list[tuple[int, int]]

    def forward(self, target_hidden, noise_embedding, position_ids, cache=None, attn_mask=None, outputs=None):
        self.shapes.append((noise_embedding.shape[0], position_ids.shape[1]))
        return super().forward(target_hidden, noise_embedding, position_ids, cache, attn_mask, outputs)


def test_padded_rows_leave_a_perfect_drafter_perfect():
    """3 running rows pass as 4: the padding row must not disturb the real rows' caches, context
    or drafts (tau stays the block size), and every steady pass has the static shape."""
    target = tiny_target("qwen3", seed=5, vocab_size=32, hidden_size=64).double()
    B, steps = 4, 5
    n_new = 1 + B * steps
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 8]]
    truth = [p + dflash_generate(random_draft(target.config, block_size=B).double(), target, p, SamplingParams(max_tokens=n_new + B)).output_ids for p in prompts]
    draft = ShapeRecordingOracle(make_draft_config(target.config, num_layers=1, block_size=B),
                                 target.get_output_embeddings().weight.detach())
    draft.row_sequences, draft.shapes = [[0] * 64] * 4, []  # start-up captures every shape on padding rows
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=True),
                        None, RuntimeExtras(policy=FixedPolicy(B - 1))).start()
    draft.shapes = []
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=n_new))) for p in prompts]
    by_handle = {id(h): t for h, t in zip(handles, truth)}
    while rt.has_work():
        draft.row_sequences = [by_handle[id(s)] for s in rt.rows] + [[0] * 64]  # the padding row
        rt.step()
    for h, t, p in zip(handles, truth, prompts):
        assert h.result.output_ids == t[len(p): len(p) + n_new]
        assert h.result.stats.acceptance_lengths == [B] * steps
    # the first pass catches up on the prompts (eager, context as long as the longest prompt);
    # every later one: 4 rows, context padded to the block, then the block
    assert draft.shapes[0] == (4, 5 + B)
    assert set(draft.shapes[1:]) == {(4, 2 * B)}


class TracingPasses(StaticPasses):
    """Static passes whose capture traces the pass with dynamo as ONE graph (fullgraph=True raises
    on a graph break: a host sync or a data-dependent Python branch, either of which would make
    CUDA-graph capture fail); steps then run them eagerly, as on a CPU."""

    def _capture(self, key, fn, inputs):
        torch._dynamo.reset()  # one fresh trace per key: the closure's shapes differ between keys
        torch.compile(fn, fullgraph=True, backend="eager")(*inputs)


@pytest.mark.integration  # dynamo traces every captured pass: ~20 s a family
@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_every_captured_pass_traces_as_one_graph_and_stays_lossless(monkeypatch, family):
    """DFlash2's draft pass includes the selector's walk: k steps on the device, in the same graph."""
    import dflash_trt.runtime.batched.runtime as batched

    target = tiny_target("qwen3", seed=12).double()
    draft = random_draft(target.config, block_size=4, seed=12, family=family).double()
    prompts, budgets = PROMPTS[:3], [6, 4, 7]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(prompts, budgets)]
    monkeypatch.setattr(batched, "static_passes", lambda device: TracingPasses())
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=True),
                        None, RuntimeExtras(policy=AdaptivePolicy(draft.block_size))).start()
    assert {key[0] for key in rt.graphs.keys} == {"verify", "draft"}
    assert {key[1] for key in rt.graphs.keys} == {1, 2, 4}  # rows: powers of two
    results = batched_generate(draft, target, prompts, [SamplingParams(max_tokens=m) for m in budgets], runtime=rt)
    assert [r.output_ids for r in results] == ref
    assert rt.graphs.counters.misses == 0 and rt.graphs.counters.replays > 0


def test_sampled_rows_keep_the_eager_path():
    """Seeded sampling under static shapes still reproduces the reference loop (its steps stay eager)."""
    target, draft = _pair("llama", seed=4)
    seeds = [11, 12, 13]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m, temperature=0.9, seed=s)).output_ids
           for p, m, s in zip(PROMPTS[:3], BUDGETS[:3], seeds)]
    params = [SamplingParams(max_tokens=m, temperature=0.9, seed=s) for m, s in zip(BUDGETS[:3], seeds)]
    results = batched_generate(draft, target, PROMPTS[:3], params, policy=FixedPolicy(draft.block_size - 1),
                               cuda_graphs=True)
    assert [r.output_ids for r in results] == ref
