"""Answer files: the sequences a drafter trains on, on disk, and the target's features of them.

An answer file is a ``torch.save``'d dict ``{"sequences": [row, ...], "meta": {...}}`` whose rows
are :func:`dflash_trt.train.answers.answer_row` rows (``ids`` = chat-templated prompt + the
target's answer) and whose meta records the :class:`AnswerSettings` they were made with.
:func:`extend_answer_file` is the resumable job behind ``dflash-trt train-data`` (and, with sampling
defaults, ``python -m dflash_trt.train.sampled``). A library module: the commands import it, never the
other way round (tests/test_import_graph.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.train.answers import AnswerSettings

CHECKPOINT_EVERY_S = 60.0  # pickling the whole list takes seconds: partial saves at most once a minute


def answer_meta(settings: AnswerSettings) -> dict[str, Any]:
    """What an answer file records about how its answers were made (and must match to extend it)."""
    return {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.batch_size,
            "capture_layer_ids": list(settings.capture_layer_ids) if settings.capture_layer_ids else None,
            "sampled": settings.sampled, "samples": settings.samples, "temperature": settings.temperature,
            "seed": settings.seed}


# What must match to extend a file, and the value a file written before the key was recorded
# holds (those files hold greedy answers).
MATCHING = {"max_new_tokens": None, "capture_layer_ids": None, "samples": 1, "temperature": 0.0}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k}={old.get(k, default)} there, {new[k]} here" for k, default in MATCHING.items()
            if old.get(k, default) != new[k]]


@torch.inference_mode()
def compute_features(target: Any, sequences: list[dict[str, Any]], layer_ids: list[int],
                     batch_size: int = 8, dtype: torch.dtype = torch.bfloat16, progress: bool = True,
                     ) -> list[torch.Tensor]:
    """Context features [T, n*H] of every sequence, on the host (the frozen target runs once per
    sequence, on its own device).

    Right padding: with a causal target, pad tokens AFTER a sequence never change its positions'
    hidden states, so no attention mask is needed. Stored in bfloat16 to halve memory: SmolLM2 has
    activation outliers near 2.5e4 at early layers, too close to float16's 6.5e4 limit.
    """
    from tqdm import tqdm

    from dflash_trt.checkpoints.placement import home_device
    from dflash_trt.runtime.targets.adapter import TargetAdapter

    adapter = TargetAdapter(target)
    dev = home_device(adapter.model)  # the ids go where the target's embedding is
    feats: list[torch.Tensor] = []
    for i in tqdm(range(0, len(sequences), batch_size), desc="target features", unit="batch", disable=not progress):
        chunk = sequences[i : i + batch_size]
        width = max(len(s["ids"]) for s in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, : len(s["ids"])] = torch.tensor(s["ids"])
        ids = ids.to(dev)
        pos = torch.arange(width, device=dev)[None].expand(len(chunk), -1)
        _, f = adapter.forward(ids, pos, adapter.new_cache(), layer_ids, logits_to_keep=1)  # [b, width, n*H]
        if dtype == torch.float16 and f.abs().max() > 6e4:
            raise DFlashError("target features exceed the float16 range; store them as float32 (--feature-dtype float32)")
        # kept on the host: every sequence's features together outgrow a GPU (batches move them back)
        feats.extend(f[r, : len(s["ids"])].to(device="cpu", dtype=dtype, copy=True) for r, s in enumerate(chunk))
    return feats


def extend_answer_file(target_dir: str | Path, out_file: str | Path, settings: AnswerSettings,
                       max_prompts: int | None = None, dtype: str = "float32", device: str = "cpu") -> tuple[int, int]:
    """Answer every train prompt (of the first `max_prompts`) that `out_file` does not answer yet,
    with the settings its answers were made with, and save the file (partially at most once a
    minute), so an interrupted job is extended, not redone. Returns (rows kept, rows added)."""
    from dflash_trt.checkpoints.placement import runtime_device
    from dflash_trt.runtime.targets.loading import load_target, load_tokenizer
    from dflash_trt.runtime_options import torch_dtype
    from dflash_trt.train.answers import generate_answers, train_prompts

    runtime_device(device)  # a GPU job started where there is none: one line, before anything loads
    out_file = Path(out_file)
    t0 = time.time()
    meta = answer_meta(settings)
    have: list[dict[str, Any]] = []
    if out_file.is_file():
        have, old = load_data(out_file)
        differences = _differences(old, meta)
        if differences:
            raise DFlashError(f"{out_file} holds answers made with other settings ({', '.join(differences)}); "
                              f"pass the same settings to extend it, or write another file")
    done = {s["id"].split("#")[0] for s in have}
    todo = [p for p in train_prompts(settings.seed, max_prompts) if p.id not in done]
    if device.startswith("cuda"):  # tf32 matmuls: the answers are sampled or argmax'ed from them anyway
        torch.backends.cuda.matmul.allow_tf32 = True
    model = load_target(target_dir, torch_dtype(dtype, device), device=device)
    tokenizer = load_tokenizer(target_dir)
    print(f"{len(have)} sequences kept from {out_file}, {len(todo)} prompts to answer", flush=True)
    last_save = time.time()

    def checkpoint(rows: list[dict[str, Any]]) -> None:
        nonlocal last_save
        if time.time() - last_save > CHECKPOINT_EVERY_S:
            save_data(out_file, have + rows, {**meta, "dtype": dtype, "seconds": time.time() - t0})
            last_save = time.time()

    rows = generate_answers(model, tokenizer, todo, settings, on_batch=checkpoint)
    save_data(out_file, have + rows, {**meta, "dtype": dtype, "seconds": time.time() - t0})
    return len(have), len(rows)


def load_data(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(sequences, meta) as written by :func:`save_data`; read without running code (datafile.py)."""
    from dflash_trt.train.datafile import read_answer_file

    return read_answer_file(path)


def save_data(path: Path, sequences: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from dflash_trt.train.datafile import write_answer_file

    write_answer_file(path, sequences, meta)
