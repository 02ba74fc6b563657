"""Per-position acceptance: how far into a block the target keeps a drafter's tokens.

``survival[j-1]`` = P(a >= j): the share of steps whose first j drafts were all accepted. With a
fixed draft length every step drafts every slot, so it is exactly dflash_trt.metrics'
``per_position_acceptance`` (slot j is accepted only if slots 1..j-1 were), which the acceptance
gate records. A step that drafts k tokens then commits, on average,

    E[tokens | k] = 1 + sum_{j <= k} P(a >= j)        (the bonus token included: tau)

which is what the draft-length schedule trades against the step's cost (engine/schedule_plan.py).

Where no gate has run (`plan`, a `--quant none` build) and no profile is given, the DEFAULT is a
geometric profile P(a >= j) = alpha^j whose tau over 15 drafts is 3.16, the DFlash paper's lowest
published tau (Qwen3-8B, Alpaca, block 16, temperature 0; shared/design/dflash.md). Neither the
paper nor z-lab publish per-position figures, or any for their gpt-oss drafters; the lowest
published tau makes the conservative default (a schedule derived from it drafts less at large
batches than one from the paper's math rows, 6-8). A measured profile replaces it:
`--acceptance-profile 0.55,0.28,0.15` (P(a >= 1), P(a >= 2), ...) or `tau:2.1` (geometric).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import DFlashError

FLAG = "--acceptance-profile"
DEFAULT_TAU = 3.16
DEFAULT_DRAFTS = 15
DEFAULT_SOURCE = (f"default: geometric, tau {DEFAULT_TAU} over {DEFAULT_DRAFTS} drafts (the DFlash paper's lowest "
                  "published tau: Qwen3-8B on Alpaca, block 16, T = 0; no per-position figures are published)")


@dataclass(frozen=True)
class AcceptanceProfile:
    """P(a >= j) for j = 1..len(survival), non-increasing in [0, 1]; positions past it count 0."""

    survival: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.survival:
            raise DFlashError(f"{FLAG}: an acceptance profile needs at least one position, e.g. 0.6,0.35,0.2")
        bad = [p for p in self.survival if not 0.0 <= p <= 1.0]
        if bad:
            raise DFlashError(f"{FLAG}: {bad[0]} is not a probability; give P(a >= 1), P(a >= 2), ... in [0, 1]")
        rising = next((j for j in range(1, len(self.survival)) if self.survival[j] > self.survival[j - 1] + 1e-9),
                      None)
        if rising is not None:
            raise DFlashError(f"{FLAG}: P(a >= {rising + 1}) = {self.survival[rising]} exceeds P(a >= {rising}) = "
                              f"{self.survival[rising - 1]}; a draft is accepted only after every draft before it, "
                              "so the profile cannot rise")

    def expected_tokens(self, k: int) -> float:
        """Tokens a step drafting k commits on average: 1 + sum_{j <= k} P(a >= j)."""
        return 1.0 + sum(self.survival[:k])

    def to_dict(self) -> dict[str, object]:
        return {"per_position_acceptance": [round(p, 6) for p in self.survival], "source": self.source}

    @classmethod
    def geometric(cls, tau: float, drafts: int, source: str) -> "AcceptanceProfile":
        """P(a >= j) = alpha^j with 1 + alpha + ... + alpha^drafts = tau (alpha by bisection)."""
        if not 1.0 <= tau <= drafts + 1:
            raise DFlashError(f"{FLAG} tau:{tau}: tau over {drafts} drafts lies in [1, {drafts + 1}]")
        lo, hi = 0.0, 1.0
        for _ in range(100):
            alpha = (lo + hi) / 2
            if sum(alpha**j for j in range(drafts + 1)) < tau:
                lo = alpha
            else:
                hi = alpha
        alpha = (lo + hi) / 2
        return cls(tuple(alpha**j for j in range(1, drafts + 1)), source)

    @classmethod
    def default(cls, drafts: int) -> "AcceptanceProfile":
        """The stated default (module docstring), over `drafts` positions."""
        base = cls.geometric(DEFAULT_TAU, DEFAULT_DRAFTS, DEFAULT_SOURCE)
        alpha = base.survival[0]
        return cls(tuple(alpha**j for j in range(1, drafts + 1)), DEFAULT_SOURCE)

    @classmethod
    def parse(cls, value: str | list[float] | tuple[float, ...], drafts: int, where: str = FLAG
              ) -> "AcceptanceProfile":
        """`0.55,0.28,0.15` (or a list) -> that profile; `tau:2.1` -> geometric over `drafts`."""
        if isinstance(value, (list, tuple)):
            return cls(tuple(float(p) for p in value), f"{where}: {list(value)}")
        text = str(value).strip()
        if text.lower().startswith("tau:"):
            try:
                tau = float(text[4:])
            except ValueError:
                raise DFlashError(f"{where} {text!r}: write tau:X with X a number, e.g. tau:2.1") from None
            return cls.geometric(tau, drafts, f"{where} {text}: geometric over {drafts} drafts")
        try:
            values = tuple(float(p) for p in text.split(",") if p.strip())
        except ValueError:
            raise DFlashError(f"{where} {text!r}: write P(a >= 1),P(a >= 2),... e.g. 0.55,0.28,0.15, or tau:2.1") \
                from None
        return cls(values, f"{where} {text}")

    @classmethod
    def measured(cls, drafted: list[int], accepted: list[int], source: str) -> "AcceptanceProfile | None":
        """From per-slot counts (GenerationStats.position_drafted / position_accepted); None when
        nothing was drafted. A running minimum keeps it non-increasing where slots were drafted by
        different numbers of steps (a request's last step)."""
        out: list[float] = []
        for d, a in zip(drafted, accepted):
            if not d:
                break
            out.append(min(a / d, out[-1]) if out else a / d)
        return cls(tuple(out), source) if out else None
