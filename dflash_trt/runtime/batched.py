"""Batched DFlash decoding with continuous batching: many sequences share each draft and verify pass.

One step over the n running rows (slots 0..n-1 of preallocated caches, see batched_cache.py):

    admit   waiting requests into free slots; prefill them in left-padded target passes
            (one per run of similar prompt lengths on a CPU)
    k       = policy.choose(n, K)                      0 = plain decoding (no draft pass)
    draft   one drafter pass over [each row's unconsumed context ; anchor, MASK x (B-1)]
            (the full trained block; slots 1..k are this step's drafts)
    verify  one target pass over [pending, draft_1..k] per row      -> logits [n, k+1, V]
    accept  a_i = longest prefix with draft == posterior (on device)
    sync    ONE device-to-host copy: posteriors, a_i, newcomers' first tokens
    commit  posterior[0..a_i] per row, capped at the tokens its budget has left; stop tokens,
            callbacks per row; rows that finished free their slot (the last row moves into the hole)

A row whose sampling parameters give no distribution (see sampling.sample_checked) fails alone:
it ends with ``error`` set and nothing committed from that step, the other rows of the step go on.

Rows differ in length, acceptance, budget and sampling parameters; every row drafts the full
block and verifies the step's k, also at its budget's tail (only the commit is capped, as in the
reference loop). Rollback is free: cache index == position, a 4D mask built from positions hides
everything past a row's committed length, and the next step overwrites it.

B, K and the policy come from :class:`~dflash_trt.speculation.SpeculationSettings`; the default
policy is fixed (k = K every step: deterministic, the reference loop's schedule). Serving opts
into the adaptive policy (runtime/policy.py).

Per sequence the output equals the reference loop's (dflash_generate) token for token at
temperature 0 (tests/test_batched_*.py), since every row sees exactly the K/V and context the
reference would. At temperature > 0 each row samples with its own generator, as the reference.

Unsupported here (falls back to the reference loop, see :func:`unsupported_reason`): targets
with sliding-window layers or attention sinks (GptOss), drafters with sliding-window layers,
and attention implementations that reject a 4D mask (flash_attention_2).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.checkpoints.placement import home_device, model_devices
from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.metrics import GenerationStats
from dflash_trt.runtime.batched_cache import BatchedDraftCache, BatchedKVCache, additive_mask
from dflash_trt.runtime.cuda_graphs import StepGraphs
from dflash_trt.runtime.draft_model import DFlashDraftModel
from dflash_trt.runtime.draft_vocab import DraftVocabHead
from dflash_trt.runtime.gqa_attention import ATTN_IMPLEMENTATION as GROUPED_SDPA
from dflash_trt.runtime.generate import GenerationResult, StepCallback, finish, truncate_at_stop
from dflash_trt.runtime.policy import AdaptivePolicy, Decision, FixedPolicy, SpeculationPolicy, make_policy
from dflash_trt.runtime.sampling import sample_checked
from dflash_trt.runtime.target import TargetAdapter
from dflash_trt.sampling_params import GREEDY, SamplingParams
from dflash_trt.speculation import SpeculationSettings

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
    return None


@dataclass
class SequenceRequest:
    prompt_ids: list[int]
    params: SamplingParams = GREEDY  # max_tokens None: 256; stop_token_ids end the sequence
    on_step: StepCallback | None = None  # called with each step's new tokens; True stops the sequence


@dataclass
class BatchedSequence:
    """Handle of one sequence in the runtime; `result` is set when it finishes."""

    request: SequenceRequest
    added_at: float = field(default_factory=time.perf_counter)
    order: int = 0  # its place in the order of add() calls
    result: GenerationResult | None = None
    # runtime state
    slot: int = -1
    out: list[int] = field(default_factory=list)
    start: int = 0  # positions in the target KV cache (committed tokens minus the pending one)
    draft_len: int = 0  # context positions already in the draft KV cache
    drafted_last: bool = False  # its previous step drafted: the drafter's backlog is that step's commits only
    stats: GenerationStats = field(default_factory=GenerationStats)
    t0: float = 0.0  # admission time (ttft_s and total_time_s are measured from here)
    generator: torch.Generator | None = None
    stop: frozenset[int] = frozenset()
    budget: int = 0  # tokens it may generate (its params' max_tokens, resolved)
    error: str | None = None  # why this sequence failed alone (its batch went on); set when it finished
    # with capture_layer_ids: the target's features [fed positions, n*H] (bfloat16), set at finish
    features: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def queue_s(self) -> float:
        return (self.t0 - self.added_at) if self.t0 else time.perf_counter() - self.added_at

    @property
    def remaining(self) -> int:
        return self.budget - len(self.out)


def calibration_tokens(num_candidates: int, block_size: int, reps: int = 3) -> int:
    """Tokens each dummy sequence of :meth:`BatchedRuntime.calibrate` may generate (its prompt
    comes on top): prefill, one untimed pass, then `reps` rounds over the candidates and one
    spare round (with CUDA graphs, samples of steps that captured a graph are retaken)."""
    return 2 + (2 + reps) * num_candidates * block_size


def _round_up(x: int, m: int, cap: int) -> int:
    return min(cap, -(-x // m) * m)


# A prefill pass pads every prompt to its longest one. On a CPU, where a padded token costs what a
# real one does (the pass is compute-bound: the embedded pair's mixed-length prompts at C=16 padded
# 29% of its tokens), newcomers are sorted by length and split into passes wherever padding would
# pass this share of a pass's tokens. On a GPU one pass: its cost there is launches, not tokens.
CPU_PREFILL_PAD_LIMIT = 0.15


def prefill_runs(lengths: Sequence[int], pad_limit: float) -> list[int]:
    """Sizes of consecutive runs of `lengths` (ascending), one prefill pass each: a run takes the
    next prompt while its padding to that (longest) prompt stays <= `pad_limit` of its tokens."""
    runs: list[int] = []
    count = total = 0
    for L in lengths:
        if count and (count + 1) * L - (total + L) > pad_limit * (count + 1) * L:
            runs.append(count)
            count = total = 0
        count, total = count + 1, total + L
    return runs + [count] if count else runs


# With static shapes, mask widths are rounded up to this: a few graphs per (rows, k) over a
# max_seq_len, and attending to <= 127 masked keys more costs a GPU next to nothing
GRAPH_WIDTH_MULTIPLE = 128


class BatchedRuntime:
    """Continuous-batching DFlash decoder over one target and one drafter (draft=None: plain
    batched decoding, the honest baseline at the same concurrency).

    Caches are allocated once for `max_batch` rows of `max_seq_len` positions (prompt + output).
    Not thread-safe: one thread calls add() and step() (the server's scheduler thread).

    cuda_graphs: run the draft and verify passes of greedy batches in static shapes (rows padded
    to a power of two <= max_batch on free slots that write only to the dump index, mask widths
    to multiples of 128, the drafter's context to the block) and, on a CUDA device, replay each
    shape as a captured CUDA graph (runtime/cuda_graphs.py). On a CPU the padded passes run
    eagerly: what the tests check token for token. Prefills, steps with sampled rows, and a
    drafter's catch-up over a long backlog stay eager.
    """

    def __init__(self, target: Any, draft: DFlashDraftModel | None = None, max_batch: int = 8,
                 max_seq_len: int = 2048, speculation: SpeculationSettings | None = None,
                 policy: SpeculationPolicy | None = None, width_multiple: int = 16, use_draft_vocab: bool = True,
                 capture_layer_ids: Sequence[int] | None = None, cuda_graphs: bool = False) -> None:
        """`speculation`: B, K and the policy (default: K = B-1, fixed). `policy`: a policy object
        that overrides the one `speculation` names (benchmarks, calibrated or probing policies)."""
        self.target = TargetAdapter(target)
        self.draft = draft
        why = unsupported_reason(self.target.model, draft)
        if why:
            raise DFlashError(f"batched runtime: {why}; use dflash_generate (the reference loop) for this pair")
        if max_batch < 1 or max_seq_len < 2:
            raise DFlashError(f"need max_batch >= 1 and max_seq_len >= 2, got {max_batch}, {max_seq_len}")
        self.speculation: SpeculationSettings | None = None
        if draft is not None:
            self.speculation = speculation or SpeculationSettings.for_block(draft.block_size)
            if self.speculation.block_size != draft.block_size:
                raise DFlashError(f"speculation settings are for block_size {self.speculation.block_size} but the "
                                  f"drafter's block is {draft.block_size}; build them from this drafter")
        self.block_size = draft.block_size if draft is not None else 1  # B: what a draft pass covers
        self.max_draft_len = self.speculation.max_draft_len if self.speculation is not None else 0  # K
        self.policy: SpeculationPolicy = policy or (make_policy(self.speculation) if self.speculation is not None
                                                     else FixedPolicy(0))
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.layer_ids = tuple(draft.target_layer_ids) if draft is not None else ()
        # capture_layer_ids: every finished sequence keeps the target's features at these layers
        # for every position it fed (train-draft's data: no second target pass over the answers)
        self.keep_features = capture_layer_ids is not None
        if capture_layer_ids is not None:
            ids = tuple(int(i) for i in capture_layer_ids)
            if draft is not None and ids != self.layer_ids:
                raise DFlashError(f"capture_layer_ids {list(ids)} differ from the drafter's target_layer_ids "
                                  f"{list(self.layer_ids)}; capture the drafter's layers or decode without it")
            if not ids or min(ids) < 0 or max(ids) >= self.target.num_layers:
                raise DFlashError(f"capture_layer_ids must name target layers 0..{self.target.num_layers - 1}, "
                                  f"got {list(ids)}")
            self.layer_ids = ids
        self.device = home_device(self.target.model)
        # positions 0..max_seq_len-1, + block padding of rows near their end, + the dump index
        capacity = max_seq_len + self.block_size + 1
        self.cache = BatchedKVCache(self.target.num_layers, max_batch, capacity)
        self.draft_cache = BatchedDraftCache(len(draft.layers), max_batch, capacity) if draft is not None else None
        self.capacity, self.dump = capacity, capacity - 1
        self.width_multiple = width_multiple  # mask widths rounded up: fewer distinct shapes
        self.prefill_pad_limit = CPU_PREFILL_PAD_LIMIT if self.device.type == "cpu" else float("inf")
        self.static_shapes = cuda_graphs
        if cuda_graphs:
            self.width_multiple = max(width_multiple, GRAPH_WIDTH_MULTIPLE)
        self.graphs: StepGraphs | None = StepGraphs(self.device) if cuda_graphs and self.device.type == "cuda" else None
        self.features: torch.Tensor | None = None  # [slots, capacity, n*H] target features by position
        # the draft argmax over the drafter's frequent-token subset when it ships one (lossless:
        # verification keeps the full vocabulary); None: over the target's whole lm_head
        self.draft_head: DraftVocabHead | None = None
        if draft is not None and use_draft_vocab and draft.draft_vocab is not None:
            if int(draft.draft_vocab.max()) >= self.target.vocab_size:
                raise DFlashError(f"the drafter's draft_vocab.json names token {int(draft.draft_vocab.max())}, beyond the "
                                  f"target's vocabulary ({self.target.vocab_size}); regenerate it with "
                                  f"`dflash-trt draft-vocab` or delete it")
            head = self.target.model.get_output_embeddings()
            self.draft_head = DraftVocabHead(head.weight, draft.draft_vocab)
        self.rows: list[BatchedSequence] = []  # rows[i].slot == i
        self.waiting: deque[BatchedSequence] = deque()
        self.steps = 0
        self._added = 0  # add() calls so far: BatchedSequence.order
        self.last_decision: Decision | None = None
        self._catching_up = False  # this step's draft pass also consumes a prompt or plain steps' commits
        self.step_captured = False  # the last step captured a CUDA graph

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
        seq = BatchedSequence(request, budget=n, order=self._added)
        self._added += 1
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

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
        t_step = time.perf_counter()
        n_old = len(self.rows)
        new = self._admit()
        first, first_bad = self._prefill(new) if new else (None, None)  # [m] on device
        decode = self._decode(n_old) if n_old else None  # (k, posterior [n, k+1], a [n], bad [n] | None)
        # a step that captured a CUDA graph timed the capture too: no cost sample (here, calibrate())
        self.step_captured = self.graphs is not None and self.graphs.take_captured_flag()
        # The ONE device-to-host synchronisation of the step.
        parts = []
        if decode is not None:
            parts += [decode[1].flatten(), decode[2]]
        if first is not None:
            parts.append(first)
        bads = [b for b in (decode[3] if decode is not None else None, first_bad) if b is not None]
        parts += [b.long() for b in bads]  # sampled rows only: which of them had no distribution
        host = torch.cat(parts).tolist() if parts else []
        bad_new = host[len(host) - len(new):] if first_bad is not None else [0] * len(new)
        if first_bad is not None:
            host = host[: len(host) - len(new)]
        bad_old = host[len(host) - n_old:] if decode is not None and decode[3] is not None else [0] * n_old
        if decode is not None and decode[3] is not None:
            host = host[: len(host) - n_old]
        finished: list[BatchedSequence] = []
        now = time.perf_counter()
        if decode is not None:
            k, post, _, _ = decode
            width = post.shape[1]
            flat, accepted = host[: n_old * width], host[n_old * width: n_old * width + n_old]
            for i, seq in enumerate(self.rows[:n_old]):
                if bad_old[i]:
                    self._fail(seq, finished)
                    continue
                a = int(accepted[i])
                if k > 0:
                    self.policy.observe_acceptance(k, a)  # what verification saw, whatever is committed
                left = seq.remaining  # >= 1: the commit is capped at the budget (the reference's rule)
                tokens = [int(t) for t in flat[i * width: i * width + a + 1]][:left]
                seq.stats.record_step(drafted=min(k, left - 1), accepted=len(tokens) - 1)
                seq.start += a + 1  # block[0..a] stay in the cache; posterior[a] is the new pending
                if self._commit(seq, tokens):
                    finished.append(seq)
            # Untimed: steps with a prefill, and drafting steps that first catch the drafter up on a
            # prompt or on plain steps' commits (their cost says nothing about steady drafting, and
            # a re-exploration probe after a long plain streak would otherwise price drafting out)
            if first is None and not self._catching_up and not self.step_captured:
                self.policy.observe_step(n_old, self.last_decision.k if self.last_decision else 0, now - t_step)
                if self.last_decision is not None:
                    self.last_decision.measured_s = now - t_step
        if first is not None:
            for seq, tok, bad in zip(new, host[len(host) - len(new):], bad_new):
                if bad:
                    self._fail(seq, finished)
                    continue
                seq.stats.ttft_s = now - seq.t0
                seq.start = len(seq.request.prompt_ids)
                if self._commit(seq, [int(tok)]):
                    finished.append(seq)
        self._retire(finished)
        self.steps += 1
        # in the order they were added, whatever their slots (slots follow prompt length, see _admit)
        return sorted(finished, key=lambda s: s.order)

    def run(self, max_steps: int | None = None) -> None:
        """Step until every added sequence finished (or `max_steps`)."""
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1

    # -- internals -------------------------------------------------------------------------------
    def _admit(self) -> list[BatchedSequence]:
        new: list[BatchedSequence] = []
        while self.waiting and len(self.rows) + len(new) < self.max_batch:
            new.append(self.waiting.popleft())
        new.sort(key=lambda s: len(s.request.prompt_ids))  # slots by length: prefill runs are contiguous
        for seq in new:
            req = seq.request
            seq.slot, seq.t0 = len(self.rows), time.perf_counter()
            seq.stats = GenerationStats(num_prompt_tokens=len(req.prompt_ids))
            seq.stop = frozenset(req.params.stop_token_ids)
            seed = req.params.seed
            seq.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            self.rows.append(seq)
        return new

    def _forward(self, rows: slice, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                 mask: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Target pass over `rows`: ids/positions/write [n, S], additive mask [n, 1, S, W] -> logits.
        Captured features go to self.features at the write indices."""
        self.cache.kv.prepare(rows, write, mask.shape[-1])
        logits, feats = self.target.forward(ids, positions, self.cache, self.layer_ids, logits_to_keep, mask)
        if feats is not None:  # [n, S, n_ctx*H]
            if self.features is None:
                self.features = torch.zeros((self.max_batch, self.capacity, feats.shape[-1]), dtype=feats.dtype,
                                            device=feats.device)
            r = torch.arange(rows.start, rows.stop, device=self.device)[:, None].expand_as(write)
            self.features[r, write] = feats
        return logits

    def _sample_rows(self, logits: torch.Tensor, seqs: Sequence[BatchedSequence]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # logits [n, S, V] -> tokens [n, S], bad [n] (None when every row is greedy). Greedy rows:
        # one argmax. Seeded rows: one by one, each with its own generator, consumed exactly as the
        # reference loop does (S draws a step). Unseeded sampled rows: one draw per (temperature,
        # top_p) group from the global generator; per-row calls cost ~10 kernel launches each,
        # which at hundreds of sampled rows on a GPU took longer than the target's forward.
        tokens = logits.argmax(-1)
        bad: torch.Tensor | None = None
        groups: dict[tuple[float, float], list[int]] = {}
        for i, seq in enumerate(seqs):
            r = seq.request.params
            if r.greedy:
                continue
            if bad is None:
                bad = torch.zeros(len(seqs), dtype=torch.bool, device=logits.device)
            if seq.generator is None:
                groups.setdefault((r.temperature, r.top_p), []).append(i)
                continue
            tokens[i], ok = sample_checked(logits[i], r.temperature, r.top_p, seq.generator)
            bad[i] = ~ok.all()
        for (temperature, top_p), idx in groups.items():
            rows = torch.tensor(idx, device=logits.device)
            tokens[rows], ok = sample_checked(logits[rows], temperature, top_p)  # [m, S]
            bad[rows] = ~ok.all(dim=-1)
        return tokens, bad

    def _prefill(self, new: list[BatchedSequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The newcomers' prompts (contiguous slots, ascending length) in one left-padded pass per
        run of similar lengths -> first tokens [m] and which rows had no distribution to sample
        from ([m], None when all are greedy)."""
        tokens, bads, i = [], [], 0
        for n in prefill_runs([len(s.request.prompt_ids) for s in new], self.prefill_pad_limit):
            t, b = self._prefill_pass(new[i : i + n])
            tokens.append(t)
            bads.append(b if b is not None else torch.zeros(n, dtype=torch.bool, device=self.device))
            i += n
        any_sampled = any(not s.request.params.greedy for s in new)
        return torch.cat(tokens), torch.cat(bads) if any_sampled else None

    def _prefill_pass(self, new: list[BatchedSequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompts of `new` (contiguous slots) in one pass -> first tokens [m], bad [m] | None."""
        dev, m = self.device, len(new)
        lens = [len(s.request.prompt_ids) for s in new]
        P = max(lens)
        ids = torch.zeros((m, P), dtype=torch.long)
        pos = torch.zeros((m, P), dtype=torch.long)
        write = torch.full((m, P), self.dump, dtype=torch.long)
        for i, (s, L) in enumerate(zip(new, lens)):
            ids[i, P - L:] = torch.tensor(s.request.prompt_ids)
            pos[i, P - L:] = torch.arange(L)
            write[i, P - L:] = torch.arange(L)
        ids, pos, write = ids.to(dev), pos.to(dev), write.to(dev)
        W = _round_up(P, self.width_multiple, self.dump)
        keys = torch.arange(W, device=dev)
        visible = (keys[None, None, None, :] <= pos[:, None, :, None]) & (write[:, None, :, None] != self.dump)
        visible = visible | (keys == 0)  # pad queries: see something (their output is discarded)
        rows = slice(new[0].slot, new[-1].slot + 1)
        logits = self._forward(rows, ids, pos, write, additive_mask(visible, self.target.dtype),
                               logits_to_keep=1)  # [m, 1, V]
        tokens, bad = self._sample_rows(logits, new)
        return tokens[:, -1], bad

    def _decode(self, n: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft + verify for rows 0..n-1. Returns (k, posterior [n, k+1], accepted [n], bad [n]:
        rows whose sampling had no distribution, None when all are greedy)."""
        dev, seqs = self.device, self.rows[:n]
        K = self.max_draft_len
        if self.draft is None:
            decision = Decision(n, 0, reason="plain")
        elif any(s.request.params.seed is not None and not s.request.params.greedy for s in seqs):
            # A seeded sample is a function of the draft schedule (each step draws k+1 tokens from
            # the row's generator). Pinning the reference loop's schedule (k = K) makes a seed
            # reproduce the same text under any load, and the same text as dflash_generate.
            decision = Decision(n, K, reason="seeded sampling pins the reference schedule")
        else:
            decision = self.policy.choose(n, K)
        self.last_decision = decision
        k = decision.k
        self._catching_up = k > 0 and not all(s.drafted_last for s in seqs)
        for s in seqs:
            s.drafted_last = k > 0
        greedy = all(s.request.params.greedy for s in seqs)
        N = self._pass_rows(n) if greedy else n  # rows n..N-1: padding on free slots (static shapes)
        pad = N - n
        starts = torch.tensor([s.start for s in seqs] + [0] * pad, device=dev)  # [N]
        arange = torch.arange(k + 1, device=dev)
        positions = starts[:, None] + arange  # [N, k+1]
        write = positions  # padding rows write only to the dump index
        if pad:
            write = torch.cat([positions[:n], torch.full((pad, k + 1), self.dump, device=dev)])
        block = torch.tensor([[s.out[-1]] for s in seqs] + [[0]] * pad, device=dev)  # [N, 1] pending tokens
        if k > 0:
            block = torch.cat([block, self._draft(seqs, N, starts, block, k)], dim=1)  # [N, k+1]
        W = self._width(max(s.start for s in seqs) + k + 1)
        keys = torch.arange(W, device=dev)
        visible = keys[None, None, None, :] <= positions[:, None, :, None]  # causal, per-row offset
        mask = additive_mask(visible, self.target.dtype)  # [N, 1, k+1, W]
        bad = None
        if greedy:
            post = self._verify_greedy(block, positions, write, mask)[:n]  # [n, k+1]
        else:
            logits = self._forward(slice(0, n), block, positions, write, mask)  # [n, k+1, V]
            post, bad = self._sample_rows(logits, seqs)
        # post[j] = the target's token after block[j]
        if k > 0:
            matches = block[:n, 1:] == post[:, :-1]  # [n, k]
            accepted = matches.int().cumprod(dim=1).sum(dim=1)
        else:
            accepted = torch.zeros(n, dtype=torch.long, device=dev)
        return k, post, accepted, bad

    def _pass_rows(self, n: int) -> int:
        """Rows a pass runs with: n, or with static shapes the next power of two (<= max_batch)."""
        return min(1 << (n - 1).bit_length(), self.max_batch) if self.static_shapes else n

    def _width(self, length: int) -> int:
        """Mask width (keys a pass attends over) for the longest row's `length` positions."""
        return _round_up(length, self.width_multiple, self.dump)

    def _verify_greedy(self, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Target pass over rows 0..N-1 -> the greedy posterior [N, S] (a graph per shape if enabled)."""
        N = ids.shape[0]

        def verify(ids, positions, write, mask):
            return (self._forward(slice(0, N), ids, positions, write, mask).argmax(-1),)

        if self.graphs is None:
            return verify(ids, positions, write, mask)[0]
        return self.graphs(("verify", N, ids.shape[1], mask.shape[-1]), verify, ids, positions, write, mask)[0]

    def _draft(self, seqs: list[BatchedSequence], N: int, starts: torch.Tensor, pending: torch.Tensor,
               k: int) -> torch.Tensor:
        """One drafter pass over every row's unconsumed context and its full block [pending, MASK x
        (B-1)] -> the first k drafts [N, k]. starts [N], pending [N, 1]; rows >= len(seqs) are
        padding (their context and block go to the dump index)."""
        assert self.draft is not None and self.draft_cache is not None and self.features is not None
        dev, n, B = self.device, len(seqs), self.block_size
        pad = N - n
        backlog = [s.start - s.draft_len for s in seqs] + [0] * pad  # >= 1 for real rows
        C = max(backlog)
        # steady drafting consumes <= k+1 new positions a row: one static context width per k
        graphed = self.static_shapes and C <= k + 1
        if graphed:
            C = k + 1
        cols = torch.arange(C, device=dev)
        ctx_pos = torch.tensor([s.draft_len for s in seqs] + [0] * pad, device=dev)[:, None] + cols  # [N, C]
        ctx_ok = cols[None, :] < torch.tensor(backlog, device=dev)[:, None]  # [N, C]
        ctx_pos = torch.where(ctx_ok, ctx_pos, (starts[:, None] - 1).clamp(min=0))  # padding reads a real row: finite
        block = torch.full((N, B), self.draft.mask_token_id, device=dev)  # [N, B]
        block[:, :1] = pending
        block_pos = starts[:, None] + torch.arange(B, device=dev)  # [N, B]
        block_write = block_pos if not pad else torch.cat([block_pos[:n], torch.full((pad, B), self.dump, device=dev)])
        draft_pos = torch.cat([ctx_pos, block_pos], dim=1)  # [N, C+B]
        write = torch.cat([torch.where(ctx_ok, ctx_pos, self.dump), block_write], dim=1)
        W = self._width(max(s.start for s in seqs) + B)
        visible = (torch.arange(W, device=dev)[None, :] < (starts + B)[:, None])[:, None, None, :]  # [N, 1, 1, W]
        mask = additive_mask(visible, self.target.dtype)  # keys < start + B: context and the row's own block

        def draft(ctx_pos, block, draft_pos, write, mask):  # a graph reads only its inputs and persistent buffers
            self.draft_cache.kv.prepare(slice(0, N), write, W)
            rows = torch.arange(N, device=ctx_pos.device)[:, None].expand_as(ctx_pos)
            ctx = self.features[rows, ctx_pos]  # [N, C, n_ctx*H]
            # [N, k, H]: the draft slots only (slot j predicts position start+j); the whole block is
            # still the drafter's input, as in the reference loop
            hidden = self.draft(ctx, self.target.embed(block), draft_pos, self.draft_cache, mask,
                                outputs=slice(1, k + 1))
            if self.draft_head is not None:
                return (self.draft_head(hidden),)  # [N, k] token ids
            return (self.target.lm_head(hidden).argmax(-1),)  # [N, k]

        inputs = (ctx_pos, block, draft_pos, write, mask)
        if graphed and self.graphs is not None:
            drafts = self.graphs(("draft", N, k, W), draft, *inputs)[0]
        else:
            drafts = draft(*inputs)[0]
        for s in seqs:
            s.draft_len = s.start
        return drafts

    def _fail(self, seq: BatchedSequence, finished: list[BatchedSequence]) -> None:
        """`seq`'s sampling had no distribution this step: it ends alone, nothing committed."""
        r = seq.request.params
        seq.error = (f"sampling failed: temperature={r.temperature} top_p={r.top_p} gives no probability "
                     f"distribution over the vocabulary (the tempered logits overflow); send a larger temperature "
                     f"(or 0 for greedy decoding)")
        finished.append(seq)

    def _commit(self, seq: BatchedSequence, new: list[int]) -> bool:
        """Append a step's tokens (already capped at its budget) to `seq`; True when it is finished."""
        new, stopped = truncate_at_stop(new, seq.stop)
        seq.out.extend(new)
        cb = seq.request.on_step
        if cb is not None and cb(new):
            stopped = True
        return stopped or seq.remaining <= 0

    def _retire(self, finished: list[BatchedSequence]) -> None:
        """Finish sequences and compact: the last row moves into each freed slot."""
        gone = {id(s) for s in finished}
        for s in finished:
            if not s.out:  # cancelled before its first token
                s.result = GenerationResult(list(s.request.prompt_ids), [], s.stats)
            else:
                s.result = finish(list(s.request.prompt_ids), s.out, s.stop, s.stats, s.t0)
            if self.keep_features and self.features is not None and s.slot >= 0:
                s.features = self.features[s.slot, : s.start].to(torch.bfloat16, copy=True)  # [fed, n*H]
        keep = [s for s in self.rows if id(s) not in gone]
        holes = sorted(s.slot for s in finished if s.slot < len(keep))
        movers = sorted((s for s in keep if s.slot >= len(keep)), key=lambda s: s.slot)
        for hole, s in zip(holes, movers):
            self.cache.kv.move_row(s.slot, hole, s.start)
            if self.draft_cache is not None:
                self.draft_cache.kv.move_row(s.slot, hole, s.draft_len)
            if self.features is not None:
                self.features[hole, : s.start] = self.features[s.slot, : s.start]
            s.slot = hole
        self.rows = sorted(keep, key=lambda s: s.slot)
        for s in finished:
            s.slot = -1

    @torch.inference_mode()
    def calibrate(self, batch_sizes: Sequence[int], prompt_len: int = 16, reps: int = 3,
                  progress: Any = None) -> None:
        """Measure the step cost of every candidate k at each batch size (dummy prompts, greedy)
        into the adaptive policy's cost table; online measurements refine it afterwards."""
        policy = self.policy
        if not isinstance(policy, AdaptivePolicy) or self.has_work():
            raise DFlashError("calibrate() needs an idle runtime with the adaptive policy")
        cands = list(policy.candidates or [0])
        budget = calibration_tokens(len(cands), self.block_size, reps)
        if prompt_len + budget > self.max_seq_len:
            raise DFlashError(f"max_seq_len={self.max_seq_len} is too small to calibrate ({prompt_len + budget} needed)")
        gen = torch.Generator().manual_seed(0)
        try:
            for n in batch_sizes:
                n = min(n, self.max_batch)
                seqs = [self.add(SequenceRequest(torch.randint(0, self.target.vocab_size, (prompt_len,), generator=gen)
                                                 .tolist(), SamplingParams(max_tokens=budget))) for _ in range(n)]
                self.policy = FixedPolicy(max(cands))
                self.step()  # prefill
                self.step()  # first decode pass also drafts the whole prompt's context: not timed
                # Rounds over all candidates, not all reps of one k after another, and the median,
                # not the minimum: k = 0 is re-measured online on every plain step (an average under
                # whatever load the machine has), so a k > 0 entry kept at its luckiest sample would
                # look cheaper than it is next to it, and the policy would speculate where it loses.
                # With CUDA graphs a step that captured one is not a sample (it includes the
                # capture); a spare round retakes it.
                samples: dict[int, list[float]] = {k: [] for k in cands}

                def timed_step(k: int, keep_captures: bool) -> None:
                    self.policy = FixedPolicy(k)
                    t = time.perf_counter()
                    self.step()
                    if keep_captures or not self.step_captured:
                        samples[k].append(time.perf_counter() - t)

                for _ in range(reps + (1 if self.graphs is not None else 0)):
                    for k in cands:
                        if len(samples[k]) < reps:
                            timed_step(k, keep_captures=False)
                for k in cands:
                    if not samples[k]:  # every round captured a new shape (widths grew): measure once more
                        timed_step(k, keep_captures=True)
                    cost = statistics.median(samples[k])
                    policy.costs.set(n, k, cost)
                    if progress is not None:
                        progress(n, k, cost)
                for s in seqs:
                    self.cancel(s)
        finally:
            self.policy = policy
            for s in list(self.rows):
                self.cancel(s)

    def stats(self) -> dict[str, Any]:
        """Runtime-level figures: the policy's state and inputs, batch occupancy."""
        summary = self.policy.summary() if hasattr(self.policy, "summary") else {"policy": type(self.policy).__name__}
        return {"steps": self.steps, "running": len(self.rows), "waiting": len(self.waiting),
                "max_batch": self.max_batch,
                "speculation": self.speculation.to_dict() if self.speculation is not None else None,
                "draft_vocab": self.draft_head.size if self.draft_head is not None else self.target.vocab_size,
                **summary}


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
    cuda_graphs: bool = False,
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
        runtime = BatchedRuntime(target, draft, max_batch=max_batch or n, max_seq_len=max_seq_len or need,
                                 speculation=speculation, policy=policy, cuda_graphs=cuda_graphs)
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
