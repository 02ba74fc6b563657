"""`train-draft` makes DFlash2 drafters (dflash_trt/train/, runtime/drafters/dflash2.py): the selector's
objective is its definition (speculators 0.9.0's teacher-forced K-way cross-entropy), a DFlash2
drafter made from a DFlash one starts exactly where that one is, bad recipes are refused in one
line, and a tiny run lowers both losses and writes z-lab's released layout, which our loader and
z-lab's dflash 0.1.0 (the oracle: tests/oracles.py) both read, with identical greedy steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.drafters.dflash2 import CandidateSelector, DFlash2DraftModel, DFlash2Recipe
from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import TINY_DFLASH2_RECIPE, random_draft, tiny_target
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.train.config import TrainConfig
from dflash_trt.train.drafter import drafter_config, new_drafter, training_family
from dflash_trt.train.objective import dflash_loss, selector_loss

RECIPE_FLAGS = ["--conv-group-size", "8", "--selector-rank", "8", "--selector-top-k", "4"]


def selector_loss_by_definition(selector, hidden, logits, target, prev, column_ids):
    """Row by row: the top-K columns (strongest first), the label put at rank K when missing,
    s_c = U_c + <A[prev] * g, Bc[token(c)]>, the CE of the label's place; the walk's hit."""
    K, ces, hits = selector.top_k, [], []
    for n in range(logits.shape[0]):
        cand = logits[n].topk(K).indices.tolist()
        present = int(target[n]) in cand
        if not present:
            cand[-1] = int(target[n])
        place = cand.index(int(target[n]))
        tokens = [int(column_ids[c]) if column_ids is not None else c for c in cand]
        g = selector.hidden_projection(hidden[n])
        scores = torch.stack([logits[n, c] + (selector.predecessor_codebook[int(prev[n])] * g
                                              * selector.successor_codebook[t]).sum() for c, t in zip(cand, tokens)])
        ces.append(-torch.log_softmax(scores, 0)[place])
        hits.append(present and int(scores.argmax()) == place)
    return torch.stack(ces), torch.tensor(hits)


@torch.no_grad()
@pytest.mark.parametrize("sampled", [False, True], ids=["full-vocab", "sampled-columns"])
def test_the_selector_loss_is_its_definition(sampled):
    torch.manual_seed(0)
    V, H, N = 40, 16, 24
    recipe = DFlash2Recipe(conv_kernel_size=2, conv_group_size=4, selector_rank=6, selector_top_k=5)
    selector = CandidateSelector(V, H, recipe)  # float32, as it trains
    for p in selector.parameters():
        p.normal_(0, 0.7)
    columns = torch.randperm(V)[:30] if sampled else None  # a sampled head scores 30 of the 40 tokens
    logits = torch.randn(N, 30 if sampled else V) * 3
    target = torch.randint(0, logits.shape[1], (N,))
    target[:8] = logits[:8].argmax(-1)  # some labels are the unary argmax, the rest mostly are not
    prev = torch.randint(0, V, (N,))
    hidden = torch.randn(N, H)
    ce, hit = selector_loss(selector, hidden, logits, target, prev, columns)
    want_ce, want_hit = selector_loss_by_definition(selector, hidden, logits, target, prev, columns)
    torch.testing.assert_close(ce, want_ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(hit, want_hit)
    absent = ~(logits.topk(5).indices == target[:, None]).any(-1)
    assert absent.any() and (~absent).any() and hit.any() and not hit.all()  # every branch was taken


def _tiny(block_size: int = 8):
    target = tiny_target("llama", seed=1, num_layers=4)
    v1 = random_draft(target.config, num_layers=2, block_size=block_size, seed=2, target_layer_ids=[0, 2, 3])
    return target, v1


def _dflash2_from(v1_dir: Path, target, **overrides) -> DFlash2DraftModel:
    v1 = json.loads((v1_dir / "config.json").read_text())
    cfg = TrainConfig(target="unused", out="unused", family="dflash2", init_from=str(v1_dir), block_size=8,
                      num_layers=v1["num_hidden_layers"], intermediate_size=v1["intermediate_size"],
                      **{k: v for k, v in TINY_DFLASH2_RECIPE.items() if k != "conv_kernel_size"}, **overrides)
    ids = v1["dflash_config"]["target_layer_ids"]
    return new_drafter(cfg, drafter_config(cfg, target.config, ids, v1["dflash_config"]["mask_token_id"]), "cpu")


def test_a_dflash2_drafter_made_from_a_dflash_one_starts_where_it_is(tmp_path):
    """Its hidden states are the v1 drafter's bit for bit (convolutions the identity), its walk
    proposes the plain argmax (transition scores 0), its block loss is v1's, its tau_est the
    same, and its loss is v1's plus the selector's; one step later the selector has learned."""
    target, v1 = _tiny()
    v1.save_pretrained(tmp_path / "v1", dtype=torch.float32)
    v2 = _dflash2_from(tmp_path / "v1", target).eval()
    assert type(v2) is DFlash2DraftModel and v2.recipe.selector_top_k == 4
    with torch.no_grad():  # whatever the codebooks, a zero projection leaves the walk the plain argmax
        v2.candidate_selector.predecessor_codebook.mul_(1e3)
        v2.candidate_selector.successor_codebook.mul_(1e3)
    T = 40
    ids = torch.randint(0, target.config.vocab_size - 1, (T,), generator=torch.Generator().manual_seed(3))
    adapter = TargetAdapter(target)
    with torch.no_grad():
        _, feats = adapter.forward(ids[None], torch.arange(T)[None], adapter.new_cache(), v1.target_layer_ids)
        noise = torch.randn(2, 8, target.config.hidden_size)
        ctx, pos = feats[0, :12].expand(2, -1, -1), torch.arange(20)[None].expand(2, -1)
        h1, h2 = v1(ctx, noise, pos), v2(ctx, noise, pos)
        assert torch.equal(h1, h2)
        head = target.get_output_embeddings()
        anchor = torch.tensor([5, 9])
        assert torch.equal(v2.propose(h2[:, 1:], anchor, head)[0], v1.propose(h1[:, 1:], anchor, head)[0])
    emb, anchors = target.get_input_embeddings(), torch.tensor([4, 11, 20, 30])
    loss1, stats1 = dflash_loss(v1, emb, head, ids, feats[0], anchors, 4.0)
    loss2, stats2 = dflash_loss(v2, emb, head, ids, feats[0], anchors, 4.0)
    assert stats2["tau_est"] == stats1["tau_est"] and stats2["acc1"] == stats1["acc1"]
    torch.testing.assert_close(loss2, loss1 + stats2["selector_loss"])
    loss2.backward()
    torch.optim.AdamW(v2.parameters(), lr=1e-3).step()
    assert v2.candidate_selector.hidden_projection.weight.abs().sum() > 0  # the walk now learns


def test_the_objectives_walk_is_the_runtime_walk():
    """tau_est of a DFlash2 drafter's loss (teacher-forced: each slot's predecessor is the true
    previous token) is what the runtime's walk (DFlash2DraftModel.propose, one block at a time
    through the draft KV cache) accepts on the same blocks: the objective trains the walk that runs."""
    from dflash_trt.runtime.drafters.dflash import DraftKVCache

    target, _ = _tiny()
    draft = random_draft(target.config, family="dflash2", num_layers=2, seed=2, target_layer_ids=[0, 2, 3])
    T, B = 40, draft.block_size
    ids = torch.randint(0, target.config.vocab_size - 1, (T,), generator=torch.Generator().manual_seed(3))
    adapter = TargetAdapter(target)
    with torch.no_grad():
        _, feats = adapter.forward(ids[None], torch.arange(T)[None], adapter.new_cache(), draft.target_layer_ids)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    anchors = torch.tensor([10, 14, 19, 23, 27, 32])  # whole blocks: every slot has a label
    draft.train()
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(60):  # half-memorised: long runs, and misses
        loss, _ = dflash_loss(draft, emb, head, ids, feats[0], anchors, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    with torch.no_grad():
        sel = draft.candidate_selector
        sel.predecessor_codebook.mul_(30)  # a selector that often overrules the unary argmax
        _, stats = dflash_loss(draft, emb, head, ids, feats[0], anchors, 4.0)
        accepted, overruled = [], 0
        for a in anchors.tolist():
            block = torch.full((1, B), draft.mask_token_id)
            block[0, 0] = ids[a]
            h = draft(feats[:, :a], emb(block), torch.arange(a + B)[None], DraftKVCache())[:, 1:]  # [1, B-1, H]
            path = draft.propose(h, ids[a:a + 1], head)[0][0]
            hits = (path == ids[a + 1:a + B]).long()
            accepted.append(int(hits.cumprod(0).sum()))
            overruled += int((path != draft.compute_logits(h, head).argmax(-1)[0]).sum())
    assert overruled > 0 and sum(accepted) > len(anchors)  # the walk mattered, and was accepted
    assert stats["tau_est"] == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-6)


def test_a_sampled_head_scores_the_selector_by_token_id():
    """A sampled head (train/step.FrozenHead) whose rows are the whole vocabulary, shuffled, gives
    the full head's loss, the selector's included: its codebooks are read at each candidate's
    token id (FrozenHead.ids), not at its column."""
    from dflash_trt.train.step import FrozenHead

    target, _ = _tiny()
    draft = random_draft(target.config, family="dflash2", num_layers=2, seed=2, target_layer_ids=[0, 2, 3])
    with torch.no_grad():  # a selector that matters
        draft.candidate_selector.predecessor_codebook.mul_(300)
    T, V = 40, target.config.vocab_size
    ids = torch.randint(0, V - 1, (T,), generator=torch.Generator().manual_seed(3))
    adapter = TargetAdapter(target)
    with torch.no_grad():
        _, feats = adapter.forward(ids[None], torch.arange(T)[None], adapter.new_cache(), draft.target_layer_ids)
    emb, anchors = target.get_input_embeddings(), torch.tensor([4, 11, 20, 30])
    full, sampled = FrozenHead(target, None, "cpu"), FrozenHead(target, 0, "cpu")
    sampled.draw(torch.randperm(V, generator=torch.Generator().manual_seed(5)), torch.Generator())
    assert not torch.equal(sampled.ids, torch.arange(V))
    loss_f, stats_f = dflash_loss(draft, emb, full, ids, feats[0], anchors, 4.0)
    loss_s, stats_s = dflash_loss(draft, emb, sampled, ids, feats[0], anchors, 4.0, sampled.label_map, sampled.ids)
    torch.testing.assert_close(loss_s, loss_f, rtol=1e-4, atol=1e-4)
    assert stats_s["selector_loss"] == pytest.approx(stats_f["selector_loss"], rel=1e-4)


def test_the_family_comes_from_the_flags_or_the_init_drafter_and_bad_recipes_get_one_line(tmp_path):
    target, v1 = _tiny()
    v1.save_pretrained(tmp_path / "v1")
    d2 = random_draft(target.config, family="dflash2", num_layers=2, seed=2, target_layer_ids=[0, 2, 3],
                      dflash2_recipe={**TINY_DFLASH2_RECIPE, "selector_rank": 12})
    d2.save_pretrained(tmp_path / "d2")
    base = {"target": "t", "out": "o"}
    assert training_family(TrainConfig(**base)) == ("dflash", None)
    assert training_family(TrainConfig(**base, init_from=str(tmp_path / "v1"))) == ("dflash", None)
    assert training_family(TrainConfig(**base, family="dflash2")) == (
        "dflash2", {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16})
    # from a DFlash2 drafter: its family and recipe, a flag overriding one field
    assert training_family(TrainConfig(**base, init_from=str(tmp_path / "d2"), selector_top_k=3)) == (
        "dflash2", {**TINY_DFLASH2_RECIPE, "selector_rank": 12, "selector_top_k": 3})
    refusals = [
        (dict(init_from=str(tmp_path / "d2"), family="dflash"), "is a DFlash2 drafter and --family dflash drops"),
        (dict(selector_rank=8), "--selector-rank is a DFlash2 setting but this run trains a DFlash \\(v1\\)"),
        (dict(family="dflash2", conv_group_size=7), "conv_group_size 7 does not divide the target's hidden_size 64"),
        (dict(family="dflash2", conv_group_size=8, conv_kernel_size=9), "conv_kernel_size 9 is longer than the block"),
        (dict(family="dflash2", conv_group_size=8, selector_top_k=500), "selector_top_k 500 exceeds the vocabulary"),
    ]
    for fields, message in refusals:
        cfg = TrainConfig(**base, block_size=8, **fields)
        with pytest.raises(DFlashError, match=message) as err:
            drafter_config(cfg, target.config, [0, 2, 3])
        assert "\n" not in str(err.value)


# -- a training run, end to end (integration tier: data generation and two runs) --------------------------------


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_train_draft_makes_a_dflash2_drafter_that_zlab_runs_step_for_step(tiny_pair_dirs, tmp_path):
    from click.testing import CliRunner
    from safetensors import safe_open

    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.cli import main
    from dflash_trt.runtime.drafters.loading import load_drafter

    try:
        from tests.oracles import zlab
        from tests.test_zlab_oracle import PROMPTS, compare
    except ImportError:  # tests/ is not a package
        from oracles import zlab
        from test_zlab_oracle import PROMPTS, compare

    target_dir, v1_dir = tiny_pair_dirs
    v1_cfg = json.loads((v1_dir / "config.json").read_text())
    v1 = v1_cfg["dflash_config"]
    common = ["--target", str(target_dir), "--data-dir", str(tmp_path / "data"), "--max-prompts", "6",
              "--max-new-tokens", "40", "--block-size", "8", "--lr", "3e-3", "--no-progress",
              "--intermediate-size", str(v1_cfg["intermediate_size"]),
              "--mask-token-id", str(v1["mask_token_id"]),
              "--target-layer-ids", ",".join(map(str, v1["target_layer_ids"]))]
    out = tmp_path / "d2"
    res = CliRunner().invoke(main, ["train-draft", *common, "--out", str(out), "--init-from", str(v1_dir),
                                    "--family", "dflash2", *RECIPE_FLAGS, "--steps", "80", "--seed", "1"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "MANIFEST.json").read_text())
    first, last = manifest["history"][0], manifest["history"][-1]
    assert manifest["family"] == "dflash2" and manifest["steps"] == 80
    assert last["loss"] < 0.7 * first["loss"] and last["selector_loss"] < 0.7 * first["selector_loss"]

    # z-lab's released layout: every recipe key and block_size inside dflash_config, codebooks bare
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"] == {**v1, "block_size": 8, "conv_kernel_size": 2, **TINY_DFLASH2_RECIPE}
    assert not {"block_size", *TINY_DFLASH2_RECIPE} & set(cfg)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    assert not (out / "draft_vocab.json").exists()  # loaders refuse one beside a DFlash2 drafter

    # read back by our loader and by z-lab 0.1.0's own class; both decode the same steps, losslessly
    zm = zlab()
    target = load_checkpoint(target_dir, torch.float64).eval()
    ours = load_drafter(out, torch.float64)
    theirs, info = zm.DFlash2DraftModel.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
    assert type(ours) is DFlash2DraftModel and not any(info.values()), info
    params = SamplingParams(max_tokens=40)
    steps = [compare(zm, target, ours, theirs.eval(), p, params)[0] for p in PROMPTS]
    assert sum(steps) < len(PROMPTS) * 40  # drafts were accepted: the trained walk was exercised
    for p in PROMPTS:
        assert dflash_generate(ours, target, p, params).output_ids == autoregressive_generate(target, p, params).output_ids

    # --init-from a DFlash2 drafter: the run is DFlash2 (no --family), with that drafter's recipe
    res = CliRunner().invoke(main, ["train-draft", *common, "--out", str(tmp_path / "d3"), "--init-from", str(out),
                                    "--steps", "3"])
    assert res.exit_code == 0, res.output
    again = json.loads((tmp_path / "d3" / "MANIFEST.json").read_text())
    assert again["family"] == "dflash2"
    assert json.loads((tmp_path / "d3" / "config.json").read_text())["dflash_config"] == cfg["dflash_config"]
