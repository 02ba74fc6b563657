"""Packed linear layers for float32 inference on CPU (the reference runtime; GPUs use TensorRT-LLM).

PyTorch's default CPU GEMM (MKL) re-packs the weight on every call, and for a few rows (M = 2..64:
what a DFlash verify or draft pass, or a batch of plain decoders, feeds each layer) it is far off
the cost of reading the weight once. Each weight is therefore reordered ONCE, at load, for one of
two kernels:

- panels (runtime/cpu/panel_gemm.py, built from source on first use): fastest at every decoding M
  measured here and batch-invariant (a row's outputs do not depend on the other rows, bit for bit);
- oneDNN, where the panel kernel cannot be built: the weight in oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the layout Inductor's CPU freezing gives a linear)
  for M >= 2, and MKL's GEMV on the dense weight for a single row, the faster kernel there.

``scripts/bench_cpu_packing.py`` prints every kernel side by side, alone and inside decoding.

The packed copy is memory: one more copy of every packed weight (~0.5 GB for SmolLM2-135M in
float32). Plain decoding and DFlash share the same packed layers, so the comparison between them
stays like for like, and greedy output is unchanged (tests/test_cpu_packing.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.runtime.cpu import panel_gemm

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


KERNELS = ("panels", "onednn")


def packed_kernel() -> str:
    """The kernel new packed layers use: "panels" where the panel GEMM loads, else "onednn"."""
    return "panels" if panel_gemm.unavailable() is None else "onednn"


class PackedCPULinear(nn.Module):
    """Drop-in for an nn.Linear: the same ``weight``/``bias`` Parameters (tied embeddings stay tied,
    state_dict unchanged), plus a packed copy of the weight for ``kernel`` (:func:`packed_kernel`),
    used when no gradient is needed and ``use_packed`` is set (:func:`set_packed` flips it for a
    whole model)."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in], shared, not copied
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.use_packed = True
        self.repack(kernel or packed_kernel())

    def repack(self, kernel: str, variant: str | None = None) -> None:
        """Pack the weight for `kernel` ("panels" or "onednn"), replacing the previous packed copy;
        `variant`: the panel kernel's ISA build (default: the best this CPU runs, see panel_gemm)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown packed-linear kernel {kernel!r}; use one of {', '.join(KERNELS)}")
        self._packed = None  # the old copy goes before the new one is made: one extra copy at most
        self.variant = (variant or panel_gemm.default_variant()) if kernel == "panels" else None
        # plain attribute: never saved or moved (pack loads the variant, or says why it cannot)
        self._packed = panel_gemm.pack(self.weight, self.variant) if kernel == "panels" else pack_weight(self.weight)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        if not self.use_packed or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)  # training: autograd through the dense weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [N, in]
        if self.kernel == "panels":
            y = panel_gemm.linear(flat, self._packed, self.out_features, self.bias, self.variant)  # [N, out]
            return y.reshape(*x.shape[:-1], self.out_features)
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}" + (f", variant={self.variant}" if self.variant else ""))


def packing_unsupported(model: nn.Module) -> str | None:
    """None when `model`'s linear layers can be packed, else why not."""
    p = next(model.parameters(), None)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return f"weights are {p.dtype} on {p.device.type} (packing is for float32 on CPU)"
    if not torch.backends.mkldnn.is_available() and panel_gemm.unavailable() is not None:
        return f"this PyTorch build has no oneDNN (mkldnn) and the panel kernel is unavailable ({panel_gemm.unavailable()})"
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


def repack(model: nn.Module, kernel: str, variant: str | None = None) -> None:
    """Re-pack every packed layer of `model` for `kernel` (side-by-side kernel measurements; the
    panel kernel's other ISA builds, see panel_gemm.variants)."""
    for m in model.modules():
        if isinstance(m, PackedCPULinear):
            m.repack(kernel, variant)


def packed_bytes(model: nn.Module) -> int:
    """Memory the packed copies take (the dense weights are kept too)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, PackedCPULinear))
