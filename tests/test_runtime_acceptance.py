"""The acceptance path really accepts: a drafter rigged to propose exactly the target's greedy
tokens reaches tau == block_size on every step and rolls back nothing."""

from __future__ import annotations

import torch

from dflash_trt.runtime import DFlashDraftModel, autoregressive_generate, dflash_generate
from dflash_trt.runtime.drafters.dflash import make_draft_config
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.sampling_params import SamplingParams


class OracleDraft(DFlashDraftModel):
    """Proposes `sequence[p]` for every block position p: hidden = pinv(W_lm) @ (big * onehot).

    Needs vocab <= hidden so that the lm_head rows are linearly independent and the logits
    can be set exactly. Test-only: it ignores the context, so it drafts perfectly only when
    `sequence` is what the target will produce."""

    def __init__(self, config, lm_head_weight: torch.Tensor, sequence: list[int]):
        super().__init__(config)
        self.sequence = sequence
        self.pinv = torch.linalg.pinv(lm_head_weight.double())  # [H, V]

    def forward(self, target_hidden, noise_embedding, position_ids, cache=None, attn_mask=None):
        s = noise_embedding.shape[1]
        positions = position_ids[0, -s:].tolist()
        onehot = torch.zeros(s, self.pinv.shape[1], dtype=torch.float64)
        for j, p in enumerate(positions):
            onehot[j, self.sequence[p] if p < len(self.sequence) else 0] = 100.0
        return (onehot @ self.pinv.T)[None].to(noise_embedding.dtype)  # [1, S, H]


def make_oracle(target, prompt, n, block_size, sequence=None):
    if sequence is None:
        sequence = prompt + autoregressive_generate(target, prompt, SamplingParams(max_tokens=n + block_size)).output_ids
    cfg = make_draft_config(target.config, num_layers=1, block_size=block_size)
    return OracleDraft(cfg, target.get_output_embeddings().weight.detach(), sequence)


def test_oracle_drafter_reaches_tau_equal_block_size_every_step():
    target = tiny_target("qwen3", seed=5, vocab_size=32, hidden_size=64).double()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    B, steps = 4, 6
    n = 1 + B * steps  # first token from prefill, then `steps` full blocks
    draft = make_oracle(target, prompt, n, B)
    result = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=n))
    assert result.stats.acceptance_lengths == [B] * steps
    assert result.stats.tau == B
    assert result.stats.total_accepted_draft_tokens == result.stats.total_draft_tokens == (B - 1) * steps
    assert result.stats.per_position_acceptance == [1.0] * (B - 1)
    assert result.output_ids == autoregressive_generate(target, prompt, SamplingParams(max_tokens=n)).output_ids


def test_wrong_oracle_rejects_and_stays_lossless():
    """A drafter that is perfect except at one position must be rejected there and recover."""
    target = tiny_target("llama", seed=6, vocab_size=32, hidden_size=64).double()
    prompt = [7, 7, 2]
    n = 25
    truth = prompt + autoregressive_generate(target, prompt, SamplingParams(max_tokens=n + 8)).output_ids
    wrong = list(truth)
    p = len(prompt) + 6
    wrong[p] = (wrong[p] + 1) % 32
    draft = make_oracle(target, prompt, n, 8, sequence=wrong)
    result = dflash_generate(draft, target, prompt, SamplingParams(max_tokens=n))
    assert result.output_ids == truth[len(prompt): len(prompt) + n]
    assert min(result.stats.acceptance_lengths) < 8  # the corrupted position was rejected
    assert result.stats.tau > 3  # and everything else accepted
