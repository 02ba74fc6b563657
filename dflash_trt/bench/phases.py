"""Where a decoding step's time goes: the target pass, the drafter pass, the draft head, the rest.

:class:`PassTimer` puts forward hooks on the modules a runtime calls (the target model, the
drafter, the head that turns draft hidden states into ids) and adds up their wall time per step,
without touching the runtime's code: whatever loop calls them (the reference loop, the batched
runtime) is measured the same way. Time inside a hooked module that another hooked module called
(the target's lm_head within the target's forward) counts once, for the outer one. "other" is the
step minus the hooked passes: masks and index tensors, the device-to-host copy, commits, Python.

Only on a CPU: a CUDA kernel runs after its launch returns, so per-pass host times mean nothing
there without a synchronisation, and adding one per pass would change what is measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PASSES = ("target", "draft", "head")


@dataclass
class StepTiming:
    """One decoding step: rows decoded, drafts verified per row (k), and seconds per pass."""

    rows: int
    k: int
    step_s: float
    passes: dict[str, float] = field(default_factory=dict)  # PASSES -> seconds
    target_tokens: int = 0  # tokens per row of the step's (last) target pass
    prefill: bool = False  # the step also prefilled newcomers: not a steady decoding step
    weight: int = 1  # steps this entry stands for (the reference loop: a request's mean step)

    @property
    def other_s(self) -> float:
        return max(self.step_s - sum(self.passes.values()), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "k": self.k, "step_s": self.step_s, "passes": dict(self.passes),
                "other_s": self.other_s, "prefill": self.prefill}


class PassTimer:
    """Forward hooks that add each pass's wall time into the current step (see the module doc).

    Use as a context manager around the runs; call :meth:`take` after each step."""

    def __init__(self, modules: dict[str, Any]) -> None:
        # name -> the module, or the modules, whose forward is that pass (a target's transformers
        # forward and its lean pass: runtime/targets/lean_forward.py)
        self.modules = {name: m if isinstance(m, tuple) else (m,) for name, m in modules.items() if m is not None}
        self._handles: list[Any] = []
        self._depth = 0
        self._t: float = 0.0
        self._outer = ""
        self.acc: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.last_tokens: dict[str, int] = {}

    def __enter__(self) -> "PassTimer":
        for name, modules in self.modules.items():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str):
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            self._depth += 1
            if self._depth == 1:
                self._outer, self._t = name, time.perf_counter()
                ids = kwargs.get("input_ids")
                x = ids if ids is not None else (args[0] if args else None)
                shape = getattr(x, "shape", None)
                if shape is not None and len(shape) >= 2:
                    self.last_tokens[name] = int(shape[1])
        return hook

    def _post(self, name: str):
        def hook(_module: Any, _args: Any, _out: Any) -> None:
            self._depth -= 1
            if self._depth == 0 and self._outer == name:
                self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - self._t
                self.calls[name] = self.calls.get(name, 0) + 1
        return hook

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds per pass, calls per pass) since the last take; resets both."""
        acc, calls = self.acc, self.calls
        self.acc, self.calls = {}, {}
        return acc, calls


def timer_for(target: Any, draft: Any = None, draft_head: Any = None) -> PassTimer | None:
    """A PassTimer over a pair's modules, or None where per-pass host times mean nothing (CUDA)."""
    from dflash_trt.checkpoints.placement import home_device

    if not hasattr(target, "parameters") or home_device(target).type != "cpu":
        return None
    from dflash_trt.runtime.targets.adapter import TargetAdapter

    head = target.get_output_embeddings() if draft_head is None else draft_head
    return PassTimer({"target": TargetAdapter(target).pass_modules(), "draft": draft,
                      "head": head if draft is not None else None})


def summarize_steps(steps: list[StepTiming]) -> dict[str, Any]:
    """Steady steps (no prefill) grouped by k: count, mean rows, mean seconds per pass and in all."""
    by_k: dict[int, list[StepTiming]] = {}
    for s in steps:
        if not s.prefill and s.weight > 0:
            by_k.setdefault(s.k, []).append(s)
    out: dict[str, Any] = {}
    for k, ss in sorted(by_k.items()):
        n = sum(s.weight for s in ss)

        def mean(value) -> float:
            return sum(s.weight * value(s) for s in ss) / n

        out[str(k)] = {
            "steps": n,
            "rows_mean": mean(lambda s: s.rows),
            "step_s": mean(lambda s: s.step_s),
            **{f"{p}_s": mean(lambda s, p=p: s.passes.get(p, 0.0)) for p in PASSES},
            "other_s": mean(lambda s: s.other_s),
        }
    return out
