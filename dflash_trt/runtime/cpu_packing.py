"""oneDNN-packed linear layers for float32 inference on CPU (the reference runtime; GPUs use
TensorRT-LLM).

PyTorch's default CPU GEMM re-packs the weight on every call, and for a few rows (M = 2..64, what
a DFlash verify or draft pass, or a batch of plain decoders, feeds each layer) it is far off the
memory-bound cost of reading the weight once. Each weight is therefore reordered ONCE into
oneDNN's blocked layout for multi-row products (``torch.ops.mkldnn._reorder_linear_weight``, the
layout Inductor's CPU freezing pass gives a linear). Measured on the 2-core CPU over SmolLM2-135M's
210 decoder linears, weights streamed from memory, one thread (``scripts/bench_cpu_packing.py``):

    rows M           1      4      16     64
    stock (MKL)     32.2   50.7   69.7  104.9  ms
    oneDNN plain    38.8   52.2   67.6  108.1  ms   (``to_mkldnn()``, what this module used before)
    oneDNN blocked  38.9   38.0   55.3  102.4  ms

A single row (a plain decoding step at batch 1) goes to the stock path instead: MKL's GEMV reads
the dense weight faster than oneDNN's blocked kernel does. The blocked products equal the plain
oneDNN ones bit for bit (same kernel order over K), so the layout changes speed, not results.

The packed copy is memory: one more copy of every packed weight (~0.5 GB for SmolLM2-135M in
float32). Plain decoding and DFlash share the same packed layers, so the comparison between them
stays like for like, and greedy output is unchanged (tests/test_cpu_packing.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# The op Inductor's CPU backend calls for a prepacked linear: it takes a dense activation, which
# saves two layout conversions per call (~30 us each here, ~7 ms per SmolLM2 step). Older builds
# lack it: mkldnn_linear on converted tensors computes the same.
_LINEAR_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
# Reorders a weight into oneDNN's blocked layout for a batch-size hint; the layout serves any M.
_REORDER = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
# The hint: within ~2% of the best layout at every M from 2 to 64 on the embedded target's shapes.
BLOCKED_BATCH_HINT = 64


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN tensor of `weight` [out, in] in the blocked layout for multi-row products (the plain
    oneDNN layout where this build cannot reorder, or has no pointwise op to read a blocked one)."""
    w = weight.detach()
    if _REORDER is not None and _LINEAR_POINTWISE is not None:
        return _REORDER(w, batch_size=BLOCKED_BATCH_HINT)
    return w.to_mkldnn()


class PackedCPULinear(nn.Module):
    """Drop-in for an nn.Linear: the same ``weight``/``bias`` Parameters (tied embeddings stay tied,
    state_dict unchanged), plus a oneDNN-packed copy of the weight used when no gradient is needed
    and ``use_packed`` is set (:func:`set_packed` flips it for a whole model)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in], shared, not copied
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = pack_weight(linear.weight)  # plain attribute: never saved or moved
        self.use_packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        if not self.use_packed or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)  # training: autograd through the dense weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [N, in]
        if flat.shape[0] == 1:  # one row: MKL's GEMV on the dense weight is the faster kernel
            return F.linear(x, self.weight, self.bias)
        if _LINEAR_POINTWISE is not None:  # dense in, dense out: no per-call layout conversions
            y = _LINEAR_POINTWISE(flat, self._packed, self.bias, "none", [], "")  # [N, out]
        else:
            y = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self._packed).to_dense()
            if self.bias is not None:
                y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_unsupported(model: nn.Module) -> str | None:
    """None when `model`'s linear layers can be packed, else why not."""
    p = next(model.parameters(), None)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return f"weights are {p.dtype} on {p.device.type} (packing is for float32 on CPU)"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    return None


def pack_cpu_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear inside `model` (its lm_head included) for a
    :class:`PackedCPULinear` where packing applies. Idempotent; returns how many layers are packed."""
    why = packing_unsupported(model)
    if why is not None:
        log.debug("linear layers left as they are: %s", why)
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedCPULinear(child))
    return num_packed(model)


def num_packed(model: nn.Module) -> int:
    return sum(isinstance(m, PackedCPULinear) for m in model.modules())


def set_packed(model: nn.Module, on: bool) -> None:
    """Use the packed weights (on) or the stock dense path (off) in every packed layer of `model`:
    the benchmark compares both on one model without packing twice."""
    for m in model.modules():
        if isinstance(m, PackedCPULinear):
            m.use_packed = on


def packed_bytes(model: nn.Module) -> int:
    """Memory the packed copies take (the dense weights are kept too)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, PackedCPULinear))
