"""Device bugs made visible without a GPU: the `meta` device, a strict-device dispatch mode and a
host-read recorder.

A CUDA kernel refuses tensors of two devices ("Expected all tensors to be on the same device",
"indices should be either on cpu or on the same device as the indexed tensor"); on a machine
without a GPU every tensor is on the CPU and such a bug never shows. Here the device-dependent
paths run with their model or inputs on `meta` (shapes and dtypes, no data) under
:func:`strict_devices`, which applies CUDA's rule to every aten op: all tensor arguments on one
device, except 0-dim CPU scalars, copies between devices (`.to`, `copy_`), and advanced indexing,
where CUDA takes CPU indices into another device's tensor and moves a written value only when it
is a 0-dim tensor (aten/src/ATen/native/TensorAdvancedIndexing.cpp, index_put_: `value.numel() == 1
&& value.dim() == 0`). torch's meta kernels do NOT check this themselves: `cpu_table[meta_idx]`,
`meta[idx] = cpu_values` or `F.embedding(cpu_ids, meta_weight)` silently return (or write) a tensor
on the wrong device, which is why the mode exists.

A meta tensor has no data, so a path that reads values on the host (`.item()`, `.tolist()`,
`int(t)`, a copy to the CPU) stops there with NotImplementedError / RuntimeError, unless it runs
under :class:`HostReads`: that mode records every host read (a read of a tensor's value, or a copy
of a device tensor to the host: on a GPU each waits for the device) with the function that made
it, and answers a meta tensor's read with zeros of its shape, so a meta run goes on past its host
reads (a decode loop's every step, with every token 0). On a CPU the reads are the real ones:
there the recorder is how a test sees `.tolist()` or `int(t)`, which dispatch no aten op a
TorchDispatchMode could count.

`DEVICES` parametrizes a test over cpu, meta and cuda (the cuda leg is skipped, with the reason,
where no GPU is visible; on a GPU machine it runs the same assertions on the real device).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NO_GPU = "no CUDA GPU visible: the cuda leg runs where one is (the meta leg stands in for it here)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
DEVICES = [pytest.param("cpu"), pytest.param("meta"), pytest.param("cuda", marks=needs_cuda)]
DATA_DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=needs_cuda)]  # legs that compare values


class DeviceMismatch(RuntimeError):
    """An op got tensors of two devices: on a GPU this is the RuntimeError CUDA raises."""


_aten = torch.ops.aten
# ops that move data between devices by design
_COPIES = {_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
           _aten._copy_from_and_resize.default, _aten.lift_fresh.default}
# advanced indexing: (self, indices[, values, ...]); CPU indices into any device's tensor are fine
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


def _is_cpu_scalar(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def _indexing_devices(func: Any, args: tuple[Any, ...]) -> set[torch.device]:
    """The devices CUDA would have to meet in one advanced-indexing op: the indexed tensor's, every
    index not on the CPU, and the written values' unless they are a 0-dim tensor (CUDA moves those)."""
    self, indices = args[0], args[1]
    devices = {self.device} | {i.device for i in indices if i is not None and i.device.type != "cpu"}
    if func is not _aten.index.Tensor:
        values = args[2]
        if not (values.dim() == 0 and values.device != self.device):
            devices.add(values.device)
    return devices


class _StrictDevices(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEXING:
            devices = _indexing_devices(func, args)
        elif func not in _COPIES:
            flat, _ = tree_flatten((args, kwargs))
            devices = {t.device for t in flat if isinstance(t, torch.Tensor) and not _is_cpu_scalar(t)}
        else:
            devices = set()
        if len(devices) > 1:
            raise DeviceMismatch(f"{func}: tensors on {', '.join(sorted(map(str, devices)))}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def strict_devices() -> Iterator[None]:
    """Every aten op inside refuses tensors of two devices, as CUDA does (see the module doc)."""
    with _StrictDevices():
        yield


def on(device: str, t: torch.Tensor) -> torch.Tensor:
    """`t` on `device` (a meta copy keeps only its shape and dtype)."""
    return t.to(device)


# -- host reads ----------------------------------------------------------------------------------

_T = torch.Tensor
# reads of a tensor's values into Python (on a GPU: a device-to-host copy the host waits for)
VALUE_READS = {_T.tolist: "tolist", _T.item: "item", _T.__int__: "int", _T.__float__: "float",
               _T.__bool__: "bool", _T.__index__: "index", _T.numpy: "numpy", _T.__array__: "array",
               _T.__contains__: "in"}
# copies that may bring a device tensor to the host
_MOVES = {_T.cpu: "cpu", _T.to: "to", _T.copy_: "copy_"}
_TORCH_DIR = str(Path(torch.__file__).parent)


def _reader() -> str:
    """Where a host read was made: `file.function` of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"


def _move_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `.cpu()` / `.to(...)` / `copy_` call copies a tensor off a device onto the host."""
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"
    src = args[0]
    if src.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


def _stand_in(x: Any) -> Any:
    """A meta tensor's host read answered: zeros of its shape and dtype on the CPU."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        return torch.zeros(x.shape, dtype=x.dtype)
    return x


class HostReads(TorchFunctionMode):
    """Records every host read inside it (see the module doc) as `(kind, where)`, e.g.
    `("tolist", "host_transfers.HostTransfers.download")`; a meta tensor's read answers zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = VALUE_READS.get(func)
        if kind is None and func in _MOVES and _move_to_host(_MOVES[func], args, kwargs):
            kind = _MOVES[func]
        if kind is None:
            return func(*args, **kwargs)
        self.reads.append((kind, _reader()))
        return func(*[_stand_in(a) for a in args], **kwargs)

    def where(self) -> list[str]:
        """The functions that read, in order."""
        return [where for _, where in self.reads]
