"""The reference DFlash decoding loop (batch 1) and plain autoregressive decoding.

One step of DFlash, with B = the drafter's block size, K = the most drafts a step verifies
(SpeculationSettings; K <= B-1) and `start` = number of tokens in the target KV cache:

    block  = [pending, MASK x (B-1)]             the full trained block, always
    hidden = drafter(ctx_new, embed(block))      one pass over the block
    draft  = propose(hidden[1:K+1])              K proposals: the argmax of each slot's logits
                                                 (DFlash2: the selector's walk), or draws from q
    verify = target([pending, draft])            one pass, K+1 logits
    a, bonus = exact match: post = sample(verify logits), a = longest prefix with
                              draft[j] == post[j-1], bonus = post[a]
               or rejection sampling against q (runtime/decoding/rejection.py)
    commit block[0..a] and the bonus, at most the tokens the budget has left;
    roll the target KV back to start + a + 1

At temperature 0 every step drafts the argmax and accepts the exact match. Above it the
speculation setting ``draft_method`` (speculation.py) says what is drafted and how it is verified.

At the budget's tail the step is the same (full block drafted, K verified) and only what it
commits is capped: a request's steps are those of the same request with a larger budget, up to
its last one. A step's statistics count the drafts that could be committed (at the tail,
min(K, tokens left - 1)), so tau stays "tokens committed per step".

Lossless: with exact match, post[j] is drawn from the target's distribution given block[0..j],
and it is used only when block[1..j] equals what the target itself emitted, so every output
token is a draw from the target (at temperature 0 the output is the target's greedy output, token
for token); rejection sampling is lossless for any q the drafts were drawn from (runtime/decoding/rejection.py).
"""

from __future__ import annotations

import time

import torch

from dflash_trt.checkpoints.placement import home_device
from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.metrics import GenerationStats
from dflash_trt.runtime.decoding.rejection import one_hot_q, rejection_sample
from dflash_trt.runtime.decoding.results import GenerationResult, StepCallback, finish, truncate_at_stop
from dflash_trt.runtime.decoding.sampling import sample, sampling_probs
from dflash_trt.runtime.drafters.dflash import DFlashDraftModel, DraftKVCache
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.sampling_params import GREEDY, SamplingParams
from dflash_trt.speculation import FIXED, SpeculationSettings, rejection_verified, samples_drafts

def _as_ids(input_ids: torch.Tensor | list[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError("the reference loop decodes one sequence; use the batched runtime for more")
            input_ids = input_ids[0]
        input_ids = input_ids.tolist()
    ids = [int(t) for t in input_ids]
    if not ids:
        raise InvalidRequest("the prompt is empty (no tokens); give at least one prompt token")
    return ids


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return torch.Generator(device=device).manual_seed(seed) if seed is not None else None


def reference_settings(draft: DFlashDraftModel, speculation: SpeculationSettings | None) -> SpeculationSettings:
    """The reference loop's settings: K = B-1 unless given; only the fixed policy runs here."""
    s = speculation or SpeculationSettings.for_block(draft.block_size)
    if s.block_size != draft.block_size:
        raise DFlashError(f"speculation settings are for block_size {s.block_size} but the drafter's block is "
                          f"{draft.block_size}; build them from this drafter (SpeculationSettings.for_block)")
    if s.policy != FIXED:
        raise DFlashError(f"the reference loop verifies K drafts every step (policy fixed), not {s.policy!r}; "
                          "the adaptive policy runs on the batched runtime (dflash_trt.runtime.batched.runtime)")
    return s


@torch.inference_mode()
def dflash_generate(
    draft: DFlashDraftModel,
    target: "torch.nn.Module | TargetAdapter",
    input_ids: torch.Tensor | list[int],
    params: SamplingParams = GREEDY,
    speculation: SpeculationSettings | None = None,
    on_step: StepCallback | None = None,
) -> GenerationResult:
    """Speculative decoding with a DFlash drafter. Output distribution == the target's.

    `params`: sampling and stopping (max_tokens None: 256); `speculation`: B and K (default K =
    B-1, the fixed policy); `on_step(new_tokens)` after every step, True stops early."""
    target = TargetAdapter(target)
    prompt = _as_ids(input_ids)
    settings = reference_settings(draft, speculation)
    K = settings.max_draft_len
    T, top_p = params.temperature, params.top_p
    sampled_drafts = T > 0 and samples_drafts(settings.draft_method)  # else each slot's argmax
    rejection = T > 0 and rejection_verified(settings.draft_method)  # else the exact match
    budget = params.resolve_max_tokens()
    stop = set(params.stop_token_ids)
    dev = home_device(target.model)
    gen = _generator(params.seed, dev)
    layer_ids = draft.target_layer_ids
    stats = GenerationStats(num_prompt_tokens=len(prompt))
    t0 = time.perf_counter()

    # 1. Prefill: first token from the last prompt logits; context features of every prompt position.
    cache, draft_cache = target.new_cache(), DraftKVCache()
    ids = torch.tensor([prompt], device=dev)
    logits, ctx_new = target.forward(ids, torch.arange(len(prompt), device=dev)[None], cache, layer_ids, logits_to_keep=1)
    pending = int(sample(logits[:, -1], T, top_p, gen))  # not yet in the target KV cache
    out = [pending]
    stats.ttft_s = time.perf_counter() - t0
    done = pending in stop
    if on_step is not None and on_step([pending]):
        done = True

    # 2. Draft -> verify -> accept until a stop token or the budget.
    B = draft.block_size
    while not done and len(out) < budget:
        start = len(prompt) + len(out) - 1  # positions in the target KV cache
        block = torch.full((1, B), draft.mask_token_id, device=dev)  # [1, B]: the full trained block
        block[0, 0] = pending
        c = ctx_new.shape[1]
        draft_pos = torch.arange(start - c, start + B, device=dev)[None]  # ctx then block
        hidden = draft(ctx_new, target.embed(block), draft_pos, draft_cache)  # [1, B, H]
        draft_cache.crop(start)  # keep context K/V only
        block = block[:, : K + 1]  # [1, K+1]: the anchor and the drafts this step verifies
        # slot j predicts position start+j; q [1, K, V] when the drafts were sampled from it
        drafts, q = draft.propose(hidden[:, 1 : K + 1], block[:, 0], target.lm_head, T if sampled_drafts else 0.0,
                                  top_p, gen)
        block[0, 1:] = drafts[0]
        positions = torch.arange(start, start + K + 1, device=dev)[None]  # [1, K+1]
        logits, feats = target.forward(block, positions, cache, layer_ids)  # [1, K+1, V]
        if rejection:
            q = one_hot_q(drafts, logits.shape[-1]) if q is None else q
            accepted, bonus = rejection_sample(drafts, sampling_probs(logits, T, top_p), q, gen)
            a, next_token = int(accepted[0]), int(bonus[0])
        else:
            posterior = sample(logits[0], T, top_p, gen)  # [K+1]: post[j] = the target's token after block[j]
            a = int((block[0, 1:] == posterior[:-1]).int().cumprod(0).sum())  # accepted draft tokens
            next_token = int(posterior[a])
        left = budget - len(out)  # tokens the budget still allows (>= 1)
        new = (block[0, 1 : a + 1].tolist() + [next_token])[:left]
        stats.record_step(drafted=min(K, left - 1), accepted=len(new) - 1)
        new, done = truncate_at_stop(new, stop)
        out.extend(new)
        TargetAdapter.crop(cache, start + a + 1)  # block[0..a] stay; the bonus is the new pending
        ctx_new = feats[:, : a + 1]  # [1, a + 1, n*H]: the committed block positions' features
        pending = out[-1]
        if on_step is not None and on_step(new):
            done = True

    return finish(prompt, out, stop, stats, t0)


@torch.inference_mode()
def autoregressive_generate(
    target: "torch.nn.Module | TargetAdapter",
    input_ids: torch.Tensor | list[int],
    params: SamplingParams = GREEDY,
    on_step: StepCallback | None = None,
) -> GenerationResult:
    """Plain decoding with the same adapter, cache and sampler: the baseline DFlash is compared to."""
    target = TargetAdapter(target)
    prompt = _as_ids(input_ids)
    budget = params.resolve_max_tokens()
    stop = set(params.stop_token_ids)
    dev = home_device(target.model)
    gen = _generator(params.seed, dev)
    stats = GenerationStats(num_prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    cache = target.new_cache()
    ids = torch.tensor([prompt], device=dev)
    positions = torch.arange(len(prompt), device=dev)[None]
    out: list[int] = []
    while True:
        logits, _ = target.forward(ids, positions, cache, logits_to_keep=1)
        token = int(sample(logits[:, -1], params.temperature, params.top_p, gen))
        out.append(token)
        if len(out) == 1:
            stats.ttft_s = time.perf_counter() - t0
        else:
            stats.record_step(drafted=0, accepted=0)
        stopped = on_step is not None and bool(on_step([token]))
        if token in stop or stopped or len(out) >= budget:
            break
        ids = torch.tensor([[token]], device=dev)
        positions = positions[:, -1:] + 1
    return finish(prompt, out, stop, stats, t0)
