"""What a run keeps for the record: its summary, gzip'd (``bench.summary.json.gz``).

A whole bench.json carries every request's token ids and per-step detail: 70-85 thousand lines a
run, ~1 MB, where its tables read none of it. docs/results/ keeps each run's summary instead,
small enough that a clone does not carry megabytes per measurement (tests/test_results.py holds
the folder under its budget):

- single-turn (bench.json schema 2): everything but ``requests``, as written (``bench report``
  builds its tables from these alone: the rows, the limits, the frontier, the environment and
  the command), and per request its identity, sizes and times (:data:`REQUEST_FIELDS`, times
  rounded to the microsecond): what a request finished at, in how many steps. Left out: the
  token ids (each row's ``identical`` is the verdict on them), the per-step acceptance lists
  (each row's ``per_position_acceptance`` pools them; the plots were drawn from them) and what
  the kept fields give again (TTFT = t_first - t_submit, latency = t_end - t_submit, tau);
- multi-turn: everything but the turns' token ids (each level's ``identical`` is the verdict);
  the turns' acceptance lengths stay, as tau's interval is bootstrapped over conversations.

``dflash-trt bench --out DIR`` writes it beside bench.json; ``dflash-trt bench summary
bench.json`` makes it from a finished run; ``dflash-trt bench report`` reads either.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

NAME = "bench.summary.json.gz"
REQUEST_FIELDS = ("side", "mode", "concurrency", "prompt_id", "num_prompt_tokens", "num_output_tokens", "num_steps",
                  "total_draft_tokens", "total_accepted_draft_tokens", "t_submit", "t_first", "t_end",
                  "finish_reason", "error")
TIMES = ("t_submit", "t_first", "t_end")


def _request(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: r.get(k) for k in REQUEST_FIELDS}
    for k in TIMES:
        if isinstance(out[k], float):
            out[k] = round(out[k], 6)
    return out


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """The part of a bench result docs/results/ keeps (the module docstring says what)."""
    if result.get("workload") == "multi-turn":
        records = {side: {c: [{k: v for k, v in t.items() if k != "output_ids"} for t in turns]
                          for c, turns in levels.items()}
                   for side, levels in result.get("records", {}).items()}
        return {**result, "records": records}
    return {**result, "requests": [_request(r) for r in result.get("requests", [])]}


def write_summary(result: dict[str, Any], path: str | Path) -> Path:
    """:func:`summary_of` `result`, as compact JSON, gzip'd into `path` (atomically)."""
    from dflash_trt.fsutil import atomic_file

    data = gzip.compress(json.dumps(summary_of(result), separators=(",", ":")).encode("utf-8"), compresslevel=9,
                         mtime=0)  # the same run, the same bytes
    path = Path(path)
    with atomic_file(path, needed_bytes=len(data)) as tmp:
        tmp.write_bytes(data)
    return path


def read_json(path: str | Path) -> Any:
    """A JSON file, gzip'd (``.gz``) or not."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw.decode("utf-8"))
