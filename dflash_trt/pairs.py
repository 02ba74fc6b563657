"""Which target/drafter pair a command runs, resolved once for `generate`, `bench` and scripts.

A pair comes from (first match wins):

1. an engine directory (``--engine``): its dequantized target, drafter and tokenizer, every file
   re-checked against the manifest, and the speculation settings the engine was built for
   (``limits.max_draft_len``);
2. ``--tiny``: a tiny random pair (no checkpoint, no tokenizer; smoke tests);
3. ``--target DIR --draft DIR``: checkpoints in HF / z-lab format;
4. nothing: the embedded default pair (SmolLM2-135M-Instruct and the committed drafter).

The result carries what every caller needs next to the weights: the tokenizer contract
(:class:`~dflash_trt.runtime.tokens.TextCodec`) and the :class:`SpeculationSettings` of this run
(K from the engine or the drafter, lowered by ``--max-draft-len``, and the ``--policy``).
Loaded straight onto `device`: CPU-packed linear layers (runtime/cpu_packing.py) cannot be moved
to a GPU afterwards, so a pair must never be loaded on CPU and then moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.tokens import TextCodec
from dflash_trt.speculation import SpeculationSettings


@dataclass
class ResolvedPair:
    target: Any  # transformers PreTrainedModel
    draft: Any  # DFlashDraftModel
    tokenizer: Any | None
    codec: TextCodec
    speculation: SpeculationSettings
    manifest: Any | None = None  # EngineManifest when the pair came from an engine directory


def resolve_pair(target_dir: str | Path | None = None, draft_dir: str | Path | None = None, *,
                 engine_dir: str | Path | None = None, tiny: bool = False, dtype: str = "float32",
                 device: str = "cpu", allow_pickle: bool = False, max_draft_len: int | None = None,
                 policy: str | None = None, pack: bool = True) -> ResolvedPair:
    """Load the pair to run (see the module docstring); DFlashError on conflicting sources. `pack`:
    oneDNN-packed linear layers for float32 on CPU (runtime/cpu_packing.py; benchmarks turn it off)."""
    from dflash_trt.checkpoints.placement import runtime_device
    from dflash_trt.runtime.loading import LoadedPair, load_pair

    runtime_device(device, kinds=("cpu", "cuda", "meta"))  # before anything loads: a bad --device is one line
    manifest = None
    if engine_dir is not None:
        if target_dir or draft_dir or tiny:
            raise DFlashError("--engine already holds the target and drafter; drop --target/--draft/--tiny")
        from dflash_trt.engine.loader import load_engine
        from dflash_trt.engine.manifest import load_manifest

        manifest = load_manifest(engine_dir)
        speculation = SpeculationSettings.from_manifest(manifest, max_draft_len, policy)  # refuse before loading
        pair = load_engine(engine_dir, dtype=dtype, device=device, pack=pack)
    else:
        if tiny:
            if target_dir or draft_dir:
                raise DFlashError("--tiny uses a random pair; drop --target/--draft")
            from dflash_trt.runtime.tiny import random_draft, tiny_target

            target = tiny_target("llama")
            pair = LoadedPair(target.to(device), random_draft(target.config, num_layers=1, block_size=8).to(device),
                              None)
        else:
            if bool(target_dir) != bool(draft_dir):
                raise DFlashError("pass both --target and --draft, or neither (to use the embedded default pair)")
            if target_dir is None:
                from dflash_trt.embedded import default_pair_dirs

                target_dir, draft_dir = default_pair_dirs()
            pair = load_pair(target_dir, draft_dir, dtype=dtype, device=device, allow_pickle=allow_pickle, pack=pack)
        speculation = SpeculationSettings.for_block(pair.draft.block_size, max_draft_len, policy)
    limit = manifest.limits.max_seq_len if manifest is not None else None  # prompts are checked against it
    return ResolvedPair(pair.target, pair.draft, pair.tokenizer, TextCodec.of_pair(pair, limit), speculation, manifest)
