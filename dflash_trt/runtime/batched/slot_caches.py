"""Preallocated, position-indexed KV caches for the batched runtime: rollback is resetting a length.

Layout: one row ("slot") per running sequence, left-aligned, and cache index == token position.
A forward writes its new K/V at explicit per-row indices (``index_put_``, no concatenation, no
reallocation), and returns a VIEW of the rows and the first ``width`` positions. What a query
may see is decided by the 4D mask built by the caller from the positions alone, so stale K/V
beyond a row's committed length (rejected draft tokens, padding) is simply never visible and
gets overwritten by the next step: rolling back a rejection costs nothing.

Padding entries that must not clobber real positions (left-padded prompts, short context rows
in the drafter) are written to a DUMP index at the very end of the allocation, which no mask
ever exposes.

Memory: ``slots x (max_len + block + 1)`` positions per layer, sized from the engine limits
(max_batch_size, max_seq_len) once; the same tensors serve every step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, 1, S, T] (True = visible) -> additive float mask (0 / dtype min).

    A float mask works with every HF attention implementation (eager adds it, SDPA takes it);
    dtype-min rather than -inf keeps fully hidden padding queries free of NaN."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def slot_indices(rows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The slots of a pass's rows as an index tensor [n]."""
    return rows if isinstance(rows, torch.Tensor) else torch.arange(rows.start, rows.stop, device=device)


class SlotKV:
    """K/V storage for `num_layers` layers: [slots, kv_heads, capacity, head_dim] each, lazily
    allocated on the first write (head counts and dtype come from the model's own K/V)."""

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        self.num_layers, self.slots, self.capacity = num_layers, slots, capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # set by the caller before each forward: the slots of the pass's rows (a slice, or the slot
        # indices of a subset: chunked verification)
        self.rows: slice | torch.Tensor = slice(0, 0)
        self.write_index: torch.Tensor | None = None  # [n, S] long: where each new position goes
        self.write_rows: torch.Tensor | None = None  # [n, S] long: the slot of each write (made once a pass)
        self.width: int = 0  # positions returned to attention (mask width)

    @property
    def dump_index(self) -> int:
        return self.capacity - 1

    def prepare(self, rows: slice | torch.Tensor, write_index: torch.Tensor, width: int) -> None:
        if width > self.dump_index:
            raise ValueError(f"cache width {width} exceeds capacity {self.capacity - 1}")
        self.rows, self.write_index, self.width = rows, write_index, width
        # once per pass, not once per layer: on a GPU every layer's arange is a kernel of its own
        self.write_rows = slot_indices(rows, write_index.device)[:, None].expand_as(write_index)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [n, kv_heads, S, hd] for the rows self.rows; returns [n, kv_heads, width, hd] (views of
        # a slice of slots; copies of a subset's)
        if self.keys[layer] is None:
            shape = (self.slots, k.shape[1], self.capacity, k.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kc, vc = self.keys[layer], self.values[layer]
        idx, rows = self.write_index, self.write_rows  # [n, S] each
        assert idx is not None and idx.shape == (k.shape[0], k.shape[2]), "prepare() the cache before the forward"
        # advanced indices around a slice: the indexed shape is [n, S, kv_heads, hd]
        kc[rows, :, idx] = k.transpose(1, 2)
        vc[rows, :, idx] = v.transpose(1, 2)
        return kc[self.rows, :, : self.width], vc[self.rows, :, : self.width]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (compaction when a sequence
        leaves: once per departure, never per step)."""
        for t in (*self.keys, *self.values):
            if t is not None:
                t[dst, :, :length] = t[src, :, :length]


class BatchedKVCache(Cache):
    """The target's cache: the part of the transformers Cache API that Llama/Qwen3 attention uses
    (``update(key, value, layer_idx) -> full K/V``) over a :class:`SlotKV`.

    Only valid with an explicit 4D attention mask and explicit position_ids (the model then asks
    the cache nothing else); ``get_seq_length`` reports the mask width for code that asks."""

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        super().__init__(layers=[])
        self.kv = SlotKV(num_layers, slots, capacity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.kv.write(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.width

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.kv.capacity - 1

    def __len__(self) -> int:
        return self.kv.num_layers

    @property
    def is_compileable(self) -> bool:  # fixed shapes: CUDA-graph friendly
        return True


class BatchedDraftCache:
    """The drafter's cache: DFlashAttention calls ``update(layer, k, v)`` with the new context
    positions followed by the block; both go to their positions, and the block's K/V are simply
    overwritten by the context of the next step (no crop needed)."""

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        self.kv = SlotKV(num_layers, slots, capacity)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write(layer, k, v)
