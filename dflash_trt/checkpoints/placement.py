"""Where a loaded model lives: one device, or a device map that spreads it over several.

`home_device` is THE answer to "which device do this model's inputs go to": the decoding loops,
the build (its drafter and calibration ids), training and the benchmarks all ask it, so a target
spread over GPUs by a device map has one home, not one per caller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_trt.errors import DFlashError


def home_device(model: nn.Module) -> torch.device:
    """The device a model's inputs go to and its outputs are brought back to: its input
    embedding's (the first module a token meets; accelerate's dispatch brings every output of a
    device-mapped model back there), or for a model without one (the drafter) its first
    parameter's; the CPU for a model without parameters."""
    embeddings = getattr(model, "get_input_embeddings", None)
    if embeddings is not None:
        try:
            return embeddings().weight.device
        except (AttributeError, NotImplementedError):  # a model class that defines no embedding
            pass
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def model_devices(model: nn.Module) -> list[torch.device]:
    """Every device holding a parameter or buffer of `model`, in order of first appearance: more
    than one for a target spread over GPUs by a device map."""
    seen: dict[torch.device, None] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen.setdefault(t.device, None)
    return list(seen)


def device_of(device_map: dict[str, Any], name: str) -> Any:
    """The device a device map gives parameter `name` (longest matching module prefix)."""
    best, found = -1, None
    for prefix, dev in device_map.items():
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if len(prefix) > best:
                best, found = len(prefix), dev
    if found is None:
        raise DFlashError(f"device map places no module holding {name}; it must cover the whole model")
    return found


def runtime_device(name: str, flag: str = "--device", kinds: tuple[str, ...] = ("cpu", "cuda")) -> torch.device:
    """A `--device` for the PyTorch runtime (cpu, cuda, cuda:N) as a torch device, checked before
    anything loads: a malformed name, a CUDA device where torch sees none (a CPU-only build, no
    driver, CUDA_VISIBLE_DEVICES empty) or past the visible ones is one DFlashError line. `kinds`:
    the device types allowed (the Python API also takes "meta", shapes only, for tests)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise DFlashError(f"{flag} {name!r}: give cpu, cuda or cuda:N") from None
    if device.type not in kinds:
        raise DFlashError(f"{flag} {name}: the runtime runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DFlashError(f"{flag} {name} but torch sees no CUDA GPU (torch {torch.__version__}"
                              f"{', built without CUDA' if torch.version.cuda is None else ''}); check "
                              "CUDA_VISIBLE_DEVICES and the driver, or use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DFlashError(f"{flag} {name}: only {torch.cuda.device_count()} CUDA GPU(s) visible "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device
