"""Where an output departs from the reference, and how close the target's choice was there.

In float32 our runtimes' greedy outputs equal the reference loop's token for token. In bfloat16
they need not: a pass over 8 rows or 16 tokens rounds differently from one over 1, and where the
target's two best logits are nearly tied the rounding picks the other token; from there the texts
differ. A bare count ("5 of 8 identical") cannot tell that from a real loss, so each departing
output is reported with

- ``position``: the index of its first output token that differs from the reference's;
- ``margin``: the target's top-1 minus top-2 logit at that position, given the prompt and the
  reference's tokens before it (which the output shares), in the model's own dtype. A near-tie is
  rounding: bf16 logits near 16-32 are 0.125 apart, so 0 (an exact tie, seen on the embedded pair
  on a CPU) or one or two of those steps; a large margin means the runtime chose a token the target
  clearly did not, a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_divergence(out: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first token where `out` departs from `ref` (None: equal). One ending early
    departs where it ends."""
    for i, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return i
    return None if len(out) == len(ref) else min(len(out), len(ref))


def logit_margins(target: Any, prompt_ids: Sequence[int], ref_ids: Sequence[int]) -> list[float]:
    """margin[j] = top-1 minus top-2 of the target's logits for output position j, teacher-forced
    over prompt + ref (one pass): how decisively the target chose ref[j]. The logits of the model as
    loaded (bf16 logits tie exactly more often than float32 ones), their difference in float32."""
    import torch

    from dflash_trt.checkpoints.placement import home_device
    from dflash_trt.runtime.targets.adapter import TargetAdapter

    adapter = TargetAdapter(target)
    ids = list(prompt_ids) + list(ref_ids[:-1])  # the last output token predicts nothing we compare
    dev = home_device(target)
    with torch.inference_mode():
        x = torch.tensor([ids], device=dev)
        logits, _ = adapter.forward(x, torch.arange(len(ids), device=dev)[None], adapter.new_cache())
        top = logits[0, len(prompt_ids) - 1 :].float().topk(2, dim=-1).values  # [len(ref), 2]
    return (top[:, 0] - top[:, 1]).tolist()


def departures(outputs: Sequence[tuple[str, Sequence[int]]], reference: dict[str, Sequence[int]],
               margins: Any = None) -> list[dict[str, Any]]:
    """Each output (prompt_id, ids) that departs from its prompt's reference: prompt_id, position,
    and the margin there when `margins(prompt_id)` gives the reference's margins (None otherwise)."""
    out = []
    for pid, ids in outputs:
        pos = first_divergence(ids, reference[pid])
        if pos is None:
            continue
        m = margins(pid) if margins is not None else None
        out.append({"prompt_id": pid, "position": pos,
                    "margin": round(m[pos], 4) if m is not None and pos < len(m) else None})
    return sorted(out, key=lambda d: d["position"])


def describe(deps: Sequence[dict[str, Any]]) -> str:
    """'from 12, margin <= 0.06': the earliest departure and the largest margin among them."""
    if not deps:
        return ""
    margins = [d["margin"] for d in deps if d.get("margin") is not None]
    text = f"from {deps[0]['position']}"
    return text + (f", margin <= {max(margins):.2f}" if margins else "")
