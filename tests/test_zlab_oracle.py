"""Our reference loop step for step against z-lab's own, dflash 0.1.0 from PyPI (the oracle:
tests/oracles.py; scripts/oracles.txt pins it), for DFlash v1 with and without the newer fields
(input_embedding_scale, output_multiplier, final_logit_softcapping) and for DFlash2.

Each drafter is saved by this project in z-lab's released layout and loaded by z-lab's own
classes from that directory (``DFlash2DraftModel.from_pretrained``, which maps the bare codebooks
onto its nn.Embedding), and by ours; both decode the same prompts with the same float64 target.

- Temperature 0: per-step acceptance lengths and tokens identical, on random pairs and on rigged
  ones (a drafter made to copy its anchor beside a target made to repeat tokens often, so long
  accepted runs happen), Llama and Qwen3 targets, blocks of 8 and 16.
- Temperature 1 (top-p 1 and 0.9) with draft_method "probabilistic": z-lab 0.1.0's sampled path,
  and ours draws the same random numbers in the same order, so with the same seed the tokens and
  steps are identical too (z-lab draws from the global generator, ours from the request's seeded
  one: the same stream).

Where z-lab differs by design, tested apart (test_the_budgets_tail_differs_by_design): near
``max_new_tokens`` z-lab shortens its block to the tokens left (``verify_size``) and so changes the
drafter's input; we draft the full trained block and cap only the commit (speculation.py). The
comparisons above therefore give z-lab a budget one block longer and compare our steps, the last
one (capped) against z-lab's step capped the same way.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.drafters.loading import load_drafter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

try:
    from tests.oracles import zlab
except ImportError:  # tests/ is not a package
    from oracles import zlab

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [7, 7, 1, 8, 2, 8]]
NEW_TOKENS = 40
NEWER_FIELDS = {"input_embedding_scale": 4.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
FLAT_LOGITS = {"output_multiplier": 0.05}


@pytest.fixture(scope="module")
def zm():
    return zlab()


@torch.no_grad()
def rig(target, draft, layer_gain: float = 16.0, copy_gain: float = 1e4) -> None:
    """Make `draft` propose its anchor token in every slot and `target` repeat its current token
    often (not always): the target's head becomes its embedding (x -> E x, so a hidden state near
    E[t] predicts t) and its layers' outputs are scaled up so they overrule that now and then; the
    drafter attends uniformly (q = 0), reads only its anchor (the context is zeroed through fc, the
    mask token's direction is projected out of v) and passes it on (o = identity; MLP off). A
    DFlash2 drafter keeps its convolutions on the attention's output side (random taps near the
    identity) and its selector."""
    E = target.get_input_embeddings().weight
    target.get_output_embeddings().weight.copy_(E * 25.0)
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.mul_(layer_gain)
        layer.mlp.down_proj.weight.mul_(layer_gain)
    m = E[draft.mask_token_id] / E[draft.mask_token_id].norm()
    keep = torch.eye(E.shape[1], dtype=E.dtype) - torch.outer(m, m)  # projects the mask token out
    draft.fc.weight.zero_()
    for layer in draft.layers:
        attn = layer.self_attn
        assert attn.v_proj.weight.shape == keep.shape, "the rig needs num_key_value_heads * head_dim == hidden"
        attn.q_proj.weight.zero_()
        attn.v_proj.weight.copy_(keep * copy_gain)
        attn.o_proj.weight.copy_(torch.eye(E.shape[1], dtype=E.dtype))
        layer.mlp.down_proj.weight.zero_()
        for conv in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)):
            if conv is not None:  # input side: the identity (it would let the mask slots leak into v)
                half = conv.kernel_projection.weight.shape[0] // 2
                conv.base_kernel[0].zero_()
                conv.base_kernel[0, 0] = 1.0
                conv.kernel_projection.weight[:half].zero_()


def make_pair(tmp_path, zm, arch: str, family: str, block_size: int, fields: dict, rigged: bool, seed: int = 3):
    """(target, our drafter, z-lab's drafter): one drafter saved by us, loaded by both."""
    target = tiny_target(arch, seed=1).double()
    draft = random_draft(target.config, block_size=block_size, seed=seed, family=family, num_key_value_heads=4,
                         dflash_fields=fields).double()
    if rigged:
        rig(target, draft)
    draft.save_pretrained(tmp_path)
    ours = load_drafter(tmp_path, dtype=torch.float64)
    cls = zm.DFlash2DraftModel if family == "dflash2" else zm.DFlashDraftModel
    theirs, info = cls.from_pretrained(tmp_path, dtype=torch.float64, output_loading_info=True)
    assert not any(info.values()), info  # every tensor of our layout is one of theirs, and the reverse
    return target, ours, theirs.eval()


def compare(zm, target, ours, theirs, prompt: list[int], params: SamplingParams, method: str = "match",
            ) -> tuple[int, int]:
    """Decode `prompt` both ways; assert identical tokens and per-step acceptance; (steps, identical)."""
    B = ours.block_size
    mine = dflash_generate(ours, target, prompt, params, SpeculationSettings.for_block(B, draft_method=method))
    if params.seed is not None:
        torch.manual_seed(params.seed)
    ref = zm.dflash_generate(theirs, target, torch.tensor([prompt]), NEW_TOKENS + B, None,
                             temperature=params.temperature, top_p=params.top_p, return_stats=True)
    assert mine.output_ids == ref.output_ids[0, len(prompt): len(prompt) + NEW_TOKENS].tolist()
    steps = mine.stats.acceptance_lengths
    theirs_steps = ref.acceptance_lengths[: len(steps)]
    left = NEW_TOKENS - 1 - sum(steps[:-1])  # what our last step could commit (the prefill gave one)
    theirs_steps[-1] = min(theirs_steps[-1], left)
    assert steps == theirs_steps
    return len(steps), sum(a == b for a, b in zip(steps, theirs_steps))


@pytest.mark.parametrize("rigged", [False, True], ids=["random", "rigged"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("family,fields", [("dflash", {}), ("dflash", NEWER_FIELDS), ("dflash2", NEWER_FIELDS)],
                         ids=["v1", "v1-newer-fields", "dflash2"])
def test_greedy_steps_identical_to_zlab(tmp_path, zm, family, fields, arch, block_size, rigged):
    target, ours, theirs = make_pair(tmp_path, zm, arch, family, block_size, fields, rigged)
    steps = [compare(zm, target, ours, theirs, p, SamplingParams(max_tokens=NEW_TOKENS))[0] for p in PROMPTS]
    if rigged:  # the rig does what it is for: long accepted runs, and rejections too
        assert sum(steps) < len(PROMPTS) * NEW_TOKENS / 3


SAMPLED_CASES = [(family, arch, rigged, NEWER_FIELDS) for family in ("dflash", "dflash2") for arch in ("llama", "qwen3")
                 for rigged in (False, True)]
# drafts with flat logits: the nucleus cut of v1's q (and DFlash2's lack of one) changes the draws
SAMPLED_CASES += [(family, "llama", False, FLAT_LOGITS) for family in ("dflash", "dflash2")]


@pytest.mark.parametrize("family,arch,rigged,fields", SAMPLED_CASES,
                         ids=[f"{f}-{a}-{'rigged' if r else 'random'}{'-flat' if x is FLAT_LOGITS else ''}"
                              for f, a, r, x in SAMPLED_CASES])
def test_sampled_steps_identical_to_zlab(tmp_path, zm, family, arch, rigged, fields):
    """draft_method probabilistic is z-lab 0.1.0's sampled path: same seed, same tokens and steps."""
    target, ours, theirs = make_pair(tmp_path, zm, arch, family, 8, fields, rigged)
    if fields is FLAT_LOGITS:  # a flat target too, so that random drafts are accepted now and then
        with torch.no_grad():
            target.get_output_embeddings().weight.mul_(0.04)
    accepted = 0
    for seed, prompt in enumerate(PROMPTS):
        for top_p in (1.0, 0.9):
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=top_p, seed=seed)
            steps, _ = compare(zm, target, ours, theirs, prompt, params, method="probabilistic")
            accepted += NEW_TOKENS - steps
    if rigged or fields is FLAT_LOGITS:
        assert accepted > NEW_TOKENS // 4  # drafts were accepted, so the rejection test's both branches ran


def test_the_budgets_tail_differs_by_design(tmp_path, zm):
    """z-lab's last blocks are shorter (verify_size = the tokens left), so the drafter sees another
    input there; ours drafts the full block and caps the commit. Both are lossless: greedy tokens
    are the target's either way; our last step is our uncapped run's step, capped."""
    target, ours, theirs = make_pair(tmp_path, zm, "qwen3", "dflash", 8, {}, rigged=True)
    prompt, budget = PROMPTS[2], 21
    capped = dflash_generate(ours, target, prompt, SamplingParams(max_tokens=budget))
    uncapped = dflash_generate(ours, target, prompt, SamplingParams(max_tokens=budget + 8))
    ref = zm.dflash_generate(theirs, target, torch.tensor([prompt]), budget, None, return_stats=True)
    assert capped.output_ids == ref.output_ids[0, len(prompt):].tolist() == uncapped.output_ids[:budget]
    n = len(capped.stats.acceptance_lengths)
    assert capped.stats.acceptance_lengths[:-1] == uncapped.stats.acceptance_lengths[: n - 1]
    # z-lab: once fewer than a block's tokens are left, a step verifies only those
    start, verified = len(prompt), []
    for committed in ref.acceptance_lengths:
        verified.append(min(8, len(prompt) + budget - start))
        start += committed
    assert min(verified) < 8
