"""config.json that both transformers generations read the same way.

transformers 5 saves RoPE as one `rope_parameters` dict (`{rope_theta, rope_type, factor, ...}`)
and no top-level `rope_theta` / `rope_scaling`. TensorRT-LLM pins transformers 4.57.x, whose
config classes read `rope_theta` and `rope_scaling` and, finding neither, fall back to the class
default (10000 for Llama and Qwen3): a different model and no error. TensorRT-LLM's own
`RopeParams.from_config` reads the same two attributes (sources and commits in
tests/upstream/tensorrt_llm_node.json). So every config.json an engine ships carries both:

- `rope_theta` = rope_parameters["rope_theta"];
- `rope_scaling` = rope_parameters without rope_theta, or null for the default RoPE;
- `rope_parameters` unchanged.

transformers 5 reads the result back unchanged: it takes `rope_scaling` as the parameters and
`rope_theta` beside it (modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict).
Where the build copies a source checkpoint's config, the source's own `rope_theta` /
`rope_scaling` are kept as they were; one that disagrees with `rope_parameters` is an error.

tokenizer_config.json likewise: transformers 5 names its generic tokenizers-backed class
`TokenizersBackend`, which 4.57's AutoTokenizer refuses ("does not exist or is not currently
imported"); `PreTrainedTokenizerFast` is the same tokenizer.json to both generations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")
# tokenizer_class names transformers 5 writes that 4.57 lacks -> the class both load the same way
TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def tokenizer_config_both_generations(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (tokenizer_config.json) with a tokenizer_class both transformers generations know."""
    name = config.get("tokenizer_class")
    return {**config, "tokenizer_class": TOKENIZER_CLASSES[name]} if name in TOKENIZER_CLASSES else config


def _legacy_rope(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """{rope_theta, rope_scaling} as transformers 4.x spells `rope_parameters`."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    default = _rope_type(scaling) == "default" and set(scaling) <= {"rope_type", "type"}
    out: dict[str, Any] = {"rope_scaling": None if default else scaling}
    if "rope_theta" in rope_parameters:
        out["rope_theta"] = rope_parameters["rope_theta"]
    return out


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return "default" if not scaling else str(scaling.get("rope_type", scaling.get("type", "default")))


def _agrees(key: str, kept: Any, derived: Any) -> bool:
    """Whether a kept 4.x key means what rope_parameters says. transformers 5 may add keys it
    derives (original_max_position_embeddings), so only the keys the kept value has are compared."""
    if key == "rope_theta":
        return isinstance(kept, (int, float)) and float(kept) == float(derived)
    if kept is None or derived is None:
        return kept is None and derived is None
    if not isinstance(kept, dict) or _rope_type(kept) != _rope_type(derived):
        return False
    return all(k in ("rope_type", "type") or (k in derived and derived[k] == v) for k, v in kept.items())


def both_generations(config: dict[str, Any], source: dict[str, Any] | None = None,
                     where: str = "config.json") -> dict[str, Any]:
    """`config` with the keys transformers 4.57 reads beside those transformers 5 wrote.

    `source`: the checkpoint the build started from; its own `rope_theta` / `rope_scaling` are
    kept where `config` lacks them (an export rewrites config.json in transformers 5's form).
    """
    out = dict(config)
    for key in LEGACY_ROPE_KEYS:
        if source is not None and key in source and key not in out:
            out[key] = source[key]
    rope = out.get("rope_parameters")
    # Per-layer-type dicts ({"full_attention": {...}, "sliding_attention": {...}}) have no
    # single 4.x spelling; the architectures this project builds (Llama, Qwen3, gpt-oss) use one.
    if not isinstance(rope, dict) or not rope or all(isinstance(v, dict) for v in rope.values()):
        return out
    for key, value in _legacy_rope(rope).items():
        if key not in out:
            out[key] = value
        elif not _agrees(key, out[key], value):
            raise DFlashError(f"{where}: {key}={out[key]!r} disagrees with rope_parameters={rope!r}; the two "
                              "transformers generations would build different models: fix the source config.json")
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DFlashError(f"{path}: cannot read it as JSON ({e}); re-export the checkpoint")


def rewrite_for_both_generations(directory: Path, source_dir: Path | None = None) -> bool:
    """Rewrite `directory`/config.json (:func:`both_generations`) and its tokenizer_config.json,
    if any (:func:`tokenizer_config_both_generations`), in place. True if a file changed."""
    from dflash_trt.fsutil import write_text_atomic

    path = Path(directory) / "config.json"
    source = None
    if source_dir is not None and (Path(source_dir) / "config.json").is_file():
        source = _read(Path(source_dir) / "config.json")
    changed = False
    for path, fix in ((path, lambda c: both_generations(c, source, where=str(path))),
                      (Path(directory) / "tokenizer_config.json", tokenizer_config_both_generations)):
        if not path.is_file():
            continue
        config = _read(path)
        fixed = fix(config)
        if fixed != config:
            write_text_atomic(path, json.dumps(fixed, indent=2, ensure_ascii=False) + "\n")
            changed = True
    return changed
