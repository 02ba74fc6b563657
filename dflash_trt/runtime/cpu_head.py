"""A faster lm_head for float32 inference on CPU (the reference runtime; GPUs use TensorRT-LLM).

The vocabulary projection is the largest single matmul of a small target: SmolLM2-135M's
[49152 x 576] lm_head is ~15-20% of a plain decode step on a 2-core CPU. PyTorch's default CPU
GEMM re-packs the weight on every call; oneDNN with the weight packed ONCE in its blocked layout
(``to_mkldnn``) does the M=1 step and the M=16 verify pass ~1.9x faster here
(`scripts/bench_cpu_head.py` prints both, side by side). The packed copy costs one more head's
worth of memory (113 MB for SmolLM2). Plain decoding and DFlash verification share the same head,
so the comparison between them stays like for like, and greedy output is unchanged (tested).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PackedCPULinear(nn.Module):
    """Drop-in for a bias-free nn.Linear: same ``weight`` Parameter (tied embeddings stay tied,
    state_dict unchanged), plus a oneDNN-packed copy used when no gradient is needed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [V, H], shared, not copied
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = linear.weight.detach().to_mkldnn()  # plain attribute: never saved or moved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] -> [..., V]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight)  # training: autograd through the dense weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self._packed).to_dense()  # [N, V]
        return y.reshape(*x.shape[:-1], self.out_features)


def head_can_be_packed(model: nn.Module) -> str | None:
    """None when `model`'s lm_head can use :class:`PackedCPULinear`, else why not."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"lm_head is {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "lm_head has a bias"
    if head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return f"lm_head is {head.weight.dtype} on {head.weight.device.type} (packing is for float32 on CPU)"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    return None


def pack_cpu_lm_head(model: nn.Module) -> bool:
    """Swap `model`'s lm_head for a packed one where that applies; True when swapped (idempotent)."""
    if isinstance(model.get_output_embeddings(), PackedCPULinear):
        return True
    why = head_can_be_packed(model)
    if why is not None:
        log.debug("lm_head left as is: %s", why)
        return False
    model.set_output_embeddings(PackedCPULinear(model.get_output_embeddings()))
    return True
