"""The reference DFlash decoding loop (batch 1) and plain autoregressive decoding.

One step of DFlash, with B = block size and `start` = number of tokens in the target KV cache:

    block  = [pending, MASK x k]                 k = min(B-1, tokens still allowed - 1)
    draft  = argmax lm_head(drafter(ctx_new, embed(block)))[1:]     one pass, k proposals
    verify = target(block)                                           one pass, k+1 logits
    post   = sample(verify logits)               post[j] = target's token AFTER block[j]
    a      = longest prefix with draft[j] == post[j-1]
    commit block[0..a] and post[a] (the bonus); roll the target KV back to start + a + 1

Lossless: post[j] is drawn from the target's distribution given block[0..j], and it is used
only when block[1..j] equals what the target itself emitted, so every output token is a draw
from the target (with a greedy draft this is exact-match acceptance; at temperature 0 the output
is the target's greedy output, token for token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_trt.metrics import GenerationStats
from dflash_trt.runtime.draft_model import DFlashDraftModel, DraftKVCache
from dflash_trt.runtime.sampling import sample
from dflash_trt.runtime.target import TargetAdapter

# Called with the tokens each step commits (for streaming); return True to stop early.
StepCallback = Callable[[list[int]], "bool | None"]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # generated ids only (a stop token, if hit, is the last one)
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def sequence(self) -> torch.Tensor:
        """[1, prompt + generated], the shape HF generate() returns."""
        return torch.tensor([self.prompt_ids + self.output_ids], dtype=torch.long)


def _as_ids(input_ids: torch.Tensor | list[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError("the reference loop decodes one sequence; use the batched runtime for more")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def _check_args(prompt: list[int], max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not prompt:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")


def _truncate_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1], True
    return tokens, False


def _finish(prompt: list[int], out: list[int], stop: set[int], stats: GenerationStats, t0: float) -> GenerationResult:
    stats.num_output_tokens = len(out)
    stats.finish_reason = "stop" if out[-1] in stop else "length"
    stats.total_time_s = time.perf_counter() - t0
    return GenerationResult(prompt, out, stats)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return torch.Generator(device=device).manual_seed(seed) if seed is not None else None


@torch.inference_mode()
def dflash_generate(
    draft: DFlashDraftModel,
    target: "torch.nn.Module | TargetAdapter",
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    block_size: int | None = None,
    on_step: StepCallback | None = None,
) -> GenerationResult:
    """Speculative decoding with a DFlash drafter. Output distribution == the target's."""
    target = TargetAdapter(target)
    prompt = _as_ids(input_ids)
    _check_args(prompt, max_new_tokens, temperature, top_p)
    B = block_size or draft.block_size
    stop = set(stop_token_ids or ())
    dev = target.device
    gen = _generator(seed, dev)
    layer_ids = draft.target_layer_ids
    stats = GenerationStats(num_prompt_tokens=len(prompt))
    t0 = time.perf_counter()

    # 1. Prefill: first token from the last prompt logits; context features of every prompt position.
    cache, draft_cache = target.new_cache(), DraftKVCache()
    ids = torch.tensor([prompt], device=dev)
    logits, ctx_new = target.forward(ids, torch.arange(len(prompt), device=dev)[None], cache, layer_ids, logits_to_keep=1)
    pending = int(sample(logits[:, -1], temperature, top_p, gen))  # not yet in the target KV cache
    out = [pending]
    stats.ttft_s = time.perf_counter() - t0
    done = pending in stop
    if on_step is not None and on_step([pending]):
        done = True

    # 2. Draft -> verify -> accept until a stop token or max_new_tokens.
    while not done and len(out) < max_new_tokens:
        start = len(prompt) + len(out) - 1  # positions in the target KV cache
        k = min(B - 1, max_new_tokens - len(out) - 1)  # a step commits up to k + 1 tokens
        block = torch.full((1, k + 1), draft.mask_token_id, device=dev)
        block[0, 0] = pending
        positions = torch.arange(start, start + k + 1, device=dev)[None]  # [1, k+1]
        if k > 0:
            c = ctx_new.shape[1]
            draft_pos = torch.arange(start - c, start + k + 1, device=dev)[None]  # ctx then block
            hidden = draft(ctx_new, target.embed(block), draft_pos, draft_cache)  # [1, k+1, H]
            draft_cache.crop(start)  # keep context K/V only
            block[0, 1:] = target.lm_head(hidden[:, 1:]).argmax(-1)[0]  # slot j predicts position start+j
            ctx_new = ctx_new[:, :0]
        logits, feats = target.forward(block, positions, cache, layer_ids)  # [1, k+1, V]
        posterior = sample(logits[0], temperature, top_p, gen)  # [k+1]
        matches = (block[0, 1:] == posterior[:-1]).int()
        a = int(matches.cumprod(0).sum())  # accepted draft tokens
        new = block[0, 1 : a + 1].tolist() + [int(posterior[a])]
        stats.record_step(drafted=k, accepted=a)
        new, done = _truncate_at_stop(new, stop)
        out.extend(new)
        TargetAdapter.crop(cache, start + a + 1)  # block[0..a] stay; the bonus is the new pending
        ctx_new = torch.cat([ctx_new, feats[:, : a + 1]], dim=1)  # [1, c + a + 1, n*H]
        pending = out[-1]
        if on_step is not None and on_step(new):
            done = True

    return _finish(prompt, out, stop, stats, t0)


@torch.inference_mode()
def autoregressive_generate(
    target: "torch.nn.Module | TargetAdapter",
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    on_step: StepCallback | None = None,
) -> GenerationResult:
    """Plain decoding with the same adapter, cache and sampler: the baseline DFlash is compared to."""
    target = TargetAdapter(target)
    prompt = _as_ids(input_ids)
    _check_args(prompt, max_new_tokens, temperature, top_p)
    stop = set(stop_token_ids or ())
    dev = target.device
    gen = _generator(seed, dev)
    stats = GenerationStats(num_prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    cache = target.new_cache()
    ids = torch.tensor([prompt], device=dev)
    positions = torch.arange(len(prompt), device=dev)[None]
    out: list[int] = []
    while True:
        logits, _ = target.forward(ids, positions, cache, logits_to_keep=1)
        token = int(sample(logits[:, -1], temperature, top_p, gen))
        out.append(token)
        if len(out) == 1:
            stats.ttft_s = time.perf_counter() - t0
        else:
            stats.record_step(drafted=0, accepted=0)
        stopped = on_step is not None and bool(on_step([token]))
        if token in stop or stopped or len(out) >= max_new_tokens:
            break
        ids = torch.tensor([[token]], device=dev)
        positions = positions[:, -1:] + 1
    return _finish(prompt, out, stop, stats, t0)
