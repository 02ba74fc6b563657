"""`dflash-trt verify ENGINE`: the manifest's schema, its paths inside ENGINE, every file's sha256, the
LLM-API YAML, and the manifest's figures against the files that state them (engine/consistency.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dflash_trt.engine.manifest import MANIFEST_NAME, EngineManifest, load_manifest
from dflash_trt.errors import DFlashError

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Every regular file under root except the manifest, as sorted POSIX relative paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def hash_tree(root: Path) -> dict[str, str]:
    return {rel: sha256_file(root / rel) for rel in list_files(root)}


def verify_engine(engine_dir: str | Path) -> EngineManifest:
    """Raise DFlashError naming the first bad file; return the manifest when all is well."""
    import yaml

    from dflash_trt.engine.llm_api import check_llm_api_options

    from dflash_trt.engine.consistency import check_consistency, check_paths, inside

    root = Path(engine_dir)
    manifest = load_manifest(root)
    check_paths(root, manifest)  # before anything is read: no path may leave the engine directory
    for rel, digest in sorted(manifest.files.items()):
        path = root / rel
        if not path.is_file():
            raise DFlashError(f"{root}: {rel} is missing (listed in {MANIFEST_NAME}); rebuild or re-copy the engine")
        actual = sha256_file(path)
        if actual != digest:
            raise DFlashError(f"{root}: {rel} is modified or corrupt (sha256 {actual[:12]}... != {digest[:12]}... "
                              "in the manifest); rebuild or re-copy the engine")
    for rel in list_files(root):  # a link in the tree to a file elsewhere is refused, listed or not
        inside(root, rel, "file")
    extra = [rel for rel in list_files(root) if rel not in manifest.files]
    if extra:
        raise DFlashError(f"{root}: {extra[0]} is not listed in {MANIFEST_NAME}; remove it or rebuild the engine")
    opts_path = root / manifest.llm_api_options
    if not opts_path.is_file():
        raise DFlashError(f"{root}: {manifest.llm_api_options} is missing; rebuild the engine")
    try:
        opts = yaml.safe_load(opts_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise DFlashError(f"{opts_path}: invalid YAML ({' '.join(str(e).split())}); rebuild the engine")
    check_llm_api_options(opts, where=str(opts_path))
    for sub in (manifest.target.path, manifest.draft.path):
        if not (root / sub / "config.json").is_file():
            raise DFlashError(f"{root}: {sub}/config.json missing; rebuild the engine")
    check_consistency(root, manifest, opts)
    return manifest
