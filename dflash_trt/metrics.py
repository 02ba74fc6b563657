"""The vocabulary of speculative decoding, defined once and used everywhere.

Every CLI table, JSON file, Triton output and Prometheus metric uses these names:

- ``acceptance_length`` (tau) of one decoding step: tokens committed by that step, i.e. the
  accepted draft tokens PLUS the bonus/correction token the target itself sampled. A step that
  accepts nothing still has tau = 1 (plain decoding). "Mean acceptance length includes the bonus
  token" -- the field's convention (DFlash paper, vLLM, TensorRT-LLM).
- ``tau``: mean acceptance length over the steps of a request (= 1 + accepted / steps).
- ``total_draft_tokens`` (drafted): draft tokens proposed to the target for verification.
- ``total_accepted_draft_tokens`` (accepted): draft tokens the target kept.
- ``acceptance_rate``: accepted / drafted.
- ``per_position_acceptance[j]``: fraction of steps whose draft slot j+1 was accepted, among the
  steps that drafted slot j+1 (slot 1 is the first token after the anchor); the counts behind it are
  ``position_drafted[j]`` and ``position_accepted[j]``.
- ``num_drafts``: verification steps that drafted at least one token (vLLM's ``num_drafts``); a
  step of the adaptive policy that drafted nothing is a step but not a draft. Our ``tau`` averages
  over every step, vLLM's mean acceptance length (1 + accepted / num_drafts) over drafts only: the
  two agree when every step drafts.
- ``acceptance_histogram(K)[j]``: drafts that accepted exactly j tokens, j = 0..K (vLLM's
  per-request ``acceptance_histogram``, the bonus token excluded).
- ``ttft_s`` (time to first token): request start -> first output token (prefill).
- ``tpot_s`` (time per output token): (end - first token) / (output tokens - 1). The headline
  latency for speculation: it emits bursts, so inter-token latency (ITL) is bimodal and misleads.
- ``tokens_per_s``: output tokens / (end - start) for one request ("tokens/s per user"): what one
  user waits for a whole answer, queueing and prefill included.
- ``interactivity`` (per-user output speed): 1 / TPOT, tokens/s a user sees once the answer flows.
  The x axis of NVIDIA's throughput-vs-interactivity charts ("tokens/s per user" in the DFlash
  claim "15x the throughput at 500-600 tokens/s per user"), and what the bench frontier uses: it
  leaves out TTFT and queueing, which a closed loop of C users inflates with C for reasons that
  have nothing to do with decoding, so plain and DFlash compare on their decoding pace alone.

Across many requests (``dflash-trt bench``):

- ``total_tokens_per_s``: output tokens of all requests / wall time from the first request sent
  to the last one finished (throughput of the whole system, all users together).
- ``total_tokens_per_s_per_gpu``: ``total_tokens_per_s`` / the GPUs that served it (in process:
  one device; a server: ``--gpus`` or the engine's tp x pp).
- ``interactivity`` of a run: 1 / its mean ``tpot_s`` (:func:`interactivity`), so DFlash's
  interactivity over plain's at the same C is exactly the ``speedup``.
- ``speedup``: plain decoding's mean ``tpot_s`` / DFlash's mean ``tpot_s``, same target, same
  prompts, same run. With free drafting and a verify step as cheap as a plain step it is at most
  ``tau`` (the Leviathan bound), so the gap to ``tau`` is the cost of drafting and verifying.
- ``num_cached_tokens`` of a request: prompt tokens whose K/V (the drafter's context K/V with them)
  came from the batched runtime's prefix cache instead of its prefill (vLLM's per-request
  ``num_cached_tokens``, OpenAI's ``usage.prompt_tokens_details.cached_tokens``);
  ``num_reused_blocks`` / ``num_missed_blocks``: the prompt's blocks (runtime/batched/prefix_cache.py's
  BLOCK_TOKENS each, the partial last one a miss) served from the cache / computed (TensorRT-LLM's
  ``reused_blocks`` / ``missed_blocks``); ``kv_cache_hit_rate`` = reused / (reused + missed).
  Runtime-wide, ``prefix_cache_queries`` and ``prefix_cache_hits`` count TOKENS (prompt tokens
  looked up, tokens served), as vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
- distributions (ttft_s, tpot_s, tokens_per_s) are summarised as mean, p50, p90, p99 over requests
  (:func:`summarize`); tau and acceptance_rate are pooled over all steps (:func:`merge_stats`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


def time_per_output_token(first_to_end_s: float, num_output_tokens: int) -> float:
    """``tpot_s``: (end - first token) / (output tokens - 1); 0 below two tokens (no gap to time)."""
    return first_to_end_s / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0


def tokens_per_second(num_output_tokens: int, request_s: float) -> float:
    """``tokens_per_s`` of one request: output tokens / (end - start); 0 for an untimed request."""
    return num_output_tokens / request_s if request_s > 0 else 0.0


def interactivity(tpot_s: float) -> float:
    """``interactivity``: tokens/s per user as the text flows, 1 / TPOT; 0 where no TPOT was timed."""
    return 1.0 / tpot_s if tpot_s > 0 else 0.0


@dataclass
class GenerationStats:
    """Per-request statistics of one generation (DFlash or plain decoding)."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tau of every step
    draft_lengths: list[int] = field(default_factory=list)  # k of every step (0: it drafted nothing)
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    # index j: how many steps drafted / accepted draft slot j+1
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    total_time_s: float = 0.0
    finish_reason: str = "length"  # "stop" (stop token) or "length" (max_new_tokens)
    # prefix caching: prompt tokens served from the cache, and the prompt's blocks reused / computed
    num_cached_tokens: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0

    # -- recording -------------------------------------------------------------------------
    def record_step(self, drafted: int, accepted: int) -> None:
        """One verification step that proposed `drafted` tokens and kept `accepted` of them."""
        self.acceptance_lengths.append(accepted + 1)
        self.draft_lengths.append(drafted)
        self.total_draft_tokens += drafted
        self.total_accepted_draft_tokens += accepted
        while len(self.position_drafted) < drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for j in range(drafted):
            self.position_drafted[j] += 1
            self.position_accepted[j] += int(j < accepted)

    # -- derived figures ---------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def num_drafts(self) -> int:
        """Steps that drafted at least one token: every one of them drafted slot 1."""
        return self.position_drafted[0] if self.position_drafted else 0

    def acceptance_histogram(self, max_draft_len: int) -> list[int]:
        """[drafts that accepted exactly j tokens for j = 0..K] (steps that drafted nothing left out;
        never shorter than the longest draft seen, so no draft is lost to a K set too low)."""
        hist = [0] * (max(max_draft_len, *self.draft_lengths, 0) + 1)
        for k, length in zip(self.draft_lengths, self.acceptance_lengths):
            if k:
                hist[length - 1] += 1
        return hist

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        d = self.total_draft_tokens
        return self.total_accepted_draft_tokens / d if d else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def kv_cache_hit_rate(self) -> float:
        """The prompt's blocks served from the prefix cache / all its blocks (0 without blocks)."""
        blocks = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / blocks if blocks else 0.0

    @property
    def tpot_s(self) -> float:
        return time_per_output_token(self.total_time_s - self.ttft_s, self.num_output_tokens)

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_second(self.num_output_tokens, self.total_time_s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            num_steps=self.num_steps,
            num_drafts=self.num_drafts,
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            per_position_acceptance=self.per_position_acceptance,
            tpot_s=self.tpot_s,
            tokens_per_s=self.tokens_per_s,
            kv_cache_hit_rate=self.kv_cache_hit_rate,
        )
        return d


def merge_stats(stats: "list[GenerationStats]") -> GenerationStats:
    """Pool many requests' statistics: tau and acceptance_rate over ALL steps, not a mean of means.

    Times are summed (total_time_s, ttft_s), so only the step/token counts of the result are
    meaningful as rates; per-request latencies belong in :func:`summarize`.
    """
    out = GenerationStats()
    for s in stats:
        out.num_prompt_tokens += s.num_prompt_tokens
        out.num_output_tokens += s.num_output_tokens
        out.acceptance_lengths.extend(s.acceptance_lengths)
        out.draft_lengths.extend(s.draft_lengths)
        out.total_draft_tokens += s.total_draft_tokens
        out.total_accepted_draft_tokens += s.total_accepted_draft_tokens
        for j, (d, a) in enumerate(zip(s.position_drafted, s.position_accepted)):
            if j >= len(out.position_drafted):
                out.position_drafted.append(0)
                out.position_accepted.append(0)
            out.position_drafted[j] += d
            out.position_accepted[j] += a
        out.ttft_s += s.ttft_s
        out.total_time_s += s.total_time_s
        out.num_cached_tokens += s.num_cached_tokens
        out.num_reused_blocks += s.num_reused_blocks
        out.num_missed_blocks += s.num_missed_blocks
    return out


def summarize(values: "list[float]") -> dict[str, float]:
    """{"mean", "p50", "p90", "p99"} of per-request values (linear interpolation); zeros if empty."""
    import numpy as np

    if not values:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}
