"""What `dflash-trt plan` shows per TensorRT-LLM release: the speculative keys an engine of the
spec would write for it, and the oldest release that accepts that file.

The releases shown are the first with DFlash, the dflash-trt container's (the build's default),
the first with every field recorded (1.4.0rc1's fields), the newest recorded, and the one the spec
names; each row is what `build --tensorrt-llm-release R` would write (schedule_plan.decide and
llm_api.llm_api_options, as the build calls them). A release that refuses something the spec asks
for shows the one-line refusal instead of keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from dflash_trt.errors import DFlashError

SHOWN_KEYS = ("attention_backend", "draft_len_schedule", "context_recompute_tail")


@dataclass(frozen=True)
class ReleaseRow:
    release: str
    roles: tuple[str, ...]  # why the row is shown: first DFlash | container | all fields | newest | spec
    written: dict[str, Any] | None  # SHOWN_KEYS as written (absent: not written); None: refused
    max_draft_len: int | None
    min_version: str | None  # the oldest release accepting the file written for `release`
    refusal: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"release": self.release, "roles": list(self.roles), "written": self.written,
                "max_draft_len": self.max_draft_len, "min_tensorrt_llm_version": self.min_version,
                "refusal": self.refusal, "notes": list(self.notes)}


def shown_releases(spec: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(release, roles), in version order."""
    from dflash_trt.engine.trtllm_versions import (container_release, dflash_first_release, engine_release,
                                                   published_versions, table)

    newest_field = max((e["first_version"] for e in table()["fields"].values()), key=Version)
    picks = [(dflash_first_release(), "first DFlash"), (container_release(), "container"),
             (newest_field, "all fields"), (published_versions()[-1], "newest"), (engine_release(spec), "spec")]
    roles: dict[str, list[str]] = {}
    for release, role in picks:
        roles.setdefault(release, []).append(role)
    return [(r, tuple(roles[r])) for r in sorted(roles, key=Version)]


def release_rows(p: Any, measurement: Any = None) -> list[ReleaseRow]:
    """One row per shown release for a prepared build (engine/builder.Prepared)."""
    from dflash_trt.engine.llm_api import llm_api_options, speculative_fields
    from dflash_trt.engine.plan import DraftShape
    from dflash_trt.engine.schedule_plan import decide
    from dflash_trt.engine.trtllm_versions import min_version

    spec = p.spec
    shape = DraftShape.from_config(p.draft_cfg) if p.draft_cfg else DraftShape.estimate(p.arch, spec.draft_num_layers)
    non_causal = bool(p.drafter and p.drafter.non_causal_sliding)
    rows = []
    for release, roles in shown_releases(spec):
        try:
            decided = decide(spec, p.arch, shape, p.block_size, p.max_draft_len, p.recipe, p.expert_format,
                             release=release)
            fields = speculative_fields(spec, release, non_causal_sliding=non_causal, head_dim=p.draft_head_dim,
                                        measurement=measurement)
            opts = llm_api_options(spec, is_moe=p.arch.is_moe, max_draft_len=decided.max_draft_len,
                                   max_num_tokens=p.max_num_tokens, mask_token_id=int(p.mask_token_id or 0),
                                   target_layer_ids=p.target_layer_ids, dtype=p.dtype_name,
                                   expert_format=p.expert_format, schedule=decided.schedule, release=release,
                                   fields=fields)
        except DFlashError as e:
            rows.append(ReleaseRow(release, roles, None, None, None, str(e)))
            continue
        sc = opts["speculative_config"]
        written = {k: sc[k] for k in SHOWN_KEYS if k in sc}
        notes = tuple(f"{f.key}: {f.why}" for f in fields if f.key in SHOWN_KEYS)
        rows.append(ReleaseRow(release, roles, written, decided.max_draft_len, min_version(opts), notes=notes))
    return rows


def render_rows(rows: list[ReleaseRow], console: Any) -> None:
    from rich.table import Table

    t = Table(title="What each TensorRT-LLM release gets (speculative_config; build --tensorrt-llm-release R)")
    for col in ("release", "shown as", "attention_backend", "draft_len_schedule", "context_recompute_tail",
                "file needs"):
        t.add_column(col)
    for r in rows:
        if r.written is None:
            t.add_row(r.release, ", ".join(r.roles), f"refused: {r.refusal}", "", "", "")
            continue
        schedule = r.written.get("draft_len_schedule")
        t.add_row(r.release, ", ".join(r.roles), str(r.written.get("attention_backend", "VANILLA (default)")),
                  ",".join(f"{b}:{k}" for b, k in schedule.items()) if schedule else "none",
                  str(r.written.get("context_recompute_tail", "-")), f">= {r.min_version}")
    console.print(t)
    seen: set[str] = set()
    for r in rows:
        for n in r.notes:
            if n not in seen:
                seen.add(n)
                console.print(f"  {r.release}: {n}", markup=False, highlight=False, soft_wrap=True)
