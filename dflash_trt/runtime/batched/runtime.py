"""Batched DFlash decoding with continuous batching: many sequences share each draft and verify pass.

One step over the n running rows (slots 0..n-1 of preallocated caches, see slot_caches.py):

    admit   waiting requests into free slots (scheduling.py); copy in each prompt's longest cached
            prefix (prefix_cache.py); prefill the rest in left-padded target passes (one per run of
            similar lengths on a CPU)                                          target_passes.py
    k       = policy.choose(n, K)                      0 = plain decoding (no draft pass; now and
            then one greedy row drafts unverified, graded by the next commits)  shadow_drafts.py
    table   ONE host-to-device copy: each row's start, drafter position, pending token
    draft   one drafter pass over [each row's unconsumed context ; anchor, MASK x (B-1)]
            (the full trained block; slots 1..k are this step's drafts), by the proposer of the
            drafter's family: v1's argmaxes, DFlash2's selector walk    dflash_proposer.py,
                                                                       dflash2_proposer.py
    verify  one target pass over [pending, draft_1..k] per row      -> posterior [n, k+1]
    accept  a_i = longest prefix with draft == posterior (on device)
    sync    ONE device-to-host copy: posteriors, a_i, newcomers' first tokens
    commit  posterior[0..a_i] per row, capped at the tokens its budget has left; stop tokens,
            callbacks per row; rows that finished free their slot (the last row moves into the hole)

Sampled rows (temperature > 0) follow the speculation settings' draft method (speculation.py):
``match`` verifies argmax drafts by exact match against the row's own samples of the target;
``greedy`` verifies them by rejection sampling with a one-hot q; ``probabilistic`` draws the
drafts from the drafter's q (v1: each slot from its tempered nucleus distribution; DFlash2: the
walk from softmax(scores / T) over its candidates) and verifies them by rejection sampling against
it (runtime/decoding/rejection.py), whose accepted drafts and residual or bonus draw take the posterior's place.
Greedy rows of the same step take the argmax and the exact match whatever the method. Every draw
happens on the device (runtime/decoding/sampling.draw: no host sync), a seeded row with its own generator in the
reference loop's order and shapes, so a seed gives the reference loop's tokens.

A row whose sampling parameters give no distribution (see sampling.checked_probs) fails alone:
it ends with ``error`` set and nothing committed from that step, the other rows of the step go on.

Rows differ in length, acceptance, budget and sampling parameters; every row drafts the full
block and verifies the step's k, also at its budget's tail (only the commit is capped, as in the
reference loop). Rollback is free: cache index == position, a 4D mask built from positions hides
everything past a row's committed length, and the next step overwrites it.

B, K and the policy come from :class:`~dflash_trt.speculation.SpeculationSettings`; the default
policy is fixed (k = K every step: deterministic, the reference loop's schedule). Serving opts
into the adaptive policy (runtime/batched/policy.py), calibrated by runtime/batched/policy_calibration.py.

With static shapes (CUDA graphs, on by default on a GPU) the draft and verify passes of greedy
steps run in shapes from a fixed set (step_shapes.py), every one captured when the runtime is
started (runtime/gpu/cuda_graphs.py) and replayed by the steps; the host's work between replays is building the
row table and committing tokens.

Per sequence the output equals the reference loop's (dflash_generate) token for token at
temperature 0 (tests/test_batched_*.py), since every row sees exactly the K/V and context the
reference would. At temperature > 0 each row samples with its own generator, as the reference.

Unsupported here (runtime/opener.open_runtime opens the reference loop instead and says why, see
:func:`unsupported_reason`): targets with sliding-window layers or attention sinks (GptOss),
drafters with sliding-window or causal layers (one bidirectional mask per drafter pass), and
attention implementations that reject a 4D mask (flash_attention_2).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_trt.checkpoints.placement import home_device, model_devices
from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.runtime.batched.slot_caches import BatchedDraftCache, BatchedKVCache
from dflash_trt.runtime.gpu.compiled_layers import compile_errors
from dflash_trt.runtime.gpu.cuda_graphs import CudaGraphPasses, StaticPasses, static_passes
from dflash_trt.runtime.batched.dflash_proposer import Proposal, make_proposer
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel
from dflash_trt.runtime.drafters.draft_vocab import DraftVocabHead
from dflash_trt.runtime.decoding.results import GenerationResult, finish
from dflash_trt.runtime.targets.gqa_attention import ATTN_IMPLEMENTATION as GROUPED_SDPA
from dflash_trt.runtime.gpu.host_transfers import HostTransfers
from dflash_trt.runtime.batched.policy import Decision, FixedPolicy, SpeculationPolicy, make_policy
from dflash_trt.runtime.batched.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes, position_bytes
from dflash_trt.runtime.decoding.sampling import StepSampling
from dflash_trt.runtime.batched.scheduling import (
    CPU_PREFILL_PAD_LIMIT,
    PENDING,
    START,
    BatchedSequence,
    Scheduler,
    SequenceRequest,
    commit,
    row_table,
    sampling_failure,
)
from dflash_trt.runtime.batched.shadow_drafts import ShadowDrafts
from dflash_trt.runtime.batched.graphed_passes import GraphedPasses
from dflash_trt.runtime.batched.step_shapes import StepShapes
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.batched.target_passes import TargetPasses
from dflash_trt.sampling_params import GREEDY, SamplingParams
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.speculation import SpeculationSettings, rejection_verified, samples_drafts

__all__ = ["BatchedRuntime", "BatchedSequence", "RuntimeExtras", "SequenceRequest", "batched_generate",
           "unsupported_reason"]

# HF attention implementations that take an explicit 4D mask
MASK_ATTENTION = ("sdpa", "eager", GROUPED_SDPA)


def unsupported_reason(target: Any, draft: DFlashDraftModel | None = None) -> str | None:
    """Why the batched runtime cannot run this pair (None: it can)."""
    model = target.model if isinstance(target, TargetAdapter) else target
    spread = model_devices(model)
    if len(spread) > 1:  # its caches, masks and draft head live on one device; a device map's layers do not
        return (f"the target is spread over {len(spread)} devices ({', '.join(map(str, spread))}); the batched "
                "runtime runs a target on one device")
    cfg = TargetAdapter(target).config
    impl = getattr(cfg, "_attn_implementation", "sdpa") or "sdpa"
    if impl not in MASK_ATTENTION:
        return f"attention implementation {impl!r} takes no 4D mask (need one of {', '.join(MASK_ATTENTION)})"
    if getattr(cfg, "model_type", "") == "gpt_oss":
        return "gpt_oss (attention sinks, sliding window) runs on the reference loop"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return f"{cfg.model_type} has sliding-window layers (their mask is not built by the batched runtime)"
    if draft is not None and any(layer.self_attn.sliding_window for layer in draft.layers):
        return "the drafter has sliding-window layers (one mask per pass here)"
    if draft is not None and (why := draft.reference_only_reason()) is not None:  # causal layers
        return why
    return None


@dataclass
class Decoded:
    """One step's draft + verify, on the device."""

    k: int  # drafts verified per row
    out: torch.Tensor  # [n, k+2]: the posterior [n, k+1] and the accepted count [n] side by side
    bad: torch.Tensor | None  # [n]: rows whose sampling had no distribution (None: every row is greedy)
    steady: bool  # its cost is a sample of steady decoding (every pass replayed / no drafter catch-up)
    # a plain step's shadow draft (runtime/batched/shadow_drafts.py): the row, and its drafts [1, K] on the device
    shadow: tuple[BatchedSequence, torch.Tensor] | None = None


@dataclass(frozen=True)
class RuntimeExtras:
    """What one caller or another adds to a batched runtime beyond its options and speculation."""

    # a policy object that overrides the one the speculation settings name (benchmarks' fixed:k, the
    # gate's fixed K, calibrated or probing policies)
    policy: SpeculationPolicy | None = None
    # False: the drafter proposes over the whole vocabulary, as the reference loop does (the gate),
    # not over its draft_vocab.json head
    use_draft_vocab: bool = True
    # every finished sequence keeps the target's features at these layers for every position it
    # fed (train-data: no second target pass over the answers)
    capture_layer_ids: tuple[int, ...] | None = None
    # static shapes: these row buckets instead of the default ones (max_batch is always one)
    graph_batch_sizes: tuple[int, ...] | None = None
    # a MEASUREMENT of what a drafter blind to the cached prefix loses (scripts/context_recompute_tail.py):
    # on a prefix-cache hit of c tokens the drafter attends only to context positions >= c - N, as
    # TensorRT-LLM's DFlash does with context_recompute_tail = N (its drafter sees no more of a cached prefix).
    # None: the drafter keeps every position (lossless and no loss of acceptance: what serves)
    context_recompute_tail: int | None = None


class BatchedRuntime:
    """Continuous-batching DFlash decoder over one target and one drafter (draft=None: plain
    batched decoding, the honest baseline at the same concurrency).

    Caches are allocated once for `options.max_batch` rows of `options.max_seq_len` positions
    (prompt + output). Not thread-safe: one thread calls add() and step() (the server's scheduler
    thread).

    Construction allocates; :meth:`start` is the start-up (compiling the layers, capturing the
    static shapes, warming the compiled eager passes), which runtime/opener.open_runtime runs and
    a runtime with static shapes or compiled layers needs before its first step.

    options.cuda_graphs (None: on for a CUDA target, off elsewhere): run the draft and verify passes
    of greedy batches in static shapes (runtime/batched/step_shapes.py: rows padded to a bucket on free
    slots that write only to the dump index, mask widths to 128 x a power of two, the drafter's
    context to k+1), every one of them captured at start-up, before any request, and replayed
    (runtime/gpu/cuda_graphs.py). On a CPU the same passes run eagerly through the same dispatch: what
    the tests check token for token. Prefills, steps with sampled rows, and a drafter's catch-up
    over a backlog longer than k+1 stay eager.
    """

    def __init__(self, target: Any, draft: DFlashDraftModel | None = None, options: RuntimeOptions = RuntimeOptions(),
                 speculation: SpeculationSettings | None = None, extras: RuntimeExtras = RuntimeExtras()) -> None:
        """`speculation`: B, K and the policy (default: K = B-1, fixed). `options`: the limits, static
        shapes (cuda_graphs), compiled layers (torch_compile: a property of the models from start-up
        on; every runtime over them sees it) and chunked verification (verify_chunk: eager greedy
        steps verify their drafts this many positions at a time, a row stopping at its first
        rejection, TargetPasses.verify_chunked: for a compute-bound CPU and a long fixed k, the
        acceptance gate's case). The options' device and dtypes are the loader's: the runtime runs
        where the target is."""
        self.target = TargetAdapter(target)
        self.draft = draft
        why = unsupported_reason(self.target.model, draft)
        if why:
            raise DFlashError(f"batched runtime: {why}; use dflash_generate (the reference loop) for this pair")
        max_batch, max_seq_len = options.max_batch, options.max_seq_len
        self.options = options
        self.speculation: SpeculationSettings | None = None
        if draft is not None:
            self.speculation = speculation or SpeculationSettings.for_block(draft.block_size)
            if self.speculation.block_size != draft.block_size:
                raise DFlashError(f"speculation settings are for block_size {self.speculation.block_size} but the "
                                  f"drafter's block is {draft.block_size}; build them from this drafter")
        self.block_size = draft.block_size if draft is not None else 1  # B: what a draft pass covers
        self.max_draft_len = self.speculation.max_draft_len if self.speculation is not None else 0  # K
        self.policy: SpeculationPolicy = extras.policy or (make_policy(self.speculation) if self.speculation is not None
                                                            else FixedPolicy(0))
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        layer_ids = tuple(draft.target_layer_ids) if draft is not None else ()
        self.keep_features = extras.capture_layer_ids is not None
        if extras.capture_layer_ids is not None:
            ids = tuple(int(i) for i in extras.capture_layer_ids)
            if draft is not None and ids != layer_ids:
                raise DFlashError(f"capture_layer_ids {list(ids)} differ from the drafter's target_layer_ids "
                                  f"{list(layer_ids)}; capture the drafter's layers or decode without it")
            if not ids or min(ids) < 0 or max(ids) >= self.target.num_layers:
                raise DFlashError(f"capture_layer_ids must name target layers 0..{self.target.num_layers - 1}, "
                                  f"got {list(ids)}")
            layer_ids = ids
        self.device = home_device(self.target.model)
        self.torch_compile = options.torch_compile
        # positions 0..max_seq_len-1, + block padding of rows near their end, + the dump index
        capacity = max_seq_len + self.block_size + 1
        self.transfers = HostTransfers(self.device)
        self.passes = TargetPasses(self.target, max_batch, capacity, layer_ids, self.transfers)
        # the drafter family's proposer (dflash_proposer.make_proposer: picked from the checkpoint)
        self.proposer = (make_proposer(draft, self.target, max_batch, capacity, extras.use_draft_vocab)
                         if draft is not None else None)
        self.scheduler = Scheduler(max_batch, self.device)
        self.shadows = ShadowDrafts() if self.proposer is not None else None
        self.prefill_pad_limit = CPU_PREFILL_PAD_LIMIT if self.device.type == "cpu" else float("inf")
        cuda_graphs = options.cuda_graphs
        self.static_shapes = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.verify_chunk = options.verify_chunk
        self.shapes = StepShapes.make(max_batch, max_seq_len, self.block_size, capacity - 1, self.static_shapes,
                                      extras.graph_batch_sizes)
        self.steps = 0
        self.last_decision: Decision | None = None
        self.last_step_timed = False  # the last step's time was a cost sample (see step())
        self.eager_passes: Counter[str] = Counter()  # with static shapes: passes that ran eagerly, by reason
        self.graphs: StaticPasses | None = None  # the dispatch of static passes (counters, captured keys)
        self.graphed: GraphedPasses | None = None
        if self.static_shapes:
            self.graphs = static_passes(self.device)
            self.graphed = GraphedPasses(self.graphs, self.shapes, self.passes, self.proposer, self.transfers.upload)
        # start-up has work to do: a step before start() would run uncaptured shapes and compile inside requests
        self.started = not (self.static_shapes or self.torch_compile)
        # the prefix cache (runtime/batched/prefix_cache.py); not beside capture_layer_ids, whose finished
        # sequences keep the features of every position (a hit would leave its cached part out)
        self.context_tail = extras.context_recompute_tail
        self.prefix_cache: PrefixCache | None = None
        if options.prefix_cache and not self.keep_features:
            self.prefix_cache = PrefixCache(int(options.prefix_cache_mib * 2**20),
                                            BLOCK_TOKENS * self._position_bytes())

    def start(self) -> "BatchedRuntime":
        """Start-up, before any request (idempotent; returns the runtime): with torch_compile the
        target's and the drafter's decoder layers switch to their compiled halves
        (runtime/gpu/compiled_layers.py); with static shapes every shape a step can run is captured (on
        a CPU: their eager dry run); with compiled layers two short dummy batches then compile the
        passes that stay eager. A compiler failure is one line naming --torch-compile."""
        if self.started:
            return self
        if self.torch_compile:
            from dflash_trt.runtime.gpu.compiled_layers import compile_draft_layers, compile_target_layers

            compile_target_layers(self.target)
            if self.draft is not None:
                compile_draft_layers(self.draft)
        if self.graphed is not None:
            with compile_errors(self.torch_compile):
                self.graphed.capture(self._draft_lengths())  # every shape, before any request
        self.started = True  # the warm-up below decodes through step()
        if self.torch_compile:
            with compile_errors(True):
                self._warm_up_eager_passes()
        return self

    def _warm_up_eager_passes(self) -> None:
        """With compiled layers: decode two short dummy batches now (prefills of one row and of several,
        the drafter's catch-up over a prompt, plain and drafting steps), so that the shape classes of the
        passes that stay eager compile at start-up, not inside the first requests (measured: 10 compiled
        graphs after capture, 3 more in the first requests). The policy sees none of it; the counters
        restart after."""
        policy, self.policy = self.policy, FixedPolicy(self.max_draft_len)
        try:
            for lengths in ((1,), (5,), (3, 9, 17)):  # one-token and one-row shapes are compiled apart
                for n in lengths:
                    prompt = [1 + i % 7 for i in range(max(1, min(n, self.max_seq_len - 4)))]
                    self.add(SequenceRequest(prompt, SamplingParams(max_tokens=max(1, min(3, self.max_seq_len
                                                                                         - len(prompt))))))
                self.run()
        finally:
            self.policy = policy
        self.reset_prefix_cache()
        self.steps, self.last_decision, self.last_step_timed = 0, None, False
        self.eager_passes.clear()
        self.transfers.uploads = self.transfers.syncs = 0
        if self.graphs is not None:
            self.graphs.counters.replays = self.graphs.counters.misses = 0

    def _position_bytes(self) -> int:
        """Bytes one position takes in the target's and the drafter's caches, from their configs."""
        def layout(cfg: Any, layers: int) -> tuple[int, int, int]:
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            return layers, heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

        caches = [layout(self.target.config, self.target.num_layers)]
        if self.draft is not None:
            caches.append(layout(self.draft.config, len(self.draft.layers)))
        return position_bytes(caches, self.target.dtype.itemsize)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and the counters (after dummy requests: a warm-up, a calibration)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # -- the pieces, by their old names (tests and tools read them) -------------------------------
    @property
    def rows(self) -> list[BatchedSequence]:
        return self.scheduler.rows

    @property
    def waiting(self) -> deque[BatchedSequence]:
        return self.scheduler.waiting

    @property
    def cache(self) -> BatchedKVCache:
        return self.passes.cache

    @property
    def draft_cache(self) -> BatchedDraftCache | None:
        return self.proposer.cache if self.proposer is not None else None

    @property
    def draft_head(self) -> DraftVocabHead | None:
        return self.proposer.head if self.proposer is not None else None

    @property
    def features(self) -> torch.Tensor | None:
        return self.passes.features

    # -- requests --------------------------------------------------------------------------------
    def add(self, request: SequenceRequest) -> BatchedSequence:
        """Queue a sequence; InvalidRequest (nothing queued) when it cannot run here."""
        p, n = request.prompt_ids, request.params.resolve_max_tokens()
        if not p:
            raise InvalidRequest("the prompt is empty (no tokens); give at least one prompt token")
        if len(p) + n > self.max_seq_len:
            raise InvalidRequest(f"prompt ({len(p)} tokens) + max_tokens ({n}) exceeds max_seq_len="
                                 f"{self.max_seq_len}; shorten the prompt or lower max_tokens")
        vocab = self.target.vocab_size
        if min(p) < 0 or max(p) >= vocab:
            raise InvalidRequest(f"prompt token ids must lie in 0..{vocab - 1}; got {min(p)}..{max(p)}")
        return self.scheduler.queue(request, n)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def cancel(self, seq: BatchedSequence) -> None:
        """Finish `seq` now (finish_reason as the tokens so far say); frees its slot."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.result = GenerationResult(list(seq.request.prompt_ids), [], seq.stats)
            return
        if seq in self.rows and not seq.done:
            self._retire([seq])

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[BatchedSequence]:
        """Admit, prefill newcomers, one draft + verify pass over the running rows, commit.
        Returns the sequences that finished in this step, in the order they were added."""
        if not self.started:
            raise RuntimeError("BatchedRuntime.start() must run before the first step (static shapes or compiled "
                               "layers); runtime.opener.open_runtime starts the runtimes it opens")
        t_step = time.perf_counter()
        n_old = len(self.rows)
        new = self.scheduler.admit(self._lookup if self.prefix_cache is not None else None)
        for seq in new:
            self._restore(seq)
        first, first_bad = self.passes.prefill(new, self.prefill_pad_limit) if new else (None, None)  # [m]
        if new and self.static_shapes:
            self.eager_passes["prefill"] += 1
        decode = self._decode(n_old) if n_old else None
        # The ONE device-to-host synchronisation of the step.
        parts = [decode.out] if decode is not None else []
        if first is not None:
            parts.append(first)
        parts += [b for b in (decode.bad if decode is not None else None, first_bad) if b is not None]
        shadow = decode.shadow if decode is not None else None
        if shadow is not None:
            parts.append(shadow[1])
        host = self.transfers.download(parts)
        i = 0

        def take(count: int) -> list[int]:
            nonlocal i
            i += count
            return host[i - count : i]

        rows_out = take(decode.out.numel()) if decode is not None else []
        first_out = take(len(new)) if first is not None else []
        bad_old = take(n_old) if decode is not None and decode.bad is not None else [0] * n_old
        bad_new = take(len(new)) if first_bad is not None else [0] * len(new)
        if shadow is not None:  # graded from this step's commit on
            assert self.shadows is not None
            self.shadows.add(shadow[0], take(shadow[1].numel()))
        finished: list[BatchedSequence] = []
        now = time.perf_counter()
        self.last_step_timed = False
        if decode is not None:
            k = decode.k
            width = k + 2  # posterior k+1, then the accepted count
            for i_row, seq in enumerate(self.rows[:n_old]):
                if bad_old[i_row]:
                    self._fail(seq, finished)
                    continue
                row = rows_out[i_row * width : (i_row + 1) * width]
                a = row[-1]
                if k > 0:
                    self.policy.observe_acceptance(k, a)  # what verification saw, whatever is committed
                left = seq.remaining  # >= 1: the commit is capped at the budget (the reference's rule)
                tokens = row[: a + 1][:left]
                seq.stats.record_step(drafted=min(k, left - 1), accepted=len(tokens) - 1)
                seq.start += a + 1  # block[0..a] stay in the cache; posterior[a] is the new pending
                if commit(seq, tokens):
                    finished.append(seq)
            # A step is a cost sample when it is what steady decoding runs: no prefill in it, and
            # either every pass replayed (static shapes) or, eagerly, no drafter catch-up (a
            # catch-up's cost says nothing about steady drafting, and a re-exploration probe after
            # a long plain streak would otherwise price drafting out)
            if first is None and decode.steady:
                self.last_step_timed = True
                self.policy.observe_step(n_old, k, now - t_step)
                if self.last_decision is not None:
                    self.last_decision.measured_s = now - t_step
        for seq, tok, bad in zip(new, first_out, bad_new):
            if bad:
                self._fail(seq, finished)
                continue
            seq.stats.ttft_s = now - seq.t0
            seq.start = len(seq.request.prompt_ids)
            if seq.prefix is not None:  # its prefill succeeded: the hit counts and its blocks are refreshed
                assert self.prefix_cache is not None
                self.prefix_cache.commit(seq.prefix)
            if commit(seq, [tok]):
                finished.append(seq)
        self._retire(finished)
        if self.prefix_cache is not None:
            for seq in self.rows:
                if not seq.prompt_offered:  # the prompt's blocks, once its drafter consumed them
                    self._publish(seq, prompt_only=True)
        if self.shadows is not None and self.shadows.pending:
            self.shadows.grade(self.policy.observe_acceptance)
        self.steps += 1
        # in the order they were added, whatever their slots (slots follow prompt length, see admit)
        return sorted(finished, key=lambda s: s.order)

    def run(self, max_steps: int | None = None) -> None:
        """Step until every added sequence finished (or `max_steps`)."""
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1

    # -- decoding ----------------------------------------------------------------------------------
    def _choose(self, seqs: list[BatchedSequence]) -> Decision:
        K = self.max_draft_len
        if self.draft is None:
            return Decision(len(seqs), 0, reason="plain")
        if any(s.request.params.seed is not None and not s.request.params.greedy for s in seqs):
            # A seeded sample is a function of the draft schedule (each step draws k+1 tokens from
            # the row's generator). Pinning the reference loop's schedule (k = K) makes a seed
            # reproduce the same text under any load, and the same text as dflash_generate.
            return Decision(len(seqs), K, reason="seeded sampling pins the reference schedule")
        can_shadow = self.shadows is not None and self.shadows.row(seqs) is not None
        return self.policy.choose(len(seqs), K, can_shadow=can_shadow)

    def _decode(self, n: int) -> Decoded:
        """Draft + verify for rows 0..n-1 (queued on the device; nothing read back yet)."""
        seqs = self.rows[:n]
        decision = self.last_decision = self._choose(seqs)
        k = decision.k
        # A catch-up: the drafter first consumes a backlog longer than steady drafting leaves (a prompt,
        # a plain streak's commits), and the step's cost says nothing about steady drafting. One plain
        # step in between adds one context column (backlog <= k + 2): that step still counts, or a
        # policy alternating plain and drafting steps near the margin (C = 4, stop 54) never times one
        # and a calibrated misprice stands.
        catching_up = k > 0 and not all(s.drafted_last for s in seqs) and max(s.backlog for s in seqs) > k + 2
        for s in seqs:
            s.drafted_last = k > 0
        greedy = all(s.request.params.greedy for s in seqs)
        static = self.graphs is not None and greedy
        if self.graphs is not None and not greedy:
            self.eager_passes["sampled"] += 1
        misses = self.graphs.counters.misses if self.graphs is not None else 0
        N = self.shapes.rows(n) if static else n  # rows n..N-1: padding on free slots (static shapes)
        longest = max(s.start for s in seqs)
        table = self.transfers.upload(row_table(seqs, N))  # [N, 5]: the step's one upload
        proposal: Proposal | None = None
        # a cost sample: with static shapes, every pass replayed a captured shape; eagerly, no catch-up
        steady = static if self.graphs is not None else not catching_up
        if k > 0 and greedy and not static and self.verify_chunk:
            assert self.proposer is not None
            hidden = self.proposer.hidden(table, self.passes.features, k, max(s.backlog for s in seqs),
                                          self.shapes.draft_width(longest))  # [n, k, H]
            for s in seqs:
                s.draft_len = s.start
            out = self.passes.verify_chunked(table, self.proposer.reader(hidden, table[:, PENDING]), k,
                                             self.shapes.verify_width(longest, k), self.verify_chunk)
            return Decoded(k, out, None, steady)
        method = self.speculation.draft_method if self.speculation is not None else "match"
        # who samples this step, and how (the groups' row indices: one counted upload, if any)
        sampling = None if greedy else StepSampling([s.request.params for s in seqs], [s.generator for s in seqs],
                                                    self.device, self.transfers.upload)
        if k > 0:
            assert self.proposer is not None
            features = self.passes.features
            W = self.shapes.draft_width(longest)
            context = max(s.backlog for s in seqs)  # >= 1
            if sampling is not None and samples_drafts(method):  # drafts drawn from q (probabilistic)
                proposal = self.proposer.propose_sampled(table, features, k, context, W, sampling)
            elif static and context <= k + 1:  # steady drafting: one static context width per k
                proposal = Proposal(self.graphed.draft(table, k, W))  # [N, k]
            else:
                proposal = Proposal(self.proposer.propose(table, features, k, context, W))
                if static:
                    self.eager_passes["draft catch-up"] += 1
                    steady = False
            for s in seqs:
                s.draft_len = s.start
        shadow = self._shadow_draft(seqs, decision.shadow) if k == 0 and decision.shadow else None
        if shadow is not None:
            steady = False  # a plain step's cost plus one row's drafter pass
        W = self.shapes.verify_width(longest, k)
        drafts = proposal.drafts if proposal is not None else None  # [N, k] | None (k = 0)
        bad = None
        if static:
            out = self.graphed.verify(table, drafts, k, W)[:n]
            steady = steady and self.graphs.counters.misses == misses
        elif sampling is None:
            out = self.passes.verify_greedy(table, drafts, W)
        else:
            out, bad = self.passes.verify_sampled(table, proposal, W, sampling, rejection_verified(method))
        return Decoded(k, out, bad, steady, shadow)

    def _shadow_draft(self, seqs: list[BatchedSequence], k: int) -> tuple[BatchedSequence, torch.Tensor] | None:
        """One greedy row drafts k without verifying (runtime/batched/shadow_drafts.py): its drafter pass
        alone, eager, in its own slot; the drafts are read with the step's one download."""
        assert self.proposer is not None and self.shadows is not None
        seq = self.shadows.row(seqs)
        if seq is None:
            return None
        table = self.transfers.upload(row_table([seq], 1))  # [1, 5]
        drafts = self.proposer.propose(table, self.passes.features, k, seq.backlog,
                                       self.shapes.draft_width(seq.start), first_slot=seq.slot)  # [1, k]
        seq.draft_len = seq.start
        if self.graphs is not None:
            self.eager_passes["shadow draft"] += 1
        return seq, drafts

    # -- static shapes -----------------------------------------------------------------------------
    def _draft_lengths(self) -> set[int]:
        """Every k a step can verify: the policy's, and for a drafter K (seeded sampling pins it, but
        sampled steps are eager) and the calibration's candidates (a subset of the policy's)."""
        if self.proposer is None:
            return {0}
        lengths = getattr(self.policy, "draft_lengths", None)
        K = self.max_draft_len
        return set(lengths(K)) if lengths is not None else set(range(K + 1))

    # -- prefix caching ----------------------------------------------------------------------------
    def _caches(self) -> list[Any]:
        """The slot caches a cached block holds positions of: the target's, then the drafter's."""
        return [self.cache.kv] + ([self.draft_cache.kv] if self.draft_cache is not None else [])

    def _lookup(self, seq: BatchedSequence) -> int:
        """Admission's prefill length of `seq`: its prompt after the longest cached prefix (read-only)."""
        assert self.prefix_cache is not None
        seq.prefix = self.prefix_cache.lookup(seq.request.prompt_ids)
        return len(seq.request.prompt_ids) - seq.cached

    def _restore(self, seq: BatchedSequence) -> None:
        """Copy a newcomer's cached prefix into its slot: the target's K/V and the drafter's context
        K/V of positions 0..cached-1, so the drafter has consumed them (draft_len) and the prefill
        computes the rest. With context_recompute_tail N the drafter attends from cached - N on."""
        hit = seq.prefix
        if hit is None:
            return
        assert self.prefix_cache is not None
        seq.stats.num_cached_tokens = hit.tokens
        seq.stats.num_reused_blocks, seq.stats.num_missed_blocks = len(hit.blocks), hit.missed_blocks
        self.prefix_cache.restore(hit, seq.slot, self._caches())
        seq.draft_len = hit.tokens
        if self.context_tail is not None:
            seq.context_floor = max(0, hit.tokens - self.context_tail)

    def _publish(self, seq: BatchedSequence, prompt_only: bool = False) -> None:
        """Offer `seq`'s full blocks whose positions are final in its slot: the target's K/V (start),
        the drafter's context K/V (draft_len) and the tokens known on the host (prompt + output but
        the pending one; a commit capped at the budget or cut at a stop token advanced start past
        them). `prompt_only`: the prompt's blocks, and only once every one of them is final."""
        pc = self.prefix_cache
        if pc is None or seq.prefix is None or seq.slot < 0 or seq.error is not None or not seq.out:
            return
        prompt = seq.request.prompt_ids
        tokens = list(prompt) + seq.out[:-1]
        known = min(seq.start, len(tokens))  # positions final in the target's cache, their tokens known
        if (not prompt_only and self.proposer is not None and seq.draft_len < known
                and known // pc.block_tokens > seq.published):
            self._drafter_catch_up(seq, known)  # it ends before its drafter consumed its blocks
        final = min(seq.start, len(tokens), seq.draft_len if self.proposer is not None else seq.start)
        if prompt_only:
            if final < len(prompt):
                return
            final, seq.prompt_offered = len(prompt), True
        n = final // pc.block_tokens
        if n <= seq.published:
            return
        hashes = seq.prefix.hashes
        if n > len(hashes):  # blocks past the prompt's full ones: hashed on from the last of them
            hashes += block_hashes(tokens[: n * pc.block_tokens], pc.block_tokens, hashes[-1] if hashes else b"",
                                   first=len(hashes))
        pc.insert(hashes[:n], seq.slot, self._caches())
        seq.published = n

    def _drafter_catch_up(self, seq: BatchedSequence, upto: int) -> None:
        """The drafter consumes `seq`'s context up to position `upto` now (one eager pass of its row, as
        a shadow draft runs): a sequence that ends after a plain streak, or right after its first token,
        would otherwise leave blocks without drafter context, which the cache never takes. The context
        K/V are what a drafting step would write; the pass's block goes at `upto` (< max_seq_len, where
        a finished row's start may not be: a last commit capped at the budget advanced it further) and
        its K/V are never read."""
        assert self.proposer is not None
        rows = row_table([seq], 1)
        rows[0][START] = upto
        table = self.transfers.upload(rows)  # [1, 5]
        self.proposer.propose(table, self.passes.features, 1, upto - seq.draft_len, self.shapes.draft_width(upto),
                              first_slot=seq.slot)
        seq.draft_len = upto
        # counted with the cache, not as an eager pass of the step: it runs after the step's cost was
        # taken (a policy's sample never includes it)
        assert self.prefix_cache is not None
        self.prefix_cache.counters.drafter_catch_ups += 1

    # -- finishing -------------------------------------------------------------------------------
    def _fail(self, seq: BatchedSequence, finished: list[BatchedSequence]) -> None:
        """`seq`'s sampling had no distribution this step: it ends alone, nothing committed."""
        seq.error = sampling_failure(seq.request.params)
        finished.append(seq)

    def _retire(self, finished: list[BatchedSequence]) -> None:
        """Finish sequences and compact: the last row moves into each freed slot (after each finished
        sequence offered its blocks to the prefix cache)."""
        for s in finished:
            self._publish(s)
            if not s.out:  # cancelled before its first token
                s.result = GenerationResult(list(s.request.prompt_ids), [], s.stats)
            else:
                s.result = finish(list(s.request.prompt_ids), s.out, s.stop, s.stats, s.t0)
            if self.keep_features and self.passes.features is not None and s.slot >= 0:
                s.features = self.passes.features[s.slot, : s.start].to(torch.bfloat16, copy=True)  # [fed, n*H]

        def move_row(s: BatchedSequence, hole: int) -> None:
            self.passes.move_row(s.slot, hole, s.start)
            if self.proposer is not None:
                self.proposer.move_row(s.slot, hole, s.draft_len)

        self.scheduler.compact(finished, move_row)

    # -- figures ---------------------------------------------------------------------------------
    def graph_stats(self) -> dict[str, Any] | None:
        """Static shapes: what start-up captured (shapes, seconds, graph memory; on a CPU the same
        passes run eagerly, capture_s is their dry run) and what steps replayed since; None when off."""
        if self.graphs is None:
            return None
        return {"cuda_graphs": isinstance(self.graphs, CudaGraphPasses), "torch_compile": self.torch_compile,
                "row_buckets": list(self.shapes.rows_buckets),
                "widths": self.shapes.widths(), "draft_lengths": sorted(self._draft_lengths()),
                **self.graphs.counters.to_dict(), "eager_passes": dict(self.eager_passes),
                **self.transfers.to_dict()}

    def stats(self) -> dict[str, Any]:
        """Runtime-level figures: the policy's state and inputs, batch occupancy."""
        summary = self.policy.summary() if hasattr(self.policy, "summary") else {"policy": type(self.policy).__name__}
        out = {"steps": self.steps, "running": len(self.rows), "waiting": len(self.waiting),
               "max_batch": self.max_batch,
               "speculation": self.speculation.to_dict() if self.speculation is not None else None,
               "draft_vocab": self.draft_head.size if self.draft_head is not None else self.target.vocab_size,
               **summary}
        graphs = self.graph_stats()
        if graphs is not None:
            out["graphs"] = graphs
        out["prefix_cache"] = self.prefix_cache.stats() if self.prefix_cache is not None else None
        return out


def batched_generate(
    draft: DFlashDraftModel | None,
    target: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = GREEDY,
    max_batch: int | None = None,
    max_seq_len: int | None = None,
    speculation: SpeculationSettings | None = None,
    policy: SpeculationPolicy | None = None,
    arrivals: Sequence[int] | None = None,
    runtime: BatchedRuntime | None = None,
    cuda_graphs: bool | None = None,
) -> list[GenerationResult]:
    """Decode `prompts` together; prompt i joins at step `arrivals[i]` (default: all at once).
    `params`: one SamplingParams for every prompt, or one per prompt. draft=None decodes without
    speculation. Results in prompt order."""
    n = len(prompts)
    per_prompt = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != n:
        raise DFlashError(f"{len(per_prompt)} SamplingParams for {n} prompts; give one, or one per prompt")
    if runtime is None:
        need = max(len(p) + sp.resolve_max_tokens() for p, sp in zip(prompts, per_prompt))
        options = RuntimeOptions(max_batch=max_batch or n, max_seq_len=max_seq_len or need, cuda_graphs=cuda_graphs)
        runtime = BatchedRuntime(target, draft, options, speculation, RuntimeExtras(policy=policy)).start()
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    order = sorted(range(n), key=lambda i: arrivals[i])
    handles: dict[int, BatchedSequence] = {}
    step = 0
    while len(handles) < n or runtime.has_work():
        while len(handles) < n and arrivals[order[len(handles)]] <= step:
            i = order[len(handles)]
            handles[i] = runtime.add(SequenceRequest(list(prompts[i]), per_prompt[i]))
        runtime.step()
        step += 1
    return [handles[i].result for i in range(n)]  # type: ignore[misc]
