"""The one pair loader: which target/drafter pair a command runs, loaded as the runtime options say.

    pair = load_pair(PairSource(engine="engines/smol"), RuntimeOptions(device="cuda", dtype="bfloat16"))

`generate`, `bench`, `serve` (serving/backends.py), the scripts and the tests load every pair
through :func:`load_pair`. A pair comes from (first match wins, :class:`PairSource`):

1. an engine directory (``--engine``): its dequantized target, drafter and tokenizer, every file
   re-checked against the manifest first, and the speculation settings the engine was built for
   (``limits.max_draft_len``);
2. ``--tiny``: a tiny random pair (no checkpoint, no tokenizer; smoke tests);
3. ``--target DIR --draft DIR``: checkpoints in HF / z-lab format;
4. nothing: the embedded default pair (SmolLM2-135M-Instruct and the committed drafter).

Loading, in this order, so that bad input fails before the weights are read: the device
(checkpoints.placement.runtime_device), both configs and the pair's fit (runtime/drafters/validate.py),
the tokenizer, the target's weights (an engine's with the engine's own strict streaming reader,
a checkpoint's with transformers unless it is quantized), the drafter (runtime.drafters.loading.load_drafter:
the one place that reads which drafter a checkpoint holds), then the compute-dtype upcast and the
CPU packing of :class:`~dflash_trt.runtime_options.RuntimeOptions`. Models load straight onto the
device: CPU-packed linear layers (runtime/cpu/packing.py) cannot be moved to a GPU afterwards, so a
pair must never be loaded on CPU and then moved.

The result carries what every caller needs next to the weights: the tokenizer contract
(:class:`~dflash_trt.runtime.decoding.tokens.TextCodec`) and the :class:`SpeculationSettings` of this run
(K from the engine or the drafter, lowered by ``--max-draft-len``, the ``--policy`` and the
``--draft-method``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.speculation import SpeculationSettings


@dataclass(frozen=True)
class PairSource:
    """Where a pair comes from (see the module docstring); conflicting sources are one line."""

    target: str | Path | None = None
    draft: str | Path | None = None
    engine: str | Path | None = None
    tiny: bool = False
    allow_pickle: bool = False  # pickle weight files may be read (they can run code)
    verify: bool = True  # an engine's files are re-checked against its manifest's sha256 first

    def __post_init__(self) -> None:
        if self.engine is not None and (self.target or self.draft or self.tiny):
            raise DFlashError("--engine already holds the target and drafter; drop --target/--draft/--tiny")
        if self.tiny and (self.target or self.draft):
            raise DFlashError("--tiny uses a random pair; drop --target/--draft")
        if bool(self.target) != bool(self.draft):
            raise DFlashError("pass both --target and --draft, or neither (to use the embedded default pair)")


@dataclass
class LoadedPair:
    target: Any  # transformers PreTrainedModel
    draft: Any  # DFlashDraftModel
    tokenizer: Any | None  # None: a tiny random pair (generation folds bytes into the vocabulary)
    codec: TextCodec
    speculation: SpeculationSettings
    manifest: Any | None = None  # EngineManifest when the pair came from an engine directory


def load_pair(source: PairSource = PairSource(), options: RuntimeOptions = RuntimeOptions(), *,
              max_draft_len: int | None = None, policy: str | None = None,
              draft_method: str | None = None, draft_len_schedule: str | None = None) -> LoadedPair:
    """Load the pair `source` names for `options` (see the module docstring). `max_draft_len`
    lowers K (an engine's is refused above what it was built for, before anything loads);
    `policy` and `draft_method` name the SpeculationSettings' (None: its defaults);
    `draft_len_schedule` (``--draft-len-schedule``'s text) the schedule policy ``schedule``
    follows [an engine's: the one its build recorded]."""
    from dflash_trt.checkpoints.placement import runtime_device

    runtime_device(options.device, kinds=("cpu", "cuda", "meta"))  # before anything loads: a bad --device is one line
    manifest = None
    speculation = None
    if source.engine is not None:
        from dflash_trt.engine.manifest import load_manifest

        root = Path(source.engine)
        manifest = load_manifest(root)
        speculation = SpeculationSettings.from_manifest(manifest, max_draft_len, policy,  # refused before loading
                                                        draft_method, draft_len_schedule)
        if source.verify:  # every file's sha256: a tampered or half-copied engine names its bad file
            from dflash_trt.engine.verify import verify_engine

            verify_engine(root)
        target, draft, tokenizer = _load_models(root / manifest.target.path, root / manifest.draft.path, options,
                                                streamed=True)
    elif source.tiny:
        from dflash_trt.runtime.tiny import random_draft, tiny_target

        target = tiny_target("llama")
        draft = random_draft(target.config, num_layers=1, block_size=8).to(options.device)
        target, tokenizer = target.to(options.device), None
    else:
        target_dir, draft_dir = source.target, source.draft
        if target_dir is None:
            from dflash_trt.embedded import default_pair_dirs

            target_dir, draft_dir = default_pair_dirs()
        assert draft_dir is not None
        target, draft, tokenizer = _load_models(Path(target_dir), Path(draft_dir), options,
                                                allow_pickle=source.allow_pickle)
    if speculation is None:
        speculation = SpeculationSettings.for_block(draft.block_size, max_draft_len, policy, draft_method,
                                                    draft_len_schedule)
    limit = manifest.limits.max_seq_len if manifest is not None else None  # prompts are checked against it
    codec = TextCodec.for_model(tokenizer, target.config, limit)
    return LoadedPair(target, draft, tokenizer, codec, speculation, manifest)


def _load_models(target_dir: Path, draft_dir: Path, options: RuntimeOptions, *, streamed: bool = False,
                 allow_pickle: bool = False) -> tuple[Any, Any, Any | None]:
    """(target, drafter, tokenizer) of two directories: configs and their fit first (cheap), then
    the weights. `streamed`: the target is an engine's, read by the engine's own strict reader
    (checkpoints/streaming.py: any format `build` writes, every tensor accounted for)."""
    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.checkpoints.streaming import load_checkpoint, model_config
    from dflash_trt.runtime.cpu.packing import pack_cpu_linears
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.targets.loading import load_target, load_tokenizer
    from dflash_trt.runtime.drafters.validate import validate_pair

    draft_cfg = read_json(draft_dir / "config.json", what="drafter config")
    read_json(target_dir / "config.json", what="target config")
    validate_pair(draft_cfg, model_config(target_dir) if streamed else _target_config(target_dir), where=str(draft_dir))
    tokenizer = load_tokenizer(target_dir)  # an unreadable one fails before the weights load
    weights = options.weights_dtype()
    if streamed:
        target = load_checkpoint(target_dir, weights, options.device)
    else:
        target = load_target(target_dir, weights, options.device, allow_pickle)
    draft = load_drafter(draft_dir, dtype=weights, device=options.device, allow_pickle=allow_pickle)
    run = options.run_dtype()
    if run != weights:  # an exact upcast (compute_dtype)
        target, draft = target.to(run), draft.to(run)
    if options.pack:
        pack_cpu_linears(target)
        pack_cpu_linears(draft)
    return target, draft, tokenizer


def _target_config(directory: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise DFlashError(f"cannot read target config in {directory}: {str(e).splitlines()[0]}")
