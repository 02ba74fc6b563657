"""The training objective sees exactly what a block sees at inference.

Many blocks of one sequence are trained in ONE drafter forward with an explicit mask; if that
mask or the position ids differed from the decoding loop's (draft KV cache of the context
strictly before the anchor, block bidirectional), the drafter would learn one task and be asked
another. These tests compare the two paths numerically on a tiny random pair.
"""

from __future__ import annotations

import torch

from dflash_trt.runtime.drafters.dflash import DraftKVCache
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.train.objective import attention_mask, block_inputs, default_gamma, dflash_loss, sample_anchors


def _setup(block_size: int = 8):
    target = tiny_target("llama", seed=1, num_layers=4).double()
    draft = random_draft(target.config, num_layers=2, block_size=block_size, seed=2,
                         target_layer_ids=[0, 2, 3]).double()
    adapter = TargetAdapter(target)
    T = 40
    ids = torch.randint(0, target.config.vocab_size - 1, (T,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, feats = adapter.forward(ids[None], torch.arange(T)[None], adapter.new_cache(), draft.target_layer_ids)
    return target, draft, adapter, ids, feats[0]


@torch.no_grad()
def test_many_blocks_in_one_forward_equal_the_inference_path():
    target, draft, adapter, ids, feats = _setup()
    B, T = draft.block_size, ids.shape[0]
    anchors = torch.tensor([5, 6, 17, 30, 38])  # overlapping blocks and one running past the end
    tokens, pos, _, _ = block_inputs(ids, anchors, B, draft.mask_token_id)
    position_ids = torch.cat([torch.arange(T), pos.reshape(-1)])[None]
    batched = draft(feats[None], adapter.embed(tokens.reshape(1, -1)), position_ids, None,
                    attention_mask(T, anchors, B))[0].view(len(anchors), B, -1)
    for i, a in enumerate(anchors.tolist()):
        # the decoding loop: context K/V of positions < a go through the draft cache, then the block
        block = torch.full((1, B), draft.mask_token_id)
        block[0, 0] = ids[a]
        single = draft(feats[None, :a], adapter.embed(block), torch.arange(0, a + B)[None], DraftKVCache())[0]
        torch.testing.assert_close(batched[i], single, rtol=1e-9, atol=1e-9)


def test_mask_labels_and_anchor_range():
    ids = torch.arange(100, 120)  # T = 20
    anchors = torch.tensor([4, 15])
    tokens, pos, labels, valid = block_inputs(ids, anchors, 8, mask_token_id=7)
    assert tokens[:, 0].tolist() == [104, 115] and (tokens[:, 1:] == 7).all()
    assert labels[0, 1:].tolist() == list(range(105, 112))  # slot k predicts the token AT anchor+k
    assert valid[1].tolist() == [False, True, True, True, True, False, False, False]  # past the end
    m = attention_mask(20, anchors, 8)[0, 0]
    assert m.shape == (16, 20 + 16)
    assert m[0, :4].all() and not m[0, 4:20].any()  # context strictly before anchor 4
    assert m[8, :15].all() and not m[8, 15:20].any()
    assert m[0, 20:28].all() and not m[0, 28:].any()  # own block only
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors(prompt_len=6, seq_len=20, num_anchors=50, generator=g)
        assert len(a) == 13 and int(a.min()) == 6 and int(a.max()) == 18 and len(set(a.tolist())) == 13


def test_loss_is_weighted_ce_and_trains():
    target, draft, adapter, ids, feats = _setup()
    draft.float()
    target.float()
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(10, ids.shape[0], 8, gen)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, stats = dflash_loss(draft, emb, head, ids, feats.float(), anchors, default_gamma(8))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # memorises one sequence's blocks
    assert 1.0 <= stats["tau_est"] <= 8.0
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0


@torch.no_grad()
def test_sampled_vocab_loss_is_the_ce_over_the_scored_rows():
    """A label map over the whole vocabulary changes nothing; over a subset it is the CE of that
    subset's logits (labels translated into it), and labels outside the subset are dropped."""
    target, draft, adapter, ids, feats = _setup()
    target, draft, feats = target.float(), draft.float(), feats.float()  # dflash_loss runs in float32
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    anchors = torch.tensor([12, 20, 31])
    V = target.config.vocab_size
    full, _ = dflash_loss(draft, emb, head, ids, feats, anchors, 4.0)
    same, _ = dflash_loss(draft, emb, head, ids, feats, anchors, 4.0, torch.arange(V))
    torch.testing.assert_close(full, same)

    rows = torch.unique(torch.cat([ids, torch.tensor([0, 1])]))  # every label present, plus two others
    label_map = torch.full((V,), -1, dtype=torch.long)
    label_map[rows] = torch.arange(rows.numel())
    sub = lambda h: head(h)[:, rows]  # noqa: E731 - the scored rows only
    got, _ = dflash_loss(draft, emb, sub, ids, feats, anchors, 4.0, label_map)
    # by hand: slot k of block i predicts ids[a_i + k], weight exp(-(k-1)/gamma)
    B, T = draft.block_size, ids.shape[0]
    tokens, pos, labels, valid = block_inputs(ids, anchors, B, draft.mask_token_id)
    position_ids = torch.cat([torch.arange(T), pos.reshape(-1)])[None]
    hidden = draft(feats[None], emb(tokens.reshape(1, -1)), position_ids, None, attention_mask(T, anchors, B))[0]
    num = den = 0.0
    for j in valid.reshape(-1).nonzero()[:, 0].tolist():
        k = j % B
        w = float(torch.exp(torch.tensor(-(k - 1) / 4.0)))
        logp = torch.log_softmax(head(hidden[j])[rows], -1)
        num += w * -float(logp[label_map[labels.reshape(-1)[j]]])
        den += w
    assert abs(float(got) - num / den) < 1e-5

    drop = label_map.clone()
    drop[ids[anchors[0] + 1]] = -1  # one label's row not scored: that label leaves the loss
    dropped, stats = dflash_loss(draft, emb, sub, ids, feats, anchors, 4.0, drop)
    assert float(dropped) != float(got) and 1.0 <= stats["tau_est"] <= B
