"""The sequences a training run learns from, and the batches each step draws from them.

1. ``<data_dir>/responses.pt``: the target's greedy answers to the TRAIN prompts, generated once
   (:mod:`dflash_trt.train.answers`) and reused by later runs; ``--extra-data`` files add more
   (e.g. sampled answers). Answers shorter than 2 tokens teach nothing and are left out.
2. Features: ``cached`` (the frozen target's features at the drafter's layers for every position
   of every sequence, made once: captured while generating, else by one target pass) or
   ``online`` (the target runs on every step's batch; nothing is kept).
3. Batches: every step takes ``batch_sequences`` sequences in a seeded random order (epochs
   without repeats) and up to ``anchors_per_seq`` random anchors in each response, all from ONE
   generator, so a seed fixes the whole run. While a separate data job still appends to
   responses.pt, its new sequences join the current epoch (``data_reload_s``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.train import log
from dflash_trt.train.config import TrainConfig


def usable(seq: dict[str, Any]) -> bool:
    """An answer of at least 2 tokens: one anchor and one label."""
    return len(seq["ids"]) - seq["prompt_len"] >= 2


def training_sequences(cfg: TrainConfig, target: Any, tokenizer: Any, feature_layers: list[int] | None,
                       progress: bool = True) -> tuple[list[dict[str, Any]], int]:
    """(the greedy answers then the extra data's sequences, how many came from --extra-data).
    `feature_layers`: the layers whose features the answers keep (cached mode); None (online
    mode, every step makes its own) keeps none."""
    extra = [s for s in load_extra_data(cfg.extra_data) if usable(s)]
    seqs = [s for s in load_or_generate_answers(cfg, target, tokenizer, feature_layers, progress) if usable(s)] + extra
    if not seqs:
        raise DFlashError(f"no usable training sequences in {cfg.data_dir_path} (every response is shorter than "
                          f"2 tokens)")
    return seqs, len(extra)


def load_or_generate_answers(cfg: TrainConfig, target: Any, tokenizer: Any, layer_ids: list[int] | None,
                             progress: bool = True) -> list[dict[str, Any]]:
    """The greedy answers to the first `cfg.max_prompts` train prompts, from responses.pt when it
    exists (its features only if captured at `layer_ids`), else generated and saved there
    (capturing the features at `layer_ids`; none when None)."""
    from dflash_trt.train.answers import AnswerSettings, generate_answers, train_prompts
    from dflash_trt.train.data import answer_meta, load_data, save_data

    path = cfg.data_dir_path / "responses.pt"
    prompts = train_prompts(0, cfg.max_prompts)  # interleaved categories: any prefix covers all three
    if path.is_file():
        want = {p.id for p in prompts}
        stored, meta = load_data(path)
        seqs = [s for s in stored if s["id"] in want]
        if layer_ids is None or meta.get("capture_layer_ids") != layer_ids:
            for s in seqs:
                s.pop("feats", None)
        log(f"reusing {len(seqs)} generated responses from {path}")
        return seqs
    log(f"generating the target's greedy answers to {len(prompts)} train prompts (batch {cfg.gen_batch_size})")
    t0 = time.time()
    settings = AnswerSettings(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size,
                              capture_layer_ids=tuple(layer_ids) if layer_ids else None, progress=progress)
    seqs = generate_answers(target, tokenizer, prompts, settings)
    save_data(path, seqs, {**answer_meta(settings), "seconds": time.time() - t0})
    return seqs


def load_extra_data(paths: list[str]) -> list[dict[str, Any]]:
    """Sequences of `--extra-data` files (features dropped: made the same way as the main data's)."""
    from dflash_trt.train.data import load_data

    out: list[dict[str, Any]] = []
    for p in paths:
        if not Path(p).is_file():
            raise DFlashError(f"--extra-data {p}: no such file (an answer file from `dflash-trt train-data`)")
        stored, _ = load_data(Path(p))
        for s in stored:
            s.pop("feats", None)
        log(f"{len(stored)} extra sequences from {p}")
        out.extend(stored)
    return out


def cached_features(target: Any, seqs: list[dict[str, Any]], layer_ids: list[int], progress: bool = True) -> list[Any]:
    """Per-sequence target features [>= T-1, n*H], taken out of the rows: captured during
    generation, else computed now (one target pass per sequence)."""
    from dflash_trt.train.data import compute_features

    todo = [s for s in seqs if "feats" not in s]
    if todo:
        log(f"computing target features at layers {layer_ids} for {len(todo)} sequences")
        for s, f in zip(todo, compute_features(target, todo, layer_ids, progress=progress)):
            s["feats"] = f
    return [s.pop("feats") for s in seqs]


class TrainingSet:
    """The sequences of a run, their cached features (None each when online) and the epoch order."""

    def __init__(self, seqs: list[dict[str, Any]], feats: list[Any], online: bool, layer_ids: list[int],
                 data_file: Path, num_extra: int = 0) -> None:
        self.seqs, self.feats, self.online, self.layer_ids = seqs, feats, online, layer_ids
        self.at_start, self.num_extra = len(seqs), num_extra  # of which from --extra-data
        self.order: list[int] = []  # this epoch's remaining sequence indices
        self.known = {s["id"] for s in seqs}
        self.data_file = data_file  # responses.pt, which a separate data job may still extend
        self.data_mtime = data_file.stat().st_mtime if data_file.is_file() else 0.0

    def summary(self) -> dict[str, Any]:
        """What MANIFEST.json says about the data."""
        return {"sequences": len(self.seqs), "sequences_at_start": self.at_start, "extra_sequences": self.num_extra,
                "response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in self.seqs)}

    def seen_ids(self) -> Any:
        """Sorted ids occurring anywhere in the data [n] (the sampled softmax's fixed rows)."""
        import torch

        return torch.tensor(sorted({t for s in self.seqs for t in s["ids"]}), dtype=torch.long)

    def next_batch(self, batch_sequences: int, anchors_per_seq: int, gen: Any, device: Any) -> dict[str, Any]:
        """`batch_sequences` sequences in epoch order (a fresh permutation when one runs out)."""
        import torch

        picked = []
        for _ in range(batch_sequences):
            if not self.order:
                self.order = torch.randperm(len(self.seqs), generator=gen).tolist()
            picked.append(self.order.pop())
        return make_batch([self.seqs[i] for i in picked], None if self.online else [self.feats[i] for i in picked],
                          anchors_per_seq, gen, device)

    def pick_up_new_data(self) -> None:
        """Sequences a data job appended to the data file since the last look join this epoch."""
        from dflash_trt.train.data import load_data

        if not self.data_file.is_file() or self.data_file.stat().st_mtime == self.data_mtime:
            return
        self.data_mtime = self.data_file.stat().st_mtime
        stored, meta = load_data(self.data_file)
        if not self.online and meta.get("capture_layer_ids") != self.layer_ids:
            return
        new = [s for s in stored if s["id"] not in self.known and (self.online or "feats" in s) and usable(s)]
        for s in new:
            self.known.add(s["id"])
            self.order.append(len(self.seqs))  # seen in the current epoch already
            self.feats.append(s.pop("feats", None))
            self.seqs.append(s)
        if new:
            log(f"picked up {len(new)} new sequences ({len(self.seqs)} in all)")


def make_batch(seqs: list[dict[str, Any]], feats: list[Any] | None, anchors_per_seq: int, gen: Any,
               device: Any) -> dict[str, Any]:
    """Right-padded tensors for :func:`dflash_loss_batch` on `device`: ids [S, T], lens [S],
    anchors and anchor_ok [S, A] (a row with fewer anchors repeats its first, marked not ok),
    and, with cached `feats`, feats [S, C, n*H] (zeros past each row's own features)."""
    import torch

    from dflash_trt.train.objective import sample_anchors

    S, T = len(seqs), max(len(s["ids"]) for s in seqs)
    ids = torch.zeros((S, T), dtype=torch.long)
    picks = [sample_anchors(s["prompt_len"], len(s["ids"]), anchors_per_seq, gen) for s in seqs]
    A = max(p.numel() for p in picks)
    anchors = torch.zeros((S, A), dtype=torch.long)
    ok = torch.zeros((S, A), dtype=torch.bool)
    for r, (s, p) in enumerate(zip(seqs, picks)):
        ids[r, : len(s["ids"])] = torch.tensor(s["ids"])
        anchors[r] = p[0]
        anchors[r, : p.numel()] = p
        ok[r, : p.numel()] = True
    batch = {"ids": ids, "lens": torch.tensor([len(s["ids"]) for s in seqs]), "anchors": anchors, "anchor_ok": ok}
    if feats is not None:
        C = max(f.shape[0] for f in feats)
        padded = torch.zeros((S, C, feats[0].shape[1]), dtype=feats[0].dtype)
        for r, f in enumerate(feats):
            padded[r, : f.shape[0]] = f
        batch["feats"] = padded
    return {k: v.to(device) for k, v in batch.items()}


def training_set(seqs: list[dict[str, Any]], num_extra: int, target: Any, layer_ids: list[int], online: bool,
                 data_file: Path, progress: bool = True) -> TrainingSet:
    """`seqs` with their features: cached ones made now, or none kept when the steps make them."""
    if online:
        for s in seqs:
            s.pop("feats", None)  # stored features are not used (nor kept in memory)
    feats = [None] * len(seqs) if online else cached_features(target, seqs, layer_ids, progress)
    return TrainingSet(seqs, feats, online, layer_ids, data_file, num_extra)
