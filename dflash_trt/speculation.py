"""`SpeculationSettings`: how many draft tokens a DFlash step verifies, defined once.

The vocabulary (the same letters in code, CLI help, manifest, README):

- **B** (``block_size``): the drafter's TRAINED block: [anchor, MASK x (B-1)]. The drafter
  always drafts the full block B in one pass, as it was trained (bidirectional attention inside
  the block: a shorter block changes its proposals); slot j proposes the token j positions after
  the anchor. Fixed by the checkpoint (config.json ``block_size``).
- **K** (``max_draft_len``): the most draft tokens one step verifies, 1 <= K <= B-1. A step
  verifies [anchor, draft_1..draft_k] with one target pass of k+1 tokens. It is what TensorRT-LLM
  calls ``max_draft_len`` (``speculative_config``), vLLM ``num_speculative_tokens``, and SGLang
  sizes as ``--speculative-num-draft-tokens`` = K + 1. An engine records it in its manifest
  (``limits.max_draft_len``, the memory plan is sized for it) and every runtime and backend
  reads it from there; ``--max-draft-len`` means K on `build`, `generate`, `serve`,
  `deploy triton` and `bench`.
- **k**: the draft tokens THIS step verifies, 0 <= k <= K (0 = a plain decoding step). The
  ``policy`` chooses it:
  - ``fixed``: k = K every step (the reference loop's schedule; deterministic, so the library's
    default: the same prompt gives the same steps whatever the machine's speed);
  - ``adaptive``: the batched runtime picks k per step from measured step costs and running
    acceptance, among candidates 0, 1, 3, 7, ... capped at K (runtime/batched/policy.py), so that sharing
    passes never makes DFlash slower than plain decoding. Serving opts into it.
  - ``schedule``: k = the **draft-length schedule**'s value at the step's batch size
    (``schedule``, a :class:`~dflash_trt.draft_len_schedule.DraftLenSchedule`: TensorRT-LLM's
    ``draft_len_schedule``, 0 = plain decoding above its largest batch size), what a node running
    the engine's ``llm_api_options.yaml`` does.

- **draft method** (``draft_method``): what a step drafts and how it is verified when it
  samples (temperature > 0; at temperature 0 every method drafts the argmax and accepts the
  longest exact match, which is what they all reduce to). All three are lossless:
  - ``match``: argmax drafts, exact-match acceptance against the target's own samples (April's
    z-lab, TensorRT-LLM's default and only method);
  - ``greedy``: argmax drafts verified by rejection sampling with a one-hot q (z-lab PR #169,
    vLLM's ``draft_sample_method: greedy``). Step by step the same distribution of accepted
    counts and tokens as ``match`` (accept x with probability p(x), else draw from p without x);
    only the random numbers are drawn differently;
  - ``probabilistic``: drafts sampled from the drafter's own distribution q and verified by
    rejection sampling against it (z-lab 0.1.0, vLLM's ``probabilistic``): DFlash v1 samples each
    slot independently from its tempered/nucleus logits, DFlash2's selector samples its walk
    from softmax(scores / T) over its top-k candidates. This project's default
    (``DEFAULT_DRAFT_METHOD``): the highest tau measured on the batched runtime.
  runtime/decoding/rejection.py holds the test; runtime/reference/generate.py picks by this setting.

At the end of a request's budget a step still drafts and verifies its k tokens and only what it
commits is capped (vLLM does the same; z-lab 0.1.0 shortens its last blocks instead, see
tests/test_zlab_oracle.py), so every step's acceptance equals that of the same request with a
larger budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dflash_trt.draft_len_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashError

Policy = Literal["adaptive", "fixed", "schedule"]
POLICIES: tuple[str, ...] = ("adaptive", "fixed", "schedule")
FIXED: Policy = "fixed"
ADAPTIVE: Policy = "adaptive"
SCHEDULE: Policy = "schedule"

DraftMethod = Literal["match", "greedy", "probabilistic"]
DRAFT_METHODS: tuple[str, ...] = ("match", "greedy", "probabilistic")
MATCH: DraftMethod = "match"
GREEDY_DRAFTS: DraftMethod = "greedy"
PROBABILISTIC: DraftMethod = "probabilistic"
# The default draft method, everywhere a run does not name one (generate, bench, serve's pytorch
# backend, the reference loop): the method with the highest tau on the batched runtime
# (docs/runtime.md, "Draft methods": the embedded pair at T = 0.6 and 1, paired by prompt). All
# three are lossless, so the default changes which seeded text a request gets, never its
# distribution. TensorRT-LLM's engine verifies by exact match only: its backend runs MATCH.
DEFAULT_DRAFT_METHOD: DraftMethod = PROBABILISTIC


def samples_drafts(method: str) -> bool:
    """Whether drafts are drawn from the drafter's q (at temperature > 0) rather than its argmax."""
    return method == PROBABILISTIC


def rejection_verified(method: str) -> bool:
    """Whether a sampled step verifies by rejection sampling (else by exact match)."""
    return method != MATCH


@dataclass(frozen=True)
class SpeculationSettings:
    """B, K, the policy and the draft method of one runtime (see the module docstring). Validated
    when built: a K outside 1..B-1, an unknown policy or method is a DFlashError naming the fix."""

    block_size: int  # B
    max_draft_len: int  # K
    policy: Policy = FIXED
    draft_method: DraftMethod = DEFAULT_DRAFT_METHOD
    schedule: DraftLenSchedule | None = None  # k by batch size (policy schedule; TensorRT-LLM's draft_len_schedule)

    def __post_init__(self) -> None:
        B, K = self.block_size, self.max_draft_len
        if B < 2:
            raise DFlashError(f"block_size={B}; DFlash needs block_size >= 2 (an anchor plus at least one draft)")
        if not 1 <= K <= B - 1:
            raise DFlashError(f"max_draft_len={K} (--max-draft-len) must be between 1 and block_size-1={B - 1}: the "
                              f"drafter's block holds the anchor plus B-1 drafts; choose K in 1..{B - 1}")
        if self.policy not in POLICIES:
            raise DFlashError(f"--policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.draft_method not in DRAFT_METHODS:
            raise DFlashError(f"draft method {self.draft_method!r} is not one of {', '.join(DRAFT_METHODS)}")
        if self.schedule is not None:
            self.schedule.check_against(K)
        elif self.policy == SCHEDULE:
            raise DFlashError("--policy schedule follows a draft-length schedule and none is given: pass "
                              "--draft-len-schedule (e.g. 4:7,16:3) or serve an engine whose build recorded one")

    @classmethod
    def for_block(cls, block_size: int, max_draft_len: int | None = None, policy: str | None = None,
                  draft_method: str | None = None, draft_len_schedule: str | None = None) -> "SpeculationSettings":
        """Settings for a drafter of block `block_size`: K defaults to B-1, the policy to fixed,
        the draft method to DEFAULT_DRAFT_METHOD; `draft_len_schedule` in its text form
        (``--draft-len-schedule``: ``1:15,8:3``, ``off``)."""
        K = block_size - 1 if max_draft_len is None else int(max_draft_len)
        schedule = DraftLenSchedule.parse(draft_len_schedule) if draft_len_schedule is not None else None
        return cls(int(block_size), K, policy or FIXED, draft_method or DEFAULT_DRAFT_METHOD,  # type: ignore[arg-type]
                   schedule)

    @classmethod
    def from_manifest(cls, manifest: Any, max_draft_len: int | None = None, policy: str | None = None,
                      draft_method: str | None = None, draft_len_schedule: str | None = None
                      ) -> "SpeculationSettings":
        """Settings of an engine (its manifest's draft.block_size and limits.max_draft_len).

        `max_draft_len` may lower K for this run, never raise it: the engine's memory plan (and
        TensorRT-LLM's KV and token budgets) were sized for the manifest's K. `draft_len_schedule`
        (text form; ``off``: none) replaces the schedule the engine's build recorded, which policy
        ``schedule`` otherwise follows, with its values capped at a lowered K."""
        built = int(manifest.limits.max_draft_len)
        K = built if max_draft_len is None else int(max_draft_len)
        if K > built:
            raise DFlashError(f"--max-draft-len {K} is above the {built} this engine was built for (its memory plan "
                              f"holds {built} drafts per step); use at most {built} or rebuild with --max-draft-len {K}")
        if draft_len_schedule is None and policy == SCHEDULE:
            recorded = manifest.draft_len_schedule()  # the node's, as the engine's build wrote it
            if recorded is not None:
                return cls(int(manifest.draft.block_size), K, SCHEDULE,
                           draft_method or DEFAULT_DRAFT_METHOD, recorded.capped(K))  # type: ignore[arg-type]
        return cls.for_block(int(manifest.draft.block_size), K, policy, draft_method, draft_len_schedule)

    def replace(self, **changes: Any) -> "SpeculationSettings":
        from dataclasses import replace

        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"block_size": self.block_size, "max_draft_len": self.max_draft_len, "policy": self.policy,
               "draft_method": self.draft_method}
        if self.schedule is not None:  # only where one is set: records without one read as before
            out["draft_len_schedule"] = self.schedule.to_mapping()
        return out
