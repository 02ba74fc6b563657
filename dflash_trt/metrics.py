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
  steps that drafted slot j+1 (slot 1 is the first token after the anchor).
- ``ttft_s`` (time to first token): request start -> first output token (prefill).
- ``tpot_s`` (time per output token): (end - first token) / (output tokens - 1). The headline
  latency for speculation: it emits bursts, so inter-token latency (ITL) is bimodal and misleads.
- ``tokens_per_s``: output tokens / (end - start) for one request ("tokens/s per user").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Per-request statistics of one generation (DFlash or plain decoding)."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tau of every step
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    # index j: how many steps drafted / accepted draft slot j+1
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    total_time_s: float = 0.0
    finish_reason: str = "length"  # "stop" (stop token) or "length" (max_new_tokens)

    # -- recording -------------------------------------------------------------------------
    def record_step(self, drafted: int, accepted: int) -> None:
        """One verification step that proposed `drafted` tokens and kept `accepted` of them."""
        self.acceptance_lengths.append(accepted + 1)
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
    def tpot_s(self) -> float:
        n = self.num_output_tokens
        return (self.total_time_s - self.ttft_s) / (n - 1) if n > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            num_steps=self.num_steps,
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            per_position_acceptance=self.per_position_acceptance,
            tpot_s=self.tpot_s,
            tokens_per_s=self.tokens_per_s,
        )
        return d
