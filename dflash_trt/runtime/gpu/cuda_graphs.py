"""The batched runtime's static-shape passes, by shape key: captured at start-up, replayed per step.

A small target on a GPU is bound by kernel launches and Python, not by the GPU: eager SmolLM2-135M
took 17.7 ms per bf16 plain step on an H200 whose memory bandwidth allows ~0.06 ms. A captured
graph replays the whole pass's kernels with one launch and no Python.

Every shape a configuration replays is captured BEFORE serving (:meth:`StaticPasses.capture`,
called by BatchedRuntime at construction for the keys of runtime/batched/step_shapes.py), as
TensorRT-LLM captures its ``cuda_graph_config.batch_sizes`` and vLLM its capture sizes at start-up.
The first GPU run captured lazily, the first time a step met a shape: a capture costs a few eager
passes, and at C=8/32 in bf16 the timed runs paid for dozens of them (0.42-0.51x plain where the
policy's table promised 1.43-1.54x). After start-up nothing is captured: a key that was not
captured runs eagerly and is counted as a miss (a bug in the key set, which tests assert never
happens).

Two implementations of one interface, so the CPU runs the same dispatch the GPU does:

- :class:`StaticPasses` (any device; the CPU's): ``capture`` runs the pass once on its dummy
  inputs and records the key; a call runs the pass eagerly. Tests count captures, replays and
  misses on it without a GPU.
- :class:`CudaGraphPasses`: ``capture`` warms the pass up on a side stream (as PyTorch's CUDA-graph
  docs require: lazy per-stream state such as cuBLAS workspaces) and captures it into a graph with
  static copies of its inputs; a call copies the inputs into them and replays. The pass's side
  effects (K/V and feature writes) at capture time go to the dump index: the dummy inputs are all
  padding rows.

Outputs are cloned right after a replay: graphs share one memory pool, and a later replay of
another graph may place its intermediates where this graph keeps its outputs.

Everything a pass reads or writes outside its inputs (the KV caches, the feature buffer, the
weights) is allocated before the first capture and never reallocated (the batched runtime
preallocates its caches and runs one eager pass first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PassFn = Callable[..., Sequence[torch.Tensor]]


@dataclass
class PassCounters:
    """What the static passes did: captures (at start-up), replays, and misses (a key never
    captured, run eagerly); capture_s and graph_bytes: the start-up's cost."""

    captured: int = 0
    capture_s: float = 0.0
    graph_bytes: int = 0
    replays: int = 0
    misses: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"captured": self.captured, "capture_s": round(self.capture_s, 3), "graph_bytes": self.graph_bytes,
                "replays": self.replays, "misses": self.misses}


@dataclass
class StaticPasses:
    """Static-shape passes run eagerly, through the dispatch CUDA graphs use (see the module doc)."""

    max_graphs: int = 1024
    keys: set[Hashable] = field(default_factory=set)
    counters: PassCounters = field(default_factory=PassCounters)
    frozen: bool = False  # set after start-up: no capture from then on

    def capture(self, key: Hashable, fn: PassFn, *inputs: torch.Tensor) -> None:
        """Make `key` replayable; its pass runs here on `inputs` (dummy rows: padding only)."""
        if self.frozen:
            raise RuntimeError(f"capture of {key} after start-up: every shape is captured before serving")
        if key in self.keys:
            return
        if len(self.keys) >= self.max_graphs:
            raise RuntimeError(f"more than {self.max_graphs} static shapes")
        t = time.perf_counter()
        self._capture(key, fn, inputs)
        self.keys.add(key)
        self.counters.captured += 1
        self.counters.capture_s += time.perf_counter() - t

    def _capture(self, key: Hashable, fn: PassFn, inputs: Sequence[torch.Tensor]) -> None:
        fn(*inputs)  # runs: a pass that cannot run on padding rows fails at start-up, not in a request

    def __call__(self, key: Hashable, fn: PassFn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if key not in self.keys:
            self.counters.misses += 1
            return tuple(fn(*inputs))
        self.counters.replays += 1
        return self._replay(key, fn, inputs)

    def _replay(self, key: Hashable, fn: PassFn, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(fn(*inputs))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class CudaGraphPasses(StaticPasses):
    """Static-shape passes captured as CUDA graphs on `device` and replayed (see the module doc)."""

    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    graphs: dict[Hashable, _Captured] = field(default_factory=dict)
    _pool: Any = None
    _stream: Any = None  # warm-up and capture stream, on `device`

    def _capture(self, key: Hashable, fn: PassFn, inputs: Sequence[torch.Tensor]) -> None:
        with torch.cuda.device(self.device):  # the runtime's GPU, whichever is current
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            reserved = torch.cuda.memory_reserved()
            if self._stream is None:
                # torch.cuda.graph's default capture stream is made once per process on whichever
                # device was current then: a runtime on cuda:1 passes a stream of its own GPU
                self._stream = torch.cuda.Stream(device=self.device)
            static = tuple(x.clone() for x in inputs)
            side = self._stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up on a side stream first, as PyTorch's graph docs require
                fn(*static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                outputs = tuple(fn(*static))
            torch.cuda.synchronize(self.device)
            # the pool's growth: the graphs' intermediates and outputs (one pool for all of them)
            self.counters.graph_bytes += max(0, torch.cuda.memory_reserved() - reserved)
        self.graphs[key] = _Captured(graph, static, outputs)

    def _replay(self, key: Hashable, fn: PassFn, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        entry = self.graphs[key]
        with torch.cuda.device(self.device):
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x)
            entry.graph.replay()
            return tuple(o.clone() for o in entry.outputs)


def static_passes(device: torch.device) -> StaticPasses:
    """CUDA graphs on a CUDA device; elsewhere the same passes run eagerly (what CPU tests check)."""
    return CudaGraphPasses(device=device) if device.type == "cuda" else StaticPasses()
