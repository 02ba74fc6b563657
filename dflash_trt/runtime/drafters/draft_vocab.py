"""A frequency-ranked draft vocabulary: the drafter proposes only among the N tokens the target
emits most often (FR-Spec, arXiv 2502.14856; EAGLE-3's ``d2t`` is the same idea).

DFlash's drafter borrows the target's lm_head, so every draft pass projects k hidden states onto
the FULL vocabulary only to take an argmax. For SmolLM2 that is [k, 576] x [576, 49152], the
largest matmul of the draft pass (~5-8 ms of a ~25 ms drafting overhead on the 2-core CPU); for
Qwen3 (151K) or gpt-oss (201K) it is a large share of the drafter's cost on GPU too. Restricting
the draft argmax to the target's frequent tokens cuts it by V/N. Output stays exactly the target's:
verification still uses the full vocabulary, so a token outside the subset only costs acceptance
(the draft slot is simply wrong) and never changes what is emitted.

The subset ships beside the drafter as ``draft_vocab.json`` (``token_ids``, most frequent first,
counted on the drafter's self-distilled training responses). JSON, not safetensors: vLLM and
SGLang load every ``*.safetensors`` of a model directory as weights. Loaders that do not know the
file ignore it and draft over the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.decoding.sampling import greedy

FILE = "draft_vocab.json"


def count_tokens(sequences: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the RESPONSE part of self-distilled sequences -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        ids = torch.as_tensor(s["ids"][s["prompt_len"]:], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def rank_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties by id), `always` included (e.g. stop tokens) -> int32 [N].
    Tokens never seen are not padded in: N = min(size, distinct tokens seen + len(always))."""
    if size < 1:
        raise DFlashError(f"draft vocabulary size must be >= 1, got {size}")
    order = torch.argsort(-counts, stable=True)  # most frequent first, ties by id
    seen = order[counts[order] > 0].tolist()
    keep = list(dict.fromkeys([*[int(t) for t in always], *seen]))[:size]
    return torch.tensor(keep, dtype=torch.int32)


def draft_vocab_from_data(sequences: list[dict], vocab_size: int, size: int,
                          always: Iterable[int] = ()) -> tuple[torch.Tensor, float]:
    """Rank the responses' tokens -> (token ids int32 [N], share of response tokens they cover)."""
    counts = count_tokens(sequences, vocab_size)
    total = int(counts.sum())
    if not total:  # an empty subset would make every draft wrong; `serve` refuses such a file
        raise DFlashError(f"the data holds no response tokens ({len(sequences)} sequences); pass the answer file "
                          "the drafter was trained on (train-draft's <out>.data/responses.pt)")
    ids = rank_vocab(counts, size, always)
    return ids, (float(counts[ids.long()].sum()) / total if total else 0.0)


def save_draft_vocab(draft_dir: str | Path, token_ids: torch.Tensor, coverage: float | None = None) -> Path:
    """Write the subset beside the drafter (atomically); `coverage`: the share of training response
    tokens it covers, recorded for the reader."""
    import json

    from dflash_trt.fsutil import write_text_atomic

    path = Path(draft_dir) / FILE
    doc = {"size": int(token_ids.numel()), "coverage": None if coverage is None else round(coverage, 5),
           "token_ids": [int(t) for t in token_ids]}
    write_text_atomic(path, json.dumps(doc) + "\n")  # one line: thousands of ids
    path.chmod(0o644)  # ships with the drafter
    return path


def load_draft_vocab(draft_dir: str | Path, vocab_size: int | None) -> torch.Tensor | None:
    """The drafter's draft vocabulary (int64 [N]), or None when it ships none. `vocab_size`: the
    upper bound for its ids (None: checked later, against the target, by the runtime)."""
    path = Path(draft_dir) / FILE
    if not path.is_file():
        return None
    from dflash_trt.checkpoints.files import read_json

    ids = read_json(path, what="draft vocabulary").get("token_ids")
    bound = vocab_size if vocab_size is not None else float("inf")
    bad = (not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids)
           or min(ids) < 0 or max(ids) >= bound or len(set(ids)) != len(ids))
    if bad:
        where = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
        raise DFlashError(f"{path}: token_ids must be a non-empty list of distinct ids in {where}; "
                          f"regenerate it for this target or delete it to draft over the full vocabulary")
    return torch.tensor(ids, dtype=torch.long)


class DraftVocabHead(nn.Module):
    """argmax over the draft vocabulary only: hidden [..., H] -> token ids [...] (target ids)."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor) -> None:
        super().__init__()
        from dflash_trt.runtime.cpu.packing import pack_cpu_linears

        ids = token_ids.to(device=lm_head_weight.device, dtype=torch.long)
        self.proj = nn.Linear(lm_head_weight.shape[1], ids.numel(), bias=False,
                              device=lm_head_weight.device, dtype=lm_head_weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(lm_head_weight.detach()[ids])  # [N, H]: a copy, N/V of the head
        self.proj.weight.requires_grad_(False)
        self.register_buffer("token_ids", ids, persistent=False)
        pack_cpu_linears(self)  # float32 on CPU: the same packed path as the target's layers

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.token_ids[greedy(self.proj(hidden))]
