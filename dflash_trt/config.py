"""Typed configuration, loaded one way everywhere: a YAML/JSON file, then flags, into a strict
pydantic model; any problem is ONE line naming the key, what it accepts and the fix.

    spec = load_config(BuildSpec, "build/qwen3-8b-h100-fp8.yaml", {"tp": 2, "gate.max_tau_drop": None},
                       what="build spec")

Every configuration of the product goes through :func:`load_config`: the build spec
(engine/spec.py), the bench config (bench/config.py), the train config (train/cli.py), the
engine manifest (engine/manifest.py), the serving settings of a model repository
(serving/repository.py) and the Slurm options (deploy/cli.py). The models themselves stay with
their areas and are ``extra="forbid"``: a misspelt key is an error, never silently ignored.

Resolution: the model's defaults < ``values`` (set by the program, None included) < the file
< ``flags`` (the command line; None = not given). Dotted flag keys (``gate.max_tau_drop``) reach
nested sections. A file may spell keys as flags do (``max-new-tokens``); ``.json`` files are read
as JSON, anything else as YAML (which JSON is a subset of).

Errors are :class:`DFlashError`, one line: where (the kind of config and its file), the key as
the user wrote it (dotted for a nested one), the value, what is accepted (the valid keys of
that section with the nearest spelling, or pydantic's accepted range / choices) and the fix:
the flag to change, or the file to correct, e.g.

    build spec s.yaml: unknown key 'gate.num_samples'; valid keys in gate: enabled, ...; correct or remove it in s.yaml
    bench config: max_new_tokens=0: Input should be greater than or equal to 1; change --max-new-tokens

Printing and recording: :func:`config_line` is the one line a command prints on stderr with its
resolved config; :func:`config_record` is the JSON-ready dict an artifact records (bench.json
``config``, the drafter's MANIFEST.json ``config``, dflash_trt_repo.json ``settings``, the engine
manifest's ``spec``).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dflash_trt.errors import DFlashError

M = TypeVar("M", bound=BaseModel)


def load_config(model: type[M], file: str | Path | None = None, flags: Mapping[str, Any] | None = None, *,
                what: str, values: Mapping[str, Any] | None = None, fix: str | None = None) -> M:
    """`model` from defaults < `values` < `file` < `flags` (see the module docstring).

    `what` names the config in messages ("build spec", "bench config"); `fix`, when given,
    replaces the generic advice (e.g. the engine manifest: "rebuild the engine").
    """
    where = f"{what} {file}" if file else what
    data: dict[str, Any] = dict(values or {})
    if file is not None:
        data.update(read_config_file(file, what, fix))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    for key, value in given.items():
        _set_dotted(data, key, value, where)
    data = _flag_spelling_to_fields(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise DFlashError(_one_line(e, model, where, file, set(given), fix)) from None


def read_config_file(path: str | Path, what: str, fix: str | None = None) -> dict[str, Any]:
    """The mapping in a YAML/JSON file; DFlashError when it is missing, unparsable or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{what} {path} not found; {fix or 'give the path of an existing YAML/JSON file'}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{what} {path} is not valid JSON ({e}); {fix or 'fix the file'}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise DFlashError(f"{what} {path} is not valid YAML ({' '.join(str(e).split())}); "
                              f"{fix or 'fix the file'}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DFlashError(f"{what} {path} must hold a mapping of key: value, not a {type(data).__name__}; "
                          f"{fix or 'fix the file'}")
    return data


def config_record(cfg: BaseModel) -> dict[str, Any]:
    """The resolved config as plain JSON types: what an artifact records."""
    return cfg.model_dump(mode="json")


def config_line(label: str, cfg: BaseModel) -> str:
    """`[label] resolved config: {...}`: the one line a command prints on stderr before it works."""
    return f"[{label}] resolved config: " + json.dumps(config_record(cfg), separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Internals: merging flags into the file's mapping, and naming what failed
# ---------------------------------------------------------------------------------------------

def _set_dotted(data: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    *sections, last = dotted.split(".")
    for name in sections:
        data = data.setdefault(name, {})
        if not isinstance(data, dict):
            raise DFlashError(f"{where}: {name} must be a mapping to hold {dotted}; fix {name} in the file")
    data[last] = value


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (unwrapping `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def _flag_spelling_to_fields(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`max-new-tokens` -> `max_new_tokens` where that names a field (sections too); other keys
    are kept as written, so an unknown one is reported the way the user spelt it."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        alt = key.replace("-", "_")
        if key not in model.model_fields and alt in model.model_fields:
            key = alt
        field = model.model_fields.get(key)
        section = _section_model(field.annotation) if field is not None else None
        out[key] = _flag_spelling_to_fields(section, value) if section and isinstance(value, dict) else value
    return out


def _key_of(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None]:
    """(the dotted key an error's `loc` names, the model of the section holding it).

    Past the last model on the path, list indices are kept ([i]) and pydantic's union-member
    tags ('str', 'list[str]') dropped."""
    parts: list[str] = []
    current: type[BaseModel] | None = model
    section: type[BaseModel] | None = model
    for part in loc:
        if current is not None and isinstance(part, str) and part in current.model_fields:
            parts.append(part)
            section = current
            current = _section_model(current.model_fields[part].annotation)
        elif current is not None and isinstance(part, str):  # an unknown key of this section
            parts.append(part)
            section = current
            current = None
        elif isinstance(part, int) and parts:
            parts[-1] += f"[{part}]"
    return ".".join(parts), section


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(e: ValidationError, model: type[BaseModel], where: str, file: str | Path | None,
              from_flags: set[str], fix: str | None) -> str:
    errors = e.errors()
    first = errors[0]
    key, section = _key_of(model, first["loc"])
    if not key:  # a check across fields (model_validator): its message names the options and the fix
        return f"{where}: {_message(first)}"
    if fix:
        advice = fix
    elif key in from_flags:  # a top-level key's flag is its name with dashes (`train-draft`, `bench`, `serve`)
        advice = f"change {'--' + key.replace('_', '-') if '.' not in key else f'the flag that sets {key}'}"
    else:
        advice = f"fix it in {file}" if file else "fix the value"
    if first["type"] == "extra_forbidden":
        leaf = key.rsplit(".", 1)[-1]
        valid = list(section.model_fields) if section is not None else []
        near = difflib.get_close_matches(leaf, valid, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        scope = f" in {key.rsplit('.', 1)[0]}" if "." in key else ""
        advice = fix or (f"correct or remove it in {file}" if file else "correct or remove it")
        return f"{where}: unknown key {key!r}{hint}; valid keys{scope}: {', '.join(valid)}; {advice}"
    if first["type"] == "missing":
        return f"{where}: {key} is required and missing; {fix or f'add {key}'}"
    # a union reports one error per member type: say every accepted form once
    same = [err for err in errors if _key_of(model, err["loc"])[0] == key]
    accepted = " or ".join(dict.fromkeys(_message(err) for err in same))
    return f"{where}: {key}={_shown(first.get('input'))}: {accepted}; {advice}"


def _message(err: Any) -> str:
    return str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
