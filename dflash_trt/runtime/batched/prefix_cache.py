"""Prefix caching for the batched runtime: a prompt's longest cached prefix is copied in, not prefilled.

A sequence's positions are cut into blocks of :data:`BLOCK_TOKENS`. A FULL block is named by a
chained hash: ``h_i = sha256(h_{i-1} || tokens of block i)`` (h_{-1} = b""), so it names the block's
tokens AND everything before them -- the K/V of a position depend on every earlier token, and two
prompts that share a block's tokens at another offset or after another prefix share nothing. A
cached block holds, for its positions,

- the target's K/V of every layer (what a prefill of those positions writes), and
- the drafter's context K/V of every draft layer: the target's features at the tapped layers,
  fused (``hidden_norm(fc(...))``) and projected by each draft layer's k_proj/v_proj, normed and
  roped -- all the drafter keeps of a context position. A hit therefore leaves the drafter exactly
  the context it would have had (TensorRT-LLM's DFlash instead re-runs ``context_recompute_tail``
  prompt tokens for its drafter on a hit; docs/runtime.md "Prefix caching" measures what a drafter
  blind beyond such a tail accepts, and what vLLM and SGLang keep).

On admission (:meth:`PrefixCache.lookup`, read-only) a prompt of P tokens takes its longest run of
cached blocks, at most ``(P - 1) // BLOCK_TOKENS`` of them: the last prompt token is always
computed, for its logits (the first output token) and its features. Only full blocks are cached,
so a shared prefix that ends mid-block reuses the blocks before it and recomputes the rest. The
runtime copies the blocks into the row's slot (:meth:`restore`), prefills the rest, and -- once the
first token is committed -- counts the hit and refreshes the blocks (:meth:`commit`): a request
that fails before that (sampling values with no distribution) leaves the cache as it was.

Blocks enter (:meth:`insert`) once their positions are final in the slot: the prompt's after the
drafter's first pass over it, everything committed when the sequence ends (the next turn of a
conversation resends the answer).

Memory: a pool of ``budget // block_bytes`` blocks, allocated at the first insert on the caches'
device, never more. When it is full the least recently used block goes; the blocks of the chain
being inserted never do (evicting a parent would orphan the children: they are only reachable
through it), and when nothing else is left the insert stops -- a request never fails because the
cache is full. A chain is refreshed tail first, so its last blocks are evicted before its first.

One cache per runtime, on the runtime's device (CPU or CUDA alike): the copies are tensor
indexing, no host round trip of K/V.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.slot_caches import SlotKV

# Tokens per block. TensorRT-LLM's default tokens_per_block (32) rather than vLLM's 16: a node of
# ours and this runtime then reuse the same prefix lengths (what context_recompute_tail was measured
# at), and on a CPU a block's per-block work (hashing, bookkeeping, one gather per layer) is spread
# over twice the positions. The cost is the tail: up to 31 tokens of a shared prefix that ends
# mid-block are recomputed (~16 on average), a few per cent of a 1,000-token prefix.
BLOCK_TOKENS = 32


def block_hashes(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS, parent: bytes = b"",
                 first: int = 0) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` from block `first` on (`parent`: the hash
    of block first-1, b"" for the first block)."""
    out = []
    h = parent
    for lo in range(first * block_tokens, len(tokens) - block_tokens + 1, block_tokens):
        block = ",".join(map(str, tokens[lo: lo + block_tokens])).encode()
        h = hashlib.sha256(h + b"|" + block).digest()
        out.append(h)
    return out


def position_bytes(caches: Sequence[tuple[int, int, int]], itemsize: int) -> int:
    """Bytes one position takes in the caches: (layers, kv_heads, head_dim) each, K and V."""
    return sum(2 * layers * heads * dim for layers, heads, dim in caches) * itemsize


@dataclass
class PrefixHit:
    """What a lookup found for one prompt: its blocks' chained hashes and the cached run."""

    hashes: list[bytes]  # every full block of the prompt (the later insert starts from these)
    blocks: list[int] = field(default_factory=list)  # pool indices of the cached run, in order
    block_tokens: int = BLOCK_TOKENS
    prompt_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Prompt tokens the cache serves (a multiple of the block size)."""
        return len(self.blocks) * self.block_tokens

    @property
    def missed_blocks(self) -> int:
        """The prompt's blocks that were computed (its partial last block included)."""
        return math.ceil(self.prompt_tokens / self.block_tokens) - len(self.blocks)


@dataclass
class PrefixCacheCounters:
    """Runtime-wide counters, in tokens as vLLM's ``vllm:prefix_cache_queries`` / ``hits``."""

    requests: int = 0  # requests that looked up (and started decoding)
    queries: int = 0  # their prompt tokens
    hits: int = 0  # of those, tokens served from the cache
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    drafter_catch_ups: int = 0  # finished rows whose drafter consumed their context only for the cache


class PrefixCache:
    """Cached blocks of target K/V and drafter context K/V (see the module doc).

    `budget_bytes`: the pool's size limit; `block_bytes`: what one block takes (from the models'
    configs: :func:`position_bytes` times the block size). A budget below one block is a
    DFlashError (one line, at start-up)."""

    def __init__(self, budget_bytes: int, block_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if budget_bytes < block_bytes:
            raise DFlashError(
                f"prefix cache: a budget of {budget_bytes / 2**20:.2f} MiB cannot hold one block of {block_tokens} "
                f"positions ({block_bytes / 2**20:.2f} MiB of target and drafter K/V); give --prefix-cache-mib "
                f"{math.ceil(block_bytes / 2**20)} or more, or turn it off with --no-prefix-cache")
        self.budget_bytes, self.block_bytes, self.block_tokens = budget_bytes, block_bytes, block_tokens
        self.capacity = budget_bytes // block_bytes  # blocks
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> pool index, least recent first
        self.free: list[int] = []
        self.pools: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # per cache, per layer: K, V
        self.counters = PrefixCacheCounters()
        self.peak_blocks = 0

    # -- lookup and hits -------------------------------------------------------------------------
    def lookup(self, prompt: Sequence[int]) -> PrefixHit:
        """The prompt's longest cached run of blocks, the last token left out (read-only: nothing
        is refreshed or counted until :meth:`commit`)."""
        hit = PrefixHit(block_hashes(prompt, self.block_tokens), block_tokens=self.block_tokens,
                        prompt_tokens=len(prompt))
        usable = (len(prompt) - 1) // self.block_tokens
        for h in hit.hashes[:usable]:
            index = self.lru.get(h)
            if index is None:
                break
            hit.blocks.append(index)
        return hit

    def commit(self, hit: PrefixHit) -> None:
        """A request whose prefill succeeded: count its query and hit (tokens) and refresh its blocks
        that are still cached (another insert since its lookup may have evicted some: their K/V were
        copied at the lookup, so nothing is lost)."""
        c = self.counters
        c.requests += 1
        c.queries += hit.prompt_tokens
        c.hits += hit.tokens
        self._refresh(hit.hashes[: len(hit.blocks)])

    def _refresh(self, chain: Sequence[bytes]) -> None:
        """Most recently used: the chain's first block last, so its tail is evicted first."""
        for h in reversed(chain):
            if h in self.lru:
                self.lru.move_to_end(h)

    # -- copies between the pool and the slot caches -----------------------------------------------
    def restore(self, hit: PrefixHit, slot: int, caches: Sequence[SlotKV]) -> None:
        """Copy the hit's blocks into positions 0..hit.tokens-1 of `slot` in each cache."""
        if not hit.blocks or self.pools is None:
            return
        n = hit.tokens
        for pool, kv in zip(self.pools, caches):
            index = torch.tensor(hit.blocks, dtype=torch.long, device=pool[0][0].device)
            for layer, (pk, pv) in enumerate(pool):
                for cached, slots in ((pk, kv.keys[layer]), (pv, kv.values[layer])):
                    assert slots is not None, "a hit's caches were written before"
                    blocks = cached.index_select(0, index)  # [m, kv_heads, BT, hd]
                    slots[slot, :, :n] = blocks.transpose(0, 1).reshape(slots.shape[1], n, slots.shape[3])

    def insert(self, hashes: Sequence[bytes], slot: int, caches: Sequence[SlotKV]) -> int:
        """Cache blocks 0..len(hashes)-1 of `slot` (their positions final in every cache); blocks
        already cached are refreshed, not copied. Returns the blocks newly cached. Stops, without
        failing, where no block is left to evict but the chain's own."""
        if not hashes or any(kv.keys[0] is None for kv in caches):
            return 0
        if self.pools is None:
            self._allocate(caches)
        assert self.pools is not None
        chain: set[int] = set()  # the chain's blocks: never evicted by its own insert
        added = 0
        kept = 0
        for i, h in enumerate(hashes):
            index = self.lru.get(h)
            if index is None:
                index = self._take(chain)
                if index is None:
                    break
                self._copy_in(index, i, slot, caches)
                self.lru[h] = index
                added += 1
            chain.add(index)
            kept = i + 1
        self._refresh(hashes[:kept])
        self.counters.inserted_blocks += added
        self.peak_blocks = max(self.peak_blocks, len(self.lru))
        return added

    def _take(self, chain: set[int]) -> int | None:
        """A free pool index: never used yet, or the least recently used block outside `chain`."""
        if self.free:
            return self.free.pop()
        for h, index in self.lru.items():
            if index not in chain:
                del self.lru[h]
                self.counters.evicted_blocks += 1
                return index
        return None

    def _copy_in(self, index: int, block: int, slot: int, caches: Sequence[SlotKV]) -> None:
        lo, hi = block * self.block_tokens, (block + 1) * self.block_tokens
        assert self.pools is not None
        for pool, kv in zip(self.pools, caches):
            for layer, (pk, pv) in enumerate(pool):
                pk[index] = kv.keys[layer][slot, :, lo:hi]  # [kv_heads, BT, hd]
                pv[index] = kv.values[layer][slot, :, lo:hi]

    def _allocate(self, caches: Sequence[SlotKV]) -> None:
        """The pool, shaped as the slot caches (their head counts and dtype are the models' own)."""
        bytes_per_block = sum(2 * t.shape[1] * self.block_tokens * t.shape[3] * t.element_size()
                              for kv in caches for t in kv.keys if t is not None)
        # the configs' estimate decided the start-up check; the caches' real layout decides the pool
        self.block_bytes = bytes_per_block
        self.capacity = self.budget_bytes // bytes_per_block
        self.pools = [[(t.new_empty((self.capacity, t.shape[1], self.block_tokens, t.shape[3])),
                        t.new_empty((self.capacity, t.shape[1], self.block_tokens, t.shape[3])))
                       for t in kv.keys if t is not None] for kv in caches]
        self.free = list(range(self.capacity - 1, -1, -1))  # pop() takes index 0 first

    # -- housekeeping ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every block (the pool stays allocated) and the counters (after a warm-up or a
        calibration, whose dummy prompts no request shares)."""
        self.lru.clear()
        self.free = list(range(self.capacity - 1, -1, -1)) if self.pools is not None else []
        self.counters = PrefixCacheCounters()
        self.peak_blocks = 0

    def __len__(self) -> int:
        return len(self.lru)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.lru)

    @property
    def allocated_bytes(self) -> int:
        return self.capacity * self.block_bytes if self.pools is not None else 0

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"block_tokens": self.block_tokens, "blocks": len(self.lru), "capacity_blocks": self.capacity,
                "peak_blocks": self.peak_blocks, "block_bytes": self.block_bytes, "budget_bytes": self.budget_bytes,
                "allocated_bytes": self.allocated_bytes, "requests": c.requests, "queries": c.queries,
                "hits": c.hits, "hit_rate": c.hits / c.queries if c.queries else 0.0,
                "inserted_blocks": c.inserted_blocks, "evicted_blocks": c.evicted_blocks,
                "drafter_catch_ups": c.drafter_catch_ups}
