"""One optimiser step of drafter training, and what it needs: the frozen head, the optimiser and
its learning-rate schedule.

A step: (online only) the target's features of the batch -> the lr of this step -> (sampled
softmax only) the head rows of this step -> the DFlash loss (objective.py) -> backward ->
gradient clipping at 1.0 -> AdamW. The generator that drew the batch also draws the head rows,
so one seed fixes every step.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_trt.train.config import TrainConfig


class FrozenHead:
    """The target's lm_head as the loss scores it: weight [V, H] in the device's fast dtype, all
    rows, or (sampled softmax) every id seen in the data plus `sampled_vocab` random others,
    redrawn every step.

    The frozen 49152-row head dominates a step's cost (its matmul runs forward, and backward into
    the hidden states). bf16 makes it ~2.5x faster on AVX512-BF16 CPUs and GPUs; on a CPU without
    native bf16 it would be several times slower than float32, which it keeps there
    (runtime_options.auto_dtype). The loss itself is computed in float32 from those logits. An
    instruct model's answers use few distinct ids (SmolLM2: ~3.7k of 49k), so the sampled head is
    ~2x faster again; the random others keep every row pushed down.
    """

    def __init__(self, target: Any, sampled_vocab: int | None, device: Any) -> None:
        from dflash_trt.runtime_options import auto_dtype

        self.dtype = auto_dtype(device)
        self.weight = target.get_output_embeddings().weight.detach().to(self.dtype)  # [V, H]
        self.vocab = int(target.config.vocab_size)
        self.sampled_vocab, self.device = sampled_vocab, device
        self.rows = self.weight  # the rows scored this step
        self.label_map: Any = None  # [V] full id -> row of `rows` (-1: not scored), sampled only

    def __call__(self, h: Any) -> Any:  # [N, H] -> [N, V or the sampled rows]
        import torch

        return torch.nn.functional.linear(h.to(self.dtype), self.rows)

    def draw(self, seen: Any, gen: Any) -> None:
        """This step's rows: every id in `seen` [n] plus `sampled_vocab` random others."""
        import torch

        if self.sampled_vocab is None:
            return
        others = torch.ones(self.vocab, dtype=torch.bool)
        others[seen] = False
        pool = others.nonzero()[:, 0]
        extra = pool[torch.randperm(pool.numel(), generator=gen)[: self.sampled_vocab]]
        rows = torch.cat([seen, extra])
        label_map = torch.full((self.vocab,), -1, dtype=torch.long)
        label_map[rows] = torch.arange(rows.numel())
        self.rows, self.label_map = self.weight[rows.to(self.device)], label_map.to(self.device)


def make_optimizer(cfg: TrainConfig, draft: Any) -> Any:
    import torch

    return torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to 10% of `lr` at the last step; a
    time-limited run decays on the clock too, so it also ends at a low lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    if cfg.time_limit_s:
        frac = max(frac, elapsed_s / cfg.time_limit_s)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def online_features(adapter: Any, ids: Any, layer_ids: list[int]) -> Any:
    """The frozen target's features [S, T, n*H] of a right-padded batch (causal: padding after a
    row never changes that row's positions)."""
    import torch

    with torch.no_grad():
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        _, f = adapter.forward(ids, pos, adapter.new_cache(), layer_ids, logits_to_keep=1)
    return f


def train_step(draft: Any, embed: Any, head: FrozenHead, opt: Any, batch: dict[str, Any], lr: float,
               gamma: float) -> tuple[float, dict[str, float]]:
    """One optimiser step on `batch` (make_batch's tensors, feats included) at `lr`; returns the
    loss and the objective's per-step statistics (acc1, tau_est)."""
    import torch

    from dflash_trt.train.objective import dflash_loss_batch

    for g in opt.param_groups:
        g["lr"] = lr
    loss, stats = dflash_loss_batch(draft, embed, head, batch["ids"], batch["lens"], batch["feats"],
                                    batch["anchors"], batch["anchor_ok"], gamma, head.label_map)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    return loss.item(), stats
