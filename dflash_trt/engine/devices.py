"""Where a build runs its model (calibration, acceptance gate): `--device auto|cpu|cuda`.

- cpu: everything on the host.
- cuda: every visible GPU (CUDA_VISIBLE_DEVICES picks them); the target is spread over them by
  a device map (accelerate's `infer_auto_device_map` on a balanced `max_memory`), so the model
  need not fit one GPU, only all of them together. Nothing is offloaded to the host: a model
  that does not fit the GPUs is an error that says how much memory it needs.
- auto: cuda when a GPU is visible, else cpu.

`plan_device_map` is a pure function of the free memory per GPU, so the choice is testable
without a GPU; `gpu_free_bytes` asks the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_trt.errors import DFlashError

DeviceName = Literal["auto", "cpu", "cuda"]

# Kept free on every GPU beyond the weights: activations of a calibration / verify pass (a few
# thousand tokens x hidden x layers' live buffers), the CUDA context and allocator slack.
GPU_HEADROOM_FRACTION = 0.10
GPU_HEADROOM_MIN_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class BuildDevice:
    """The resolved device of a build: 'cpu', or 'cuda' with the free bytes of each visible GPU."""

    kind: Literal["cpu", "cuda"]
    gpu_free_bytes: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_free_bytes)

    def describe(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        free = ", ".join(f"{b / 1e9:.0f}" for b in self.gpu_free_bytes)
        return f"cuda: {self.num_gpus} GPU(s), free GB [{free}]"


def gpu_free_bytes() -> tuple[int, ...]:
    """Free memory of every visible CUDA device (empty when there is none)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count()))


def resolve_device(requested: DeviceName, free: tuple[int, ...] | None = None) -> BuildDevice:
    """`--device` -> BuildDevice. `free` (bytes per GPU) is read from the driver when None."""
    free = gpu_free_bytes() if free is None and requested != "cpu" else (free or ())
    if requested == "cpu":
        return BuildDevice("cpu")
    if not free:
        if requested == "cuda":
            raise DFlashError("--device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False); "
                              "check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu")
        return BuildDevice("cpu")
    return BuildDevice("cuda", tuple(free))


def usable_bytes(free: int) -> int:
    """What a GPU with `free` bytes may hold in weights (the rest is kept for activations)."""
    return max(0, free - max(GPU_HEADROOM_MIN_BYTES, int(free * GPU_HEADROOM_FRACTION)))


def plan_device_map(model: Any, free: tuple[int, ...] | list[int], dtype: Any) -> dict[str, int]:
    """Module prefix -> GPU index for `model` (usually on the meta device) over GPUs with `free`
    bytes each: balanced so every GPU keeps room for activations, never the host or the disk.

    Pure: reads only the model's parameter shapes and `free`; no CUDA call.
    """
    import logging

    from accelerate.utils import compute_module_sizes, get_balanced_memory, infer_auto_device_map

    # accelerate warns "Device i is not available" when planning for GPUs this process cannot see
    # (a plan made ahead, or a test); the plan itself needs no device.
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)

    if not free:
        raise ValueError("plan_device_map needs at least one GPU")
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    max_memory: dict[int | str, int] = {i: usable_bytes(b) for i, b in enumerate(free)}
    need = compute_module_sizes(model, dtype=dtype)[""]
    have = sum(v for v in max_memory.values())
    if need > have:
        raise DFlashError(
            f"the target needs {need / 1e9:.1f} GB of GPU memory in {str(dtype).removeprefix('torch.')} but the "
            f"{len(free)} visible GPU(s) have {have / 1e9:.1f} GB usable; make more GPUs visible or build with "
            "--device cpu")
    def place(budget: dict[int | str, int]) -> dict[str, Any]:
        budget = {k: v for k, v in budget.items() if isinstance(k, int)}
        budget["cpu"] = 0  # never offload to the host: the build would crawl
        return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype)

    device_map = place(max_memory)
    if len(free) > 1:
        # balanced: an even share per GPU (room for activations everywhere); on uneven GPUs the
        # even share may not fit, and filling the GPUs in order (above) is the fallback
        balanced = place(get_balanced_memory(model, max_memory=dict(max_memory), no_split_module_classes=no_split,
                                             dtype=dtype))
        if all(isinstance(v, int) for v in balanced.values()):
            device_map = balanced
    off = [k for k, v in device_map.items() if not isinstance(v, int)]
    if off:
        raise DFlashError(f"the target does not fit the visible GPUs ({off[0]} would go to {device_map[off[0]]}); "
                          "make more GPUs visible or build with --device cpu")
    return {k: int(v) for k, v in device_map.items()}


def device_map_for(model_dir: Any, dtype: Any, device: BuildDevice) -> dict[str, Any]:
    """The placement of the checkpoint at `model_dir` in `dtype` on `device`: {"": "cpu"} on the
    host, else a device map over the visible GPUs (built from a meta model: no weights read)."""
    if device.kind == "cpu":
        return {"": "cpu"}
    from pathlib import Path

    from dflash_trt.checkpoints.streaming import empty_model, model_config

    meta = empty_model(model_config(Path(model_dir)), dtype)
    return plan_device_map(meta, device.gpu_free_bytes, dtype)
