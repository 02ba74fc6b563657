"""`dflash-trt train-draft`: the target's own answers -> its features -> a DFlash drafter.

:func:`train_draft` runs the stages, each owned by a module of this package:

1. data (dataset.py): the target's greedy answers to the project's TRAIN prompts, generated once
   into ``<data_dir>/responses.pt`` (answers.py) and reused, plus ``--extra-data``; their
   features cached (the target runs ONCE per sequence) or made in every step (online);
2. model (drafter.py): the family (DFlash or DFlash2, ``--family``, else ``--init-from``'s), the
   drafter's config checked against the target before any long work, the mask token, seeded
   weights or ``--init-from`` (a DFlash2 drafter from a DFlash one starts where that one is);
3. steps (step.py, below): the optimiser and its schedule, one step per batch of sequences with
   up to ``anchors_per_seq`` random anchors each (objective.py), the running figures kept as
   the history;
4. export (export.py): the drafter in z-lab's released format (bf16 by default; DFlash2: every
   recipe key in ``dflash_config``, the codebooks stored bare), draft_vocab.json (DFlash only)
   and MANIFEST.json, atomically.

The target is frozen; its embedding and lm_head are shared with the drafter (which has none).
One seed fixes the run: the same config on the same machine writes the same weights.

Why not ModelOpt's DFlash trainer (``modelopt.torch.speculative``, mode "dflash")? It runs on
this CPU and exports the same z-lab format (checked: its export loads in our runtime), but its
online mode runs the full target in every training step, its offline mode expects its own
dumped-hidden-state format and sequence padding to a multiple of the block size, and it trains
its own draft class rather than the :class:`DFlashDraftModel` our runtime decodes with. On a
shared 2-core CPU the precomputed-feature loop below, on the very class used at inference, is
the cheaper and more direct choice.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.train import log
from dflash_trt.train.config import TrainConfig
from dflash_trt.train.dataset import TrainingSet


def train_draft(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Run the whole pipeline (see the module docstring); returns the manifest written beside the drafter."""
    import torch

    from dflash_trt.runtime_options import torch_dtype
    from dflash_trt.train.dataset import training_sequences, training_set
    from dflash_trt.train.drafter import drafter_config, feature_layer_ids, mask_token_for, new_drafter

    t_start = time.time()
    if cfg.target is None:
        raise DFlashError("train-draft: no target; pass --target (the CLI defaults it to the embedded target)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    save_dtype = torch_dtype(cfg.save_dtype)
    device = training_device(cfg.device)
    online = (cfg.features or ("cached" if device.type == "cpu" else "online")) == "online"
    target, tokenizer = load_frozen_target(cfg.target, device)
    layer_ids = feature_layer_ids(cfg, target.config)
    drafter_config(cfg, target.config, layer_ids)  # a bad layer id fails here, before the long data generation

    # online: the steps make the features, so the answers are generated without capturing any
    seqs, n_extra = training_sequences(cfg, target, tokenizer, None if online else layer_ids, progress)
    seen = {t for s in seqs for t in s["ids"][s["prompt_len"]:]}
    mask_id = mask_token_for(cfg, tokenizer, int(target.config.vocab_size), seen)
    draft = new_drafter(cfg, drafter_config(cfg, target.config, layer_ids, mask_id), device)
    data = training_set(seqs, n_extra, target, layer_ids, online, cfg.data_dir_path / "responses.pt", progress)

    run = run_steps(cfg, draft, target, data, device, progress)
    draft.to("cpu").eval()
    run.update(num_parameters=draft.num_parameters(), total_time_s=round(time.time() - t_start, 1))
    return export(cfg, draft, target, tokenizer, mask_id, layer_ids, data, run, save_dtype, device)


def training_device(name: str) -> Any:
    """`--device` as a torch device; DFlashError for a malformed name or a missing GPU."""
    from dflash_trt.checkpoints.placement import runtime_device

    return runtime_device(name)


def load_frozen_target(target_dir: str, device: Any) -> tuple[Any, Any]:
    """(the target on `device` with no gradients, its tokenizer or None)."""
    import torch

    from dflash_trt.runtime.targets.loading import load_target, load_tokenizer

    if device.type == "cuda":  # tf32 matmuls: the features and the drafter tolerate them (bf16 is stored)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(target_dir, device=str(device))
    for p in target.parameters():
        p.requires_grad_(False)
    return target, load_tokenizer(target_dir)


class TrainingLog:
    """The run's figures: means of loss, acc1, tau_est (and DFlash2's selector_loss) over every
    `log_every` steps (steps whose figure is NaN, e.g. no slot-1 label, left out), the history
    MANIFEST.json records."""

    DIGITS = {"loss": 4, "acc1": 4, "tau_est": 3, "selector_loss": 4}

    def __init__(self, log_every: int, steps: int) -> None:
        self.log_every, self.steps = log_every, steps
        self.window: list[dict[str, float]] = []
        self.history: list[dict[str, float]] = []

    def add(self, step: int, loss: float, stats: dict[str, float], elapsed_s: float) -> dict[str, float] | None:
        """Record a step; returns the history row when this step closes a window."""
        self.window.append({"loss": loss, **stats})
        if (step + 1) % self.log_every and step != self.steps - 1:
            return None
        row = {"step": step + 1, **self._means(self.DIGITS), "elapsed_s": round(elapsed_s, 1)}
        self.history.append(row)
        self.window = []
        return row

    def _means(self, names: dict[str, int]) -> dict[str, float]:
        out = {}
        for name, digits in names.items():
            xs = [x[name] for x in self.window if name in x and not math.isnan(x[name])]
            if name in self.window[0]:
                out[name] = round(sum(xs) / max(1, len(xs)), digits)
        return out

    def close(self, done: int, elapsed_s: float) -> None:
        """A run stopped by its time limit mid-window keeps that window's mean loss."""
        if self.window:
            self.history.append({"step": done, **self._means({"loss": 4}), "elapsed_s": round(elapsed_s, 1)})


def run_steps(cfg: TrainConfig, draft: Any, target: Any, data: TrainingSet, device: Any,
              progress: bool = True) -> dict[str, Any]:
    """The optimiser steps (stopping early at `time_limit_s`); returns steps, history and time."""
    import torch
    from tqdm import tqdm

    from dflash_trt.runtime.targets.adapter import TargetAdapter
    from dflash_trt.train.objective import default_gamma
    from dflash_trt.train.step import FrozenHead, lr_at, make_optimizer, online_features, train_step

    adapter, embed = TargetAdapter(target), target.get_input_embeddings()
    head, opt = FrozenHead(target, cfg.sampled_vocab, device), make_optimizer(cfg, draft)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    gen = torch.Generator().manual_seed(cfg.seed)  # every random draw of the run: order, anchors, head rows
    # ids in the data at the start (sequences picked up later may add a few: those labels are left
    # out of the sampled loss until they are drawn as "others")
    seen_ids = data.seen_ids()
    figures = TrainingLog(cfg.log_every, cfg.steps)
    t_train = last_check = time.time()
    done = 0
    with tqdm(total=cfg.steps, desc="training drafter", unit="step", file=sys.stderr, disable=not progress) as bar:
        for step in range(cfg.steps):
            if cfg.time_limit_s and time.time() - t_train > cfg.time_limit_s:
                log(f"time limit {cfg.time_limit_s:.0f} s reached after {done} steps")
                break
            if cfg.data_reload_s and time.time() - last_check > cfg.data_reload_s:
                last_check = time.time()
                data.pick_up_new_data()
            batch = data.next_batch(cfg.batch_sequences, cfg.anchors_per_seq, gen, device)
            if data.online:
                batch["feats"] = online_features(adapter, batch["ids"], data.layer_ids)
            lr = lr_at(cfg, step, time.time() - t_train)
            head.draw(seen_ids, gen)
            loss, stats = train_step(draft, embed, head, opt, batch, lr, gamma, cfg.selector_loss_weight)
            done += 1
            bar.update(1)
            row = figures.add(step, loss, stats, time.time() - t_train)
            if row is not None:
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc1']:.2f}", tau_est=f"{row['tau_est']:.2f}")
    figures.close(done, time.time() - t_train)
    return {"steps": done, "history": figures.history, "train_time_s": round(time.time() - t_train, 1)}


def export(cfg: TrainConfig, draft: Any, target: Any, tokenizer: Any, mask_id: int, layer_ids: list[int],
           data: TrainingSet, run: dict[str, Any], save_dtype: Any, device: Any) -> dict[str, Any]:
    """MANIFEST.json's content, then the drafter directory (with its draft vocabulary) on disk."""
    import torch

    from dflash_trt.runtime.drafters.draft_vocab import draft_vocab_from_data
    from dflash_trt.runtime.decoding.tokens import stop_token_ids_of
    from dflash_trt.train.export import save_drafter, training_manifest

    machine = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device),
               "features": "online" if data.online else "cached",
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    recipe = draft.recipe.to_dict() if draft.family == "dflash2" else None
    manifest = training_manifest(cfg, target.config, tokenizer, mask_id, layer_ids, data.summary(), run, machine,
                                 recipe)
    vocab = None
    if cfg.draft_vocab_size and draft.family == "dflash2":
        # loaders refuse one beside a DFlash2 drafter: its selector ranks the whole vocabulary
        log("no draft_vocab.json for a DFlash2 drafter (its candidate selector ranks the whole vocabulary)")
    elif cfg.draft_vocab_size:
        vocab = draft_vocab_from_data(data.seqs, int(target.config.vocab_size), cfg.draft_vocab_size,
                                      always=stop_token_ids_of(tokenizer, target.config))
    save_drafter(Path(cfg.out), draft, manifest, save_dtype, vocab)
    return manifest
