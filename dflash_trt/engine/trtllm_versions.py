"""Which TensorRT-LLM release accepts an `llm_api_options.yaml`: the version gate.

TensorRT-LLM's LLM-API models are pydantic with extra="forbid", so a release that lacks ONE key
the file writes refuses the whole file. `trtllm_fields.json` (beside this module, with its
sources) records, for every key dflash-trt may write, the first published release that has it
and upstream's default. From it:

- `strip_defaults` leaves out every key whose value equals upstream's default (it changes
  nothing, and a key that is not written cannot be refused by an older release);
- `requirements` / `min_version` give the oldest published release that accepts a given file
  (the build records it in the manifest; `dflash-trt doctor` compares it with what is installed);
- `accepts` / `behaves` answer, for the release an engine is built for (`build
  --tensorrt-llm-release`, default `container_release()`: the dflash-trt container's), whether it
  has a field (value) and whether it is known to behave some way with DFlash that no field shows
  (the table's "behaviours": None where no release was verified, so the build assumes the worst).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from dflash_trt.errors import DFlashError

FIELDS_FILE = Path(__file__).with_name("trtllm_fields.json")


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return json.loads(FIELDS_FILE.read_text(encoding="utf-8"))


def published_versions() -> list[str]:
    """Every published release in version order (PyPI and GitHub-only)."""
    pub = table()["published_versions"]
    return sorted(pub["pypi"] + pub["github_only"], key=Version)


def parse_version(text: str, what: str = "TensorRT-LLM version") -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise DFlashError(f"{what} {text!r} is not a version (expected e.g. 1.3.0rc27)")


def _fields() -> dict[str, dict[str, Any]]:
    return table()["fields"]


def container_release() -> str:
    """The TensorRT-LLM of the dflash-trt container's base image (deploy/container/image.json): the
    release an engine is built for unless the build names another."""
    from dflash_trt.resources import resource_dir

    record = json.loads((resource_dir("deploy") / "container" / "image.json").read_text(encoding="utf-8"))
    return str(record["base"]["tensorrt_llm"])


def dflash_first_release() -> str:
    """The first published release with DFlash (DFlashDecodingConfig)."""
    return _fields()["speculative_config.decoding_type"]["values"]["DFlash"]


def check_release(text: str, what: str = "--tensorrt-llm-release") -> str:
    """A published release that has DFlash, as written in the table; one line otherwise."""
    have = parse_version(text, what)
    published = published_versions()
    match = next((v for v in published if Version(v) == have), None)
    if match is None:
        raise DFlashError(f"{what} {text}: not a published TensorRT-LLM release (recorded: {published[0]} .. "
                          f"{published[-1]}, {FIELDS_FILE.name}); name one of them")
    first = dflash_first_release()
    if Version(match) < Version(first):
        raise DFlashError(f"{what} {text}: TensorRT-LLM has DFlash from {first}; build for {first} or later")
    return match


def engine_release(spec: Any) -> str:
    """The release a build spec's engine is for: its tensorrt_llm_release (checked), else the container's."""
    given = getattr(spec, "tensorrt_llm_release", None)
    return check_release(given) if given else container_release()


def accepts(release: str, dotted: str, value: Any = None) -> bool:
    """Whether `release` has the LLM-API key `dotted` (and, given, that value of it)."""
    entry = _fields().get(dotted)
    if entry is None:
        return False
    have = Version(release)
    if Version(entry["first_version"]) > have:
        return False
    by_value = entry.get("values")
    if value is None or not by_value:
        return True
    first = by_value.get(str(value))
    return first is not None and Version(first) <= have


def behaviour_release(name: str) -> str | None:
    """The first release known to behave as the table's `behaviours[name]` says (None: none verified)."""
    return table()["behaviours"][name]["first_version"]


def behaves(release: str, name: str) -> bool:
    """Whether `release` is known to behave as `behaviours[name]` says; False where not verified."""
    first = behaviour_release(name)
    return first is not None and Version(first) <= Version(release)


def upstream_default(dotted: str) -> Any:
    """TensorRT-LLM's default for an LLM-API key ("max_seq_len", "kv_cache_config.dtype"), or None."""
    return (_fields().get(dotted) or {}).get("default")


def _is_section(dotted: str, value: Any) -> bool:
    """A mapping that holds keys (kv_cache_config), not a mapping-valued field (draft_len_schedule:
    marked "leaf" in the table)."""
    return isinstance(value, dict) and not (_fields().get(dotted) or {}).get("leaf")


def _walk(opts: dict[str, Any], prefix: str = ""):
    """(dotted key, value) for every key of the file; sections are walked, not reported as leaves."""
    for key, value in opts.items():
        dotted = f"{prefix}{key}"
        yield dotted, value
        if _is_section(dotted, value):
            yield from _walk(value, dotted + ".")


def strip_defaults(opts: dict[str, Any]) -> dict[str, Any]:
    """A copy of `opts` without the keys whose value is upstream's default (recursively), and
    without the sections that leaves empty."""
    fields = _fields()

    def strip(section: dict[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in section.items():
            dotted = f"{prefix}{key}"
            if _is_section(dotted, value):
                inner = strip(value, dotted + ".")
                if inner or not value:  # a section left empty by stripping is left out too
                    out[key] = inner
                continue
            entry = fields.get(dotted)
            if entry is not None and entry.get("default") is not None and value == entry["default"]:
                continue
            out[key] = value
        return out

    return strip(opts, "")


def requirements(opts: dict[str, Any]) -> dict[str, str]:
    """{"key" or "key=value": first release that accepts it} for every key the file writes.

    A key missing from the table is a bug in dflash-trt (it would write something nobody checked
    against upstream), reported as such rather than guessed.
    """
    fields = _fields()
    needs: dict[str, str] = {}
    for dotted, value in _walk(opts):
        entry = fields.get(dotted)
        if entry is None:
            raise DFlashError(f"llm_api_options key {dotted!r} has no entry in {FIELDS_FILE.name}; "
                              "record its first TensorRT-LLM version there (with the source) before writing it")
        needs[dotted] = entry["first_version"]
        by_value = entry.get("values")
        if by_value and not isinstance(value, (dict, list)) and str(value) in by_value:
            needs[f"{dotted}={value}"] = by_value[str(value)]
    safe = behaviour_release("dflash_zero_draft_len_safe")
    if safe is not None and zero_draft_batches(opts):  # drafting 0 is safe only where the release floors it
        needs["speculative_config drafts 0 at a served batch size"] = safe
    return needs


def zero_draft_batches(opts: dict[str, Any]) -> list[tuple[int, int]]:
    """The batch sizes in 1..max_batch_size (as written, else upstream's default) at which
    TensorRT-LLM drafts 0 by the file's draft_len_schedule or max_concurrency (inclusive ranges)."""
    from dflash_trt.draft_len_schedule import DraftLenSchedule

    spec = opts.get("speculative_config") or {}
    served = int(opts.get("max_batch_size") or upstream_default("max_batch_size"))
    if spec.get("draft_len_schedule") is not None:
        schedule = DraftLenSchedule.from_mapping(spec["draft_len_schedule"])
    elif spec.get("max_concurrency") is not None:  # upstream: {max_concurrency: max_draft_len}
        schedule = DraftLenSchedule(((int(spec["max_concurrency"]), int(spec.get("max_draft_len") or 1)),))
    else:
        return []
    return schedule.zero_ranges(served)


def min_version(opts: dict[str, Any]) -> str:
    """The oldest published TensorRT-LLM release that accepts every key of `opts`."""
    needs = requirements(opts)
    return max(needs.values(), key=Version) if needs else published_versions()[0]


def unmet(required: dict[str, str], installed: str) -> dict[str, str]:
    """The subset of `required` that `installed` is too old for."""
    have = parse_version(installed, "installed TensorRT-LLM version")
    return {key: version for key, version in required.items() if Version(version) > have}
