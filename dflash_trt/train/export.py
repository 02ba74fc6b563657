"""A trained drafter on disk: z-lab's released format (config.json + model.safetensors; a DFlash2
drafter with every recipe key inside ``dflash_config`` and its codebooks stored bare, as z-lab
0.1.0, vLLM, SGLang and TensorRT-LLM read them: runtime/drafters/dflash2.py), the frequent-token draft
vocabulary (draft_vocab.json, DFlash only) and MANIFEST.json (what was trained, on what, how, how
long), written as one directory atomically: an interrupted save leaves nothing half-written.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

from dflash_trt.config import config_record
from dflash_trt.train import log
from dflash_trt.train.config import TrainConfig
from dflash_trt.train.drafter import MASK_TOKEN_NOTE

DFLASH2_INIT_NOTE = (
    "Started as the DFlash drafter it contains (--init-from's weights where given): every convolution the "
    "identity (base[:, 0] = 1, other taps and kernel_projection 0, speculators' init) and the selector's "
    "hidden_projection 0, so every transition score is 0 and the walk starts as the plain argmax; the codebooks "
    "random (normal, initializer_range), so the projection has a gradient from the first step."
)


def training_manifest(cfg: TrainConfig, target_config: Any, tokenizer: Any, mask_id: int, layer_ids: list[int],
                      data: dict[str, Any], run: dict[str, Any], machine: dict[str, Any],
                      recipe: dict[str, int] | None = None) -> dict[str, Any]:
    """MANIFEST.json: `data` (sequence counts), `run` (steps, history, times) and `machine` as
    the trainer measured them, around the target, the family (`recipe`: a DFlash2 drafter's),
    the mask token, the layers and the config."""
    tcfg = target_config
    family = {"family": "dflash"} if recipe is None else {
        "family": "dflash2", "dflash2": {**recipe, "selector_loss_weight": cfg.selector_loss_weight,
                                         "init": DFLASH2_INIT_NOTE}}
    return {
        "what": f"{'DFlash2' if recipe else 'DFlash'} drafter (z-lab format) trained by dflash-trt train-draft",
        **family,
        "target": {"path": str(cfg.target), "architectures": list(getattr(tcfg, "architectures", None) or []),
                   "num_hidden_layers": int(tcfg.num_hidden_layers), "hidden_size": int(tcfg.hidden_size),
                   "vocab_size": int(tcfg.vocab_size)},
        "mask_token": {"id": mask_id,
                       "token": tokenizer.convert_ids_to_tokens(mask_id) if tokenizer is not None else None,
                       "why": MASK_TOKEN_NOTE if tokenizer is not None else "last vocabulary id (no tokenizer)"},
        "block_size": cfg.block_size,
        "target_layer_ids": layer_ids,
        "command": _command_line(),
        "config": config_record(cfg),
        "data": {**data, "prompts": "dflash_trt/prompts/*.jsonl split=train",
                 "responses": f"target greedy, chat template, max_new_tokens={cfg.max_new_tokens}",
                 "extra_data": list(cfg.extra_data)},
        "steps": run["steps"],
        "final_loss": run["history"][-1]["loss"] if run["history"] else None,
        "history": run["history"],
        "num_parameters": run["num_parameters"],
        "save_dtype": cfg.save_dtype,
        "train_time_s": run["train_time_s"],
        "total_time_s": run["total_time_s"],
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), **machine},
        "seed": cfg.seed,
    }


def _command_line() -> str:
    argv = sys.argv
    if argv and argv[0].endswith(("dflash-trt", "dflash_trt/cli.py")):
        return "dflash-trt " + " ".join(argv[1:])
    return " ".join(argv)


def save_drafter(out: Path, draft: Any, manifest: dict[str, Any], save_dtype: Any,
                 draft_vocab: tuple[Any, float] | None) -> None:
    """Write `out` atomically (replacing it): the drafter, draft_vocab.json when `draft_vocab`
    (token ids, coverage) is given (recorded in the manifest), then MANIFEST.json."""
    from dflash_trt.fsutil import atomic_directory, write_json_atomic
    from dflash_trt.runtime.drafters.draft_vocab import save_draft_vocab

    with atomic_directory(out, overwrite=True) as tmp:
        draft.save_pretrained(tmp, dtype=save_dtype)
        if draft_vocab is not None:
            ids, coverage = draft_vocab
            save_draft_vocab(tmp, ids, coverage)
            manifest["draft_vocab"] = {"size": int(ids.numel()), "coverage": round(coverage, 5),
                                       "from": "response tokens of the training data, most frequent first"}
        write_json_atomic(tmp / "MANIFEST.json", manifest)
        tmp.chmod(0o755)  # mkdtemp makes it private; this is a shareable artifact
        for f in tmp.iterdir():
            f.chmod(0o644)
    log(f"wrote {out} ({draft.num_parameters() / 1e6:.2f}M params, final loss {manifest['final_loss']})")

