"""The measurement behind `context_recompute_tail`: tau with the drafter's context cut to the last N
prompt tokens, committed as ``context_recompute_tail.json`` beside this module (the prefix-caching
work, issue 57, produces it; this module only reads it).

TensorRT-LLM 1.4.0rc1's ``DFlashDecodingConfig.context_recompute_tail`` re-runs that many trailing
prompt tokens through the target on a prefix-cache hit, so the drafter gets their hidden states
(shared/design/upstream-2026-11.md). How many pay is the measurement's ``recommended``; the file
is absent until it is measured, and then nothing is written ("not measured" in the manifest).

Format (pydantic, extra=forbid; one line on anything else)::

    {"about": str, "commit": str, "command": str, "pair": str,
     "tau_by_tail": {"0": float, "16": float, "64": float, "256": float, "all": float},
     "interval_halfwidth": float, "recommended": int, "why": str}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

MEASUREMENT_FILE = Path(__file__).with_name("context_recompute_tail.json")
TAILS = ("0", "16", "64", "256", "all")  # the prompt tails measured, "all": the whole prompt


class RecomputeTailMeasurement(BaseModel):
    """One measurement of tau against the drafter's context tail (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    about: str
    commit: str
    command: str
    pair: str
    tau_by_tail: dict[str, float]
    interval_halfwidth: float = Field(ge=0)
    recommended: int = Field(ge=0)
    why: str

    @field_validator("tau_by_tail")
    @classmethod
    def _every_tail(cls, v: dict[str, float]) -> dict[str, float]:
        if sorted(v) != sorted(TAILS):
            raise ValueError(f"tau_by_tail must have exactly the tails {list(TAILS)}, got {sorted(v)}")
        if any(t < 1.0 for t in v.values()):
            raise ValueError("tau_by_tail values are tokens per step (>= 1)")
        return v

    def summary(self) -> str:
        taus = ", ".join(f"{k}: {self.tau_by_tail[k]:.2f}" for k in TAILS)
        return (f"measured on {self.pair} at {self.commit} (tau by tail {taus}; +-{self.interval_halfwidth:.2f}): "
                f"{self.why}")


def load_measurement(path: Path | None = None) -> RecomputeTailMeasurement | None:
    """The committed measurement (or the one at `path`); None when no file is there."""
    from dflash_trt.config import load_config

    path = MEASUREMENT_FILE if path is None else Path(path)
    if not path.is_file():
        return None
    return load_config(RecomputeTailMeasurement, path, what="context_recompute_tail measurement",
                       fix="re-run the measurement that writes it (issue 57's tail benchmark)")
