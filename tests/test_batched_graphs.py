"""What start-up captures and what a step then does, with static shapes, on a CPU (no GPU here).

The runtime's static passes go through the same dispatch on a CPU as on a GPU
(runtime/gpu/cuda_graphs.StaticPasses: a capture records the shape key and runs the pass once on
padding rows; a call runs it eagerly, where CudaGraphPasses replays a graph), so these tests assert
without a GPU what the GPU run needs:

- every shape a configuration replays is captured when the runtime is built, and a run, its
  calibration included, meets no other (misses == 0) and captures none (the first GPU run captured
  lazily, inside the timed runs);
- a step reads the device once (one sync), sends it one table (plus one per prefill pass), and
  nothing else in it reads a tensor's value on the host (``.tolist()``, ``.item()``, ``int(t)``,
  ``bool(t)``, a copy to the host, ``torch.multinomial``: a hidden sync each on a GPU;
  tests/device_harness.HostReads sees them, on the CPU and on meta), greedy or sampled, for both
  drafter families (DFlash2's selector walk included) and every draft method;
- the policy's costs come from replayed steps only (no prefill, no eager catch-up in them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, RuntimeExtras, SequenceRequest
from dflash_trt.runtime.batched.policy import AdaptivePolicy, Decision
from dflash_trt.runtime.batched.policy_calibration import calibrate
from dflash_trt.runtime.batched.scheduling import prefill_runs
from dflash_trt.runtime.batched.step_shapes import GRAPH_WIDTH_BASE, StepShapes, row_buckets
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DRAFT_METHODS, SpeculationSettings

from tests.device_harness import HostReads
from tests.test_batched_runtime import PROMPTS, _pair

# prompts long enough that rows cross the first static width (128) while they decode
LONG = [[(7 * i + j) % 120 + 1 for i in range(n)] for j, n in enumerate((118, 124, 60, 9, 127))]


@pytest.mark.parametrize("max_batch,max_seq_len,block", [(1, 64, 1), (5, 300, 4), (8, 1000, 16), (32, 2048, 16)])
def test_static_shapes_cover_every_batch_and_length(max_batch, max_seq_len, block):
    cap = max_seq_len + block  # the dump index of a cache of max_seq_len + B + 1 positions
    shapes = StepShapes.make(max_batch, max_seq_len, block, cap, static=True)
    assert all(b >= n and b in shapes.rows_buckets for n in range(1, max_batch + 1) for b in [shapes.rows(n)])
    assert shapes.rows_buckets[-1] == max_batch
    widths = shapes.widths()
    for length in range(1, max_seq_len - 2 + block + 1):  # every pass of a decoding row
        w = shapes.width(length)
        assert w in widths and w >= length and w <= cap
    assert len(widths) <= (cap // GRAPH_WIDTH_BASE).bit_length() + 1  # a handful per max_seq_len
    assert len(shapes.keys({0, 1, 3})) == len(shapes.rows_buckets) * len(widths) * (3 + 2)


def test_row_buckets_are_checked():
    assert row_buckets(6) == (1, 2, 4, 6) and row_buckets(8) == (1, 2, 4, 8)
    assert row_buckets(8, [3, 8]) == (3, 8)
    with pytest.raises(ValueError, match="1..max_batch=4"):
        row_buckets(4, [8])


def test_every_shape_is_captured_at_start_up_and_a_run_captures_none():
    target, draft = _pair("llama", seed=13)
    budgets = [20, 12, 30, 25, 16]
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(LONG, budgets)]
    policy = AdaptivePolicy(draft.block_size)
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=5, max_seq_len=300, cuda_graphs=True),
                        None, RuntimeExtras(policy=policy)).start()
    keys = rt.shapes.keys(policy.draft_lengths(rt.max_draft_len))
    assert rt.graphs.keys == set(keys) and rt.graphs.counters.captured == len(keys)
    assert {k[3] for k in keys} == {128, 256, 304}  # widths: 128 x 2^i, the cache's end (300 + 4)
    with pytest.raises(RuntimeError, match="after start-up"):
        rt.graphs.capture(("verify", 1, 0, 7), lambda t: (t,), torch.zeros(1))
    calibrate(rt, [1, 5], reps=1)
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=m))) for p, m in zip(LONG, budgets)]
    rt.run()
    assert [h.result.output_ids for h in handles] == ref
    c = rt.graphs.counters
    assert c.captured == len(keys) and c.misses == 0 and c.replays > 0
    assert {k[3] for k in keys} == {128, 256, 304}


class _DeviceWork(TorchDispatchMode):
    """Counts host data turned into tensors (an upload) and ops whose output's size depends on the
    values (a sync each on a GPU that no host read shows)."""

    # torch.multinomial checks its distribution on the host (a sync per call on a GPU): the runtime
    # draws with sampling.draw instead
    SIZED_BY_VALUES = ("aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique", "aten.repeat_interleave.Tensor",
                       "aten._local_scalar_dense", "aten.is_nonzero", "aten.multinomial")

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.SIZED_BY_VALUES):
            self.syncs.append(name)
        if name.startswith("aten.lift_fresh"):
            self.uploads += 1
        return func(*args, **(kwargs or {}))


# (device, family, draft method, sampled): greedy steps of both families and seeded sampled steps of
# every method on the CPU; on meta (every host read answered with zeros) the greedy v1 step
STEP_KINDS = [("cpu", "dflash", "match", False), ("cpu", "dflash2", "match", False),
              *[("cpu", family, method, True) for family in ("dflash", "dflash2") for method in DRAFT_METHODS],
              ("meta", "dflash", "match", False)]


@pytest.mark.parametrize("device,family,method,sampled", STEP_KINDS, ids=["-".join(map(str, k)) for k in STEP_KINDS])
@pytest.mark.parametrize("static", [True, False], ids=["static", "eager"])
def test_a_step_syncs_once_and_uploads_one_table(static, device, family, method, sampled):
    """Every host read of a step (tests/device_harness.HostReads: `.tolist()`, `.item()`, `int(t)`,
    ..., and on meta every copy to the host, `.cpu()`, `.to("cpu")`) is the one download. On the
    CPU a tensor's read dispatches no aten op, so only the recorder sees it; on meta the reads
    answer zeros and the runtime decodes on (every token 0)."""
    if device == "meta":  # main's meta leg as it was
        target, draft = _pair("qwen3", seed=14)
        rt = BatchedRuntime(target.to(device), draft.to(device),
                            RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=static),
                            None, RuntimeExtras(policy=AdaptivePolicy(draft.block_size))).start()
    else:
        target = tiny_target("qwen3", seed=14).double()
        draft = random_draft(target.config, block_size=4, seed=14, family=family).double()
        spec = SpeculationSettings.for_block(draft.block_size, policy="adaptive", draft_method=method)
        rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=static), spec).start()
    for i, (p, m) in enumerate(zip(PROMPTS[:3], [14, 9, 20])):
        rt.add(SequenceRequest(p, SamplingParams(max_tokens=m, temperature=0.8 if sampled else 0.0,
                                                   seed=i if sampled else None)))
    steps = 0
    while rt.has_work():
        passes = len(prefill_runs(sorted(len(s.request.prompt_ids) for s in rt.waiting), rt.prefill_pad_limit))
        before = rt.transfers.to_dict()
        with _DeviceWork() as work, HostReads() as reads:
            rt.step()
        after = rt.transfers.to_dict()
        decoding = rt.steps > 1
        assert after["syncs"] - before["syncs"] == 1
        assert reads.where() == ["host_transfers.HostTransfers.download"]
        assert after["uploads"] - before["uploads"] == passes + decoding == work.uploads
        assert work.syncs == []
        steps += 1
    assert steps > 3


@dataclass
class _Alternating:
    """k = 0 0 0 1 1 1 0 0 0 ...: plain streaks make the next drafting step catch the drafter up
    over more than k+1 positions (eager under static shapes); records which steps were timed."""

    chosen: list[int] = field(default_factory=list)
    timed: list[int] = field(default_factory=list)

    def choose(self, batch, k_max, can_shadow=False):
        k = min(len(self.chosen) // 3 % 2, k_max)
        self.chosen.append(k)
        return Decision(batch, k, reason="test")

    def draft_lengths(self, k_max):
        return {0, min(1, k_max)}

    def observe_step(self, batch, k, seconds):
        self.timed.append(len(self.chosen) - 1)

    def observe_acceptance(self, drafted, accepted):
        pass


def test_policy_costs_come_from_replayed_steps_only():
    target, draft = _pair("llama", seed=15)
    policy = _Alternating()
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=True),
                        None, RuntimeExtras(policy=policy)).start()
    rt.add(SequenceRequest(PROMPTS[4], SamplingParams(max_tokens=25)))
    replayed_only: list[bool] = []  # per decoding step: every pass replayed (no prefill, no catch-up)
    while rt.has_work():
        if rt.steps == 4:
            rt.add(SequenceRequest(PROMPTS[1], SamplingParams(max_tokens=8)))  # a join: a prefill in a step
        decoding, eager = bool(rt.rows), sum(rt.eager_passes.values())
        rt.step()
        if decoding:
            replayed_only.append(sum(rt.eager_passes.values()) == eager)
    assert set(policy.timed) == {i for i, ok in enumerate(replayed_only) if ok}
    assert rt.eager_passes["draft catch-up"] > 0 and rt.eager_passes["prefill"] == 2
    assert {policy.chosen[i] for i in policy.timed} == {0, 1}  # drafting steps are priced too
    assert rt.graphs.counters.misses == 0
