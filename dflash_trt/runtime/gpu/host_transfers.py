"""The batched runtime's traffic between host and device, in one place and counted.

A step sends small integer tables down (each row's start, drafter position, pending token) and
reads ONE result back: the posteriors, acceptance lengths and first tokens of the whole batch.
That read is the step's only synchronisation with the device; everything before it is queued.

On a GPU a plain ``torch.tensor(list, device="cuda")`` copies from pageable memory and waits for
the copy (the host stalls until the device's queue drained, once per table); here a table goes
through pinned memory with ``non_blocking=True`` and the host goes on queueing work. The counters
let tests assert "one sync per step" on a CPU, where nothing would show it otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class HostTransfers:
    device: torch.device
    uploads: int = 0  # tables sent to the device
    syncs: int = 0  # reads that wait for the device
    _pin: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._pin = self.device.type == "cuda"

    def upload(self, rows: Sequence[Sequence[int]] | Sequence[int]) -> torch.Tensor:
        """An int64 table on the device, queued without waiting (pinned host copy on a GPU)."""
        self.uploads += 1
        host = torch.tensor(rows, dtype=torch.long, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def download(self, parts: Sequence[torch.Tensor]) -> list[int]:
        """The step's one read: `parts` (integer tensors on the device) flattened into one list."""
        self.syncs += 1
        if not parts:
            return []
        return torch.cat([p.reshape(-1).long() for p in parts]).tolist()

    def to_dict(self) -> dict[str, int]:
        return {"uploads": self.uploads, "syncs": self.syncs}
