"""CUDA graphs for the batched runtime's fixed-shape passes: one capture per shape, then replays.

A small target on a GPU is bound by kernel launches and Python, not by the GPU: eager SmolLM2-135M
took 33.6 ms per plain step on an H100 whose memory bandwidth allows ~0.2 ms. A captured graph
replays the whole pass's kernels with one launch and no Python.

How a pass is graphed (:class:`StepGraphs`):
- The caller pads the pass to a shape from a small set (rows to a power of two, mask width to a
  multiple of 128, the drafter's context to the block: see BatchedRuntime) and names it by `key`.
- First time a key is seen the pass runs eagerly (the step's real result, and the warm-up that
  allocates every persistent buffer outside the graph), once more on a side stream, then is
  captured into a graph with static copies of its inputs. Capturing executes nothing; the side
  effects (K/V and feature writes at the step's write indices) come from the eager runs, which
  write the same values twice.
- Later: the inputs are copied into the static tensors and the graph is replayed.
- Outputs are cloned right after a replay: graphs share one memory pool, and a later capture may
  place its outputs where an earlier graph keeps its intermediates, so a static output is only
  valid until the next replay of another graph.

Everything a graphed pass reads or writes outside its inputs (the KV caches, the feature buffer,
the weights) is allocated before its capture and never reallocated, which the batched runtime's
preallocated caches guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class StepGraphs:
    """Captured graphs by shape key, on the CUDA device `device`: the model's (see the module doc).

    Every capture and replay runs under that device and on a stream of it, whatever the process's
    current device: a model on cuda:1 captured on cuda:0's streams fails (or, worse, records work
    on the wrong GPU). torch.cuda.graph's default capture stream is made once per process on
    whichever device was current then, so each StepGraphs passes its own.

    `captured_now` is set when the last call captured a graph: that step's wall time includes the
    capture and says nothing about the pass's cost (the runtime leaves it out of its cost table)."""

    device: torch.device
    max_graphs: int = 512  # a bound on memory: beyond it new shapes run eagerly
    graphs: dict[Hashable, _Captured] = field(default_factory=dict)
    captured_now: bool = False
    _pool: object = None
    _stream: "torch.cuda.Stream | None" = None  # warm-up and capture stream, on `device`

    def __call__(self, key: Hashable, fn: Callable[..., Sequence[torch.Tensor]],
                 *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entry = self.graphs.get(key)
        if entry is None:
            out = tuple(fn(*inputs))  # the real result, and the warm-up
            if len(self.graphs) < self.max_graphs:
                with torch.cuda.device(self.device):
                    self.graphs[key] = self._capture(fn, inputs)
                self.captured_now = True
            return out
        with torch.cuda.device(self.device):
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x)
            entry.graph.replay()
        return tuple(o.clone() for o in entry.outputs)

    def _capture(self, fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]) -> _Captured:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        static = tuple(x.clone() for x in inputs)
        # warm up on a side stream first, as PyTorch's CUDA-graph docs require (lazy per-stream
        # state such as cuBLAS workspaces). It repeats the eager run on the same inputs, so its
        # K/V and feature writes rewrite the same values at the same indices.
        side, main = self._stream, torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fn(*static)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            outputs = tuple(fn(*static))
        return _Captured(graph, static, outputs)

    def take_captured_flag(self) -> bool:
        """Whether a capture happened since the last call (and reset it)."""
        flag, self.captured_now = self.captured_now, False
        return flag
