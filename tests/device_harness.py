"""Device bugs made visible without a GPU: the `meta` device and a strict-device dispatch mode.

A CUDA kernel refuses tensors of two devices ("Expected all tensors to be on the same device",
"indices should be either on cpu or on the same device as the indexed tensor"); on a machine
without a GPU every tensor is on the CPU and such a bug never shows. Here the device-dependent
paths run with their model or inputs on `meta` (shapes and dtypes, no data) under
:class:`strict_devices`, which applies CUDA's rule to every aten op: all tensor arguments on one
device, except 0-dim CPU scalars, copies between devices (`.to`, `copy_`), and CPU indices into
another device's tensor. torch's meta kernels do NOT check this themselves: `cpu_table[meta_idx]`
or `F.embedding(cpu_ids, meta_weight)` silently return a tensor on the wrong device, which is why
the mode exists. A meta tensor has no data, so a path that reads values on the host (`.item()`,
`.tolist()`, a copy to the CPU) stops there with NotImplementedError / RuntimeError: the tests
say where they expect that.

`DEVICES` parametrizes a test over cpu, meta and cuda (the cuda leg is skipped, with the reason,
where no GPU is visible; on a GPU machine it runs the same assertions on the real device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
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
# a tensor of any device may be indexed with CPU indices (CUDA allows it; the reverse it refuses)
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


class _StrictDevices(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _COPIES:
            flat, _ = tree_flatten((args, kwargs))
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            if func in _INDEXING and tensors:
                home = tensors[0].device
                devices = {home} | {t.device for t in tensors[1:] if t.device.type != "cpu"}
            else:
                devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
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
