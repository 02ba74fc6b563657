"""Load an engine directory into the reference runtime (dequantized target, drafter, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.runtime.loading import LoadedPair


def load_engine(engine_dir: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                verify: bool = True, pack: bool = True) -> LoadedPair:
    """The engine's pair as the reference runtime runs it (`pack`: see load_pair). `dtype` "auto"
    resolves for `device` (runtime.loading.auto_dtype), as load_pair resolves it.

    `verify` re-checks every file's sha256 against the manifest first (a second or so for the
    embedded pair), so a tampered or half-copied engine fails with the bad file named.
    """
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.engine.verify import verify_engine
    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.runtime.cpu_packing import pack_cpu_linears
    from dflash_trt.runtime.draft_model import DFlashDraftModel
    from dflash_trt.runtime.loading import load_tokenizer, parse_dtype
    from dflash_trt.runtime.validate import validate_pair

    root = Path(engine_dir)
    manifest = verify_engine(root) if verify else load_manifest(root)
    dt = parse_dtype(dtype, device)
    tdir, ddir = root / manifest.target.path, root / manifest.draft.path
    target = load_checkpoint(tdir, dt, device)
    validate_pair(read_json(ddir / "config.json", what="drafter config"), target.config, where=str(ddir))
    draft = DFlashDraftModel.from_pretrained(ddir, dtype=dt, device=device)
    if pack:
        pack_cpu_linears(target)
        pack_cpu_linears(draft)
    return LoadedPair(target, draft, load_tokenizer(tdir))
