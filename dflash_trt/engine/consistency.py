"""The manifest against the files it describes, and its paths inside the engine directory.

The manifest's sha256 list protects every other file, but nothing protects the manifest: an
edited ``draft.block_size`` or ``limits.max_seq_len`` would make `serve` size its caches and
refuse requests by numbers that are not the engine's. So `verify` re-derives each figure from
the hashed file that states it (draft/config.json, target/config.json, llm_api_options.yaml)
and refuses any disagreement; and no path the manifest names may leave the engine directory
(``files: {"../../etc/hostname": ...}`` would otherwise be read and hashed).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from dflash_trt.engine.manifest import MANIFEST_NAME, EngineManifest
from dflash_trt.errors import DFlashError

FIX = "the manifest was edited or belongs to another engine; rebuild or re-copy the engine"


def inside(root: Path, rel: str, what: str) -> Path:
    """root/rel, refused (DFlashError) unless it is a relative path that stays inside `root`,
    symbolic links included."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise DFlashError(f"{root}: {MANIFEST_NAME} {what} {rel!r} is not a relative path inside the engine "
                          f"directory; {FIX}")
    path = root / rel
    real_root = root.resolve()
    if path.resolve() != real_root and real_root not in path.resolve().parents:
        raise DFlashError(f"{root}: {rel} leads outside the engine directory (to {path.resolve()}); "
                          "replace the link with the file itself, or rebuild the engine")
    return path


def check_paths(root: Path, manifest: EngineManifest) -> None:
    """Every path the manifest names stays inside `root`."""
    inside(root, manifest.target.path, "target.path")
    inside(root, manifest.draft.path, "draft.path")
    inside(root, manifest.llm_api_options, "llm_api_options")
    for rel in manifest.files:
        inside(root, rel, "files entry")


def _differ(root: Path, field: str, stated: Any, source: str, actual: Any) -> None:
    if stated != actual:
        raise DFlashError(f"{root}: {MANIFEST_NAME} says {field}={stated} but {source} has {actual}; {FIX}")


def check_consistency(root: Path, manifest: EngineManifest, opts: dict[str, Any]) -> None:
    """The manifest's draft / target / limits figures equal those of the (hashed) files."""
    from dflash_trt.engine.archs import arch_from_config
    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.runtime.drafters.dflash import DFlashSettings

    draft_cfg_path = f"{manifest.draft.path}/config.json"
    draft_cfg = read_json(root / draft_cfg_path, what="drafter config")
    settings = DFlashSettings.from_config_dict(draft_cfg, where=str(root / draft_cfg_path))
    d = manifest.draft
    _differ(root, "draft.block_size", d.block_size, draft_cfg_path, settings.block_size)
    _differ(root, "draft.mask_token_id", d.mask_token_id, draft_cfg_path, settings.mask_token_id)
    _differ(root, "draft.target_layer_ids", d.target_layer_ids, draft_cfg_path, list(settings.target_layer_ids))

    target_cfg_path = f"{manifest.target.path}/config.json"
    arch = arch_from_config(read_json(root / target_cfg_path, what="target config"), name=manifest.name)
    t = manifest.target
    _differ(root, "target.architecture", t.architecture, target_cfg_path, arch.architecture)
    _differ(root, "target.num_layers", t.num_layers, target_cfg_path, arch.num_layers)
    _differ(root, "target.hidden_size", t.hidden_size, target_cfg_path, arch.hidden_size)
    _differ(root, "target.vocab_size", t.vocab_size, target_cfg_path, arch.vocab_size)

    yaml_name = manifest.llm_api_options
    spec = opts.get("speculative_config") or {}
    lim, m = manifest.limits, manifest.mapping
    for field, stated, key in (
        ("limits.max_batch_size", lim.max_batch_size, "max_batch_size"),
        ("limits.max_seq_len", lim.max_seq_len, "max_seq_len"),
        ("limits.max_num_tokens", lim.max_num_tokens, "max_num_tokens"),
        ("mapping.tp", m.tp, "tensor_parallel_size"),
        ("mapping.pp", m.pp, "pipeline_parallel_size"),
    ):
        if stated is not None:  # max_num_tokens: optional, absent from older manifests
            _differ(root, field, stated, f"{yaml_name} {key}", _effective(opts, key))
    _differ(root, "limits.max_draft_len", lim.max_draft_len, f"{yaml_name} speculative_config.max_draft_len",
            spec.get("max_draft_len"))
    if "mask_token_id" in spec:
        _differ(root, "draft.mask_token_id", d.mask_token_id, f"{yaml_name} speculative_config.mask_token_id",
                spec["mask_token_id"])
    if "target_layer_ids" in spec:
        _differ(root, "draft.target_layer_ids", d.target_layer_ids,
                f"{yaml_name} speculative_config.target_layer_ids", spec["target_layer_ids"])
    if lim.max_draft_len > d.block_size - 1:
        raise DFlashError(f"{root}: {MANIFEST_NAME} limits.max_draft_len={lim.max_draft_len} exceeds "
                          f"draft.block_size - 1 = {d.block_size - 1}; {FIX}")
    check_speculation(root, manifest, spec, draft_cfg)


def check_speculation(root: Path, manifest: EngineManifest, spec: dict[str, Any], draft_cfg: dict[str, Any]) -> None:
    """The drafter's family and attention needs, and the manifest's speculation record, against the
    drafter's config and speculative_config (upstream's own rules: llm_api.check_speculation_rules)."""
    from dflash_trt.engine.drafter_node import drafter_traits
    from dflash_trt.engine.trtllm_versions import upstream_default

    yaml_name, draft_cfg_path = manifest.llm_api_options, f"{manifest.draft.path}/config.json"
    traits = drafter_traits(draft_cfg, root / manifest.draft.path)
    if manifest.draft.family is not None:
        _differ(root, "draft.family", manifest.draft.family, draft_cfg_path, traits.family)
    backend = spec.get("attention_backend", upstream_default("speculative_config.attention_backend"))
    if traits.non_causal_sliding and backend == "TRTLLM":
        raise DFlashError(f"{root}: {yaml_name} speculative_config.attention_backend is TRTLLM, which TensorRT-LLM "
                          f"refuses for a drafter with non-causal sliding-window layers ({draft_cfg_path}); rebuild "
                          "(the build picks VANILLA for it)")
    info = manifest.speculation
    if info is None:  # an older manifest: nothing recorded to compare
        return
    _differ(root, "speculation.max_draft_len", info.max_draft_len, "limits.max_draft_len", manifest.limits.max_draft_len)
    written = spec.get("draft_len_schedule")
    _differ(root, "speculation.draft_len_schedule", info.draft_len_schedule, f"{yaml_name} "
            "speculative_config.draft_len_schedule", {int(b): int(k) for b, k in written.items()} if written else None)
    _differ(root, "speculation.rejection_sampling", info.rejection_sampling,
            f"{yaml_name} speculative_config.use_rejection_sampling", bool(spec.get("use_rejection_sampling", False)))
    _differ(root, "speculation.acceptance_rate_window", info.acceptance_rate_window,
            f"{yaml_name} speculative_config.acceptance_rate_window_size", spec.get("acceptance_rate_window_size"))
    _differ(root, "speculation.acceptance_rate_threshold", info.acceptance_rate_threshold,
            f"{yaml_name} speculative_config.acceptance_rate_threshold", spec.get("acceptance_rate_threshold"))


def _effective(opts: dict[str, Any], key: str) -> Any:
    """A top-level option's value: as written, else TensorRT-LLM's default (the build leaves keys
    equal to upstream's default out of the file)."""
    from dflash_trt.engine.trtllm_versions import upstream_default

    return opts[key] if key in opts else upstream_default(key)
