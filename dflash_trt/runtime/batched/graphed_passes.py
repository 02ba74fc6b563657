"""The batched runtime's two static-shape passes, by shape key, all captured before the first request.

    draft   (DRAFT, N, k, W):  DFlashProposer.propose over the step's row table, context k + 1 -> drafts [N, k]
    verify  (VERIFY, N, k, W): TargetPasses.verify_greedy over the table and the drafts -> [N, k+2]

Keys come from runtime/batched/step_shapes.py (rows N, draft length k, mask width W); the dispatch (a CUDA
graph per key on a GPU, the same passes run eagerly elsewhere) from runtime/gpu/cuda_graphs.py. Capture
runs every key on padding rows only (the row table's live column 0: every write goes to the dump
index), after one eager pass of each kind has allocated every cache a graph will use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.gpu.cuda_graphs import StaticPasses
from dflash_trt.runtime.batched.dflash_proposer import DFlashProposer
from dflash_trt.runtime.batched.scheduling import row_table
from dflash_trt.runtime.batched.step_shapes import DRAFT, VERIFY, StepShapes
from dflash_trt.runtime.batched.target_passes import TargetPasses


class GraphedPasses:
    def __init__(self, graphs: StaticPasses, shapes: StepShapes, passes: TargetPasses,
                 proposer: DFlashProposer | None, upload: Callable[[list[list[int]]], torch.Tensor]) -> None:
        self.graphs, self.shapes, self.passes, self.proposer, self.upload = graphs, shapes, passes, proposer, upload

    def draft(self, table: torch.Tensor, k: int, width: int) -> torch.Tensor:
        """Drafts [N, k] of a steady drafting step (every row's backlog <= k + 1) over table [N, 5]."""
        return self.graphs((DRAFT, table.shape[0], k, width), self._draft_fn(k, width), table)[0]

    def verify(self, table: torch.Tensor, drafts: torch.Tensor | None, k: int, width: int) -> torch.Tensor:
        """Greedy verification [N, k+2] of table [N, 5] and drafts [N, k] (None: k = 0)."""
        inputs = (table,) if drafts is None else (table, drafts)
        return self.graphs((VERIFY, table.shape[0], k, width), self._verify_fn(width), *inputs)[0]

    def _draft_fn(self, k: int, width: int) -> Callable[[torch.Tensor], tuple[torch.Tensor]]:
        assert self.proposer is not None
        proposer, features = self.proposer, self.passes.features

        def draft(table: torch.Tensor) -> tuple[torch.Tensor]:  # reads only its input and persistent buffers
            return (proposer.propose(table, features, k, k + 1, width),)

        return draft

    def _verify_fn(self, width: int) -> Callable[..., tuple[torch.Tensor]]:
        passes = self.passes

        def verify(table: torch.Tensor, drafts: torch.Tensor | None = None) -> tuple[torch.Tensor]:
            return (passes.verify_greedy(table, drafts, width),)

        return verify

    def capture(self, draft_lengths: set[int]) -> None:
        """Capture every (pass, rows, k, width) the runtime can replay with these draft lengths."""
        keys = self.shapes.keys(draft_lengths)
        if len(keys) > self.graphs.max_graphs:
            raise DFlashError(f"CUDA graphs: {len(keys)} static shapes to capture (row buckets "
                              f"{list(self.shapes.rows_buckets)} x widths {self.shapes.widths()} x draft lengths "
                              f"{sorted(draft_lengths)}) exceed {self.graphs.max_graphs}; lower max_seq_len or "
                              "max_batch, give fewer graph batch sizes, or turn CUDA graphs off")
        tables = {n: self.upload(row_table([], n)) for n in self.shapes.rows_buckets}  # padding rows only
        device = tables[self.shapes.rows_buckets[-1]].device

        def drafts(n: int, k: int) -> torch.Tensor | None:
            return torch.zeros((n, k), dtype=torch.long, device=device) if k else None

        with torch.inference_mode():
            # one eager pass of each kind first, on the current stream: every cache is allocated
            # before the first capture (a graph must never allocate what outlives it)
            n_max, w_min, k_max = self.shapes.rows_buckets[-1], self.shapes.widths()[0], max(draft_lengths)
            if self.proposer is not None and k_max:
                self._draft_fn(k_max, w_min)(tables[n_max])
            self._verify_fn(w_min)(tables[n_max], drafts(n_max, k_max))
            for kind, n, k, w in keys:
                if kind == DRAFT:
                    self.graphs.capture((kind, n, k, w), self._draft_fn(k, w), tables[n])
                else:
                    inputs = (tables[n],) if k == 0 else (tables[n], drafts(n, k))
                    self.graphs.capture((kind, n, k, w), self._verify_fn(w), *inputs)
        self.graphs.frozen = True
