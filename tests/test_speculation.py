"""K (max_draft_len) and the policy, defined once (dflash_trt/speculation.py), mean the same on every
path; the drafter drafts its full trained block B at the budget's tail too; repeated target
layer ids are accepted as z-lab's reference accepts them.

The tail rule follows TensorRT-LLM's one-model DFlash (tensorrt_llm/_torch/speculative/dflash.py,
``dflash_draft_slot_ids``: K draft logits taken from a block of block_size slots) and z-lab's
April reference (commit 44947fb: the block was always ``output_ids[:, start : start + block_size]``).
z-lab's dflash 0.1.0 shortens its last blocks to the tokens left (``verify_size``) instead: that
difference by design is tested apart in tests/test_zlab_oracle.py, which compares every other
step with 0.1.0 itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import DFlashError
from dflash_trt.runtime import autoregressive_generate, dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, SequenceRequest, batched_generate
from dflash_trt.runtime.drafters.dflash import build_target_layer_ids, make_draft_config
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime.drafters.validate import validate_pair
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD, SpeculationSettings

try:
    from tests.engine_fixtures import make_tiny_engine, shared_tiny_engine
    from tests.test_batched_runtime import BatchedOracle
except ImportError:  # tests/ is not a package
    from engine_fixtures import make_tiny_engine, shared_tiny_engine
    from test_batched_runtime import BatchedOracle

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 8]]


class FullBlockOracle(BatchedOracle):
    """Perfect only when it sees its whole trained block: any shorter block makes every proposal
    wrong. (A real drafter, trained with bidirectional attention inside full blocks, changes its
    proposals when the block shrinks; this makes the change visible.)"""

    def forward(self, target_hidden, noise_embedding, position_ids, cache=None, attn_mask=None, outputs=None):
        n, s = noise_embedding.shape[:2]
        if s == self.block_size:
            return super().forward(target_hidden, noise_embedding, position_ids, cache, attn_mask, outputs)
        saved = self.row_sequences
        self.row_sequences = [[(t + 1) % self.pinv.shape[1] for t in seq] for seq in saved]  # all wrong
        try:
            return super().forward(target_hidden, noise_embedding, position_ids, cache, attn_mask, outputs)
        finally:
            self.row_sequences = saved


def _oracle_setup(B: int = 4):
    target = tiny_target("qwen3", seed=5, vocab_size=32, hidden_size=64).double()
    truth = [p + autoregressive_generate(target, p, SamplingParams(max_tokens=60)).output_ids for p in PROMPTS]
    draft = FullBlockOracle(make_draft_config(target.config, num_layers=1, block_size=B),
                            target.get_output_embeddings().weight.detach())
    return target, draft, truth


@pytest.mark.parametrize("K", [3, 2])
def test_the_budgets_tail_drafts_the_full_block_reference_loop(K):
    """Every step of a capped request is the uncapped request's step; the last one commits only
    what the budget has left (and counts only those drafts)."""
    B, steps = 4, 4
    target, draft, truth = _oracle_setup(B)
    spec = SpeculationSettings.for_block(B, K)
    for left in range(1, K + 2):  # tokens the last step may commit
        budget = 1 + (K + 1) * steps + left
        draft.row_sequences = [truth[0]]
        capped = dflash_generate(draft, target, PROMPTS[0], SamplingParams(max_tokens=budget), spec)
        uncapped = dflash_generate(draft, target, PROMPTS[0], SamplingParams(max_tokens=budget + 2 * B), spec)
        n = len(capped.stats.acceptance_lengths)
        assert capped.stats.acceptance_lengths[:-1] == uncapped.stats.acceptance_lengths[: n - 1] == [K + 1] * steps
        assert capped.stats.acceptance_lengths[-1] == min(uncapped.stats.acceptance_lengths[n - 1], left) == left
        assert capped.output_ids == truth[0][len(PROMPTS[0]): len(PROMPTS[0]) + budget]
        assert capped.stats.total_draft_tokens == K * steps + (left - 1)
        assert capped.stats.per_position_acceptance == [1.0] * K


def test_the_budgets_tail_drafts_the_full_block_batched_runtime():
    """Rows at different distances from their budget share passes; each row's steps, statistics and
    tokens equal the reference loop's (K = 2 of a block of 4, so steps verify fewer than B-1)."""
    B, K = 4, 2
    target, draft, truth = _oracle_setup(B)
    spec = SpeculationSettings.for_block(B, K)
    budgets = [10, 7, 12]
    ref = []
    for p, t, m in zip(PROMPTS, truth, budgets):
        draft.row_sequences = [t]
        ref.append(dflash_generate(draft, target, p, SamplingParams(max_tokens=m), spec))
    rt = BatchedRuntime(target, draft, RuntimeOptions(max_batch=3, max_seq_len=64), spec).start()
    handles = [rt.add(SequenceRequest(p, SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, budgets)]
    by_handle = {id(h): t for h, t in zip(handles, truth)}
    while rt.has_work():
        draft.row_sequences = [by_handle[id(s)] for s in rt.rows]
        rt.step()
    for h, r in zip(handles, ref):
        assert h.result.output_ids == r.output_ids
        assert h.result.stats.acceptance_lengths == r.stats.acceptance_lengths
        assert h.result.stats.position_drafted == r.stats.position_drafted
        assert h.result.stats.per_position_acceptance == [1.0] * K  # the full block kept the drafter perfect


def test_repeated_target_layer_ids_are_accepted_as_the_reference_accepts_them():
    """z-lab's build_target_layer_ids gives [1, 1] for a 4-layer target and 2 draft layers; the
    drafter's fc then reads layer 1's features twice. Decoding stays lossless, batched == reference,
    step for step: over 16 tokens the random drafter's drafts, which read those features, are
    accepted now and then (over 128, never: equal acceptance lengths would all be 1)."""
    assert build_target_layer_ids(4, 2) == [1, 1]
    target = tiny_target("llama", seed=2, num_layers=4, vocab_size=16).double()
    draft = random_draft(target.config, num_layers=2, block_size=4, seed=2, mask_token_id=15).double()
    assert draft.target_layer_ids == [1, 1] and draft.fc.in_features == 2 * target.config.hidden_size
    assert validate_pair(draft.to_config_dict(), target.config).target_layer_ids == (1, 1)
    ids = torch.tensor([[5, 6, 7, 8]])
    _, feats = TargetAdapter(target).forward(ids, torch.arange(4)[None], TargetAdapter(target).new_cache(), (1, 1))
    H = target.config.hidden_size
    assert torch.equal(feats[..., :H], feats[..., H:])
    params = [SamplingParams(max_tokens=m) for m in (9, 14, 6)]
    ref = [dflash_generate(draft, target, p, sp) for p, sp in zip(PROMPTS, params)]
    for p, sp, r in zip(PROMPTS, params, ref):
        assert r.output_ids == autoregressive_generate(target, p, sp).output_ids
    got = batched_generate(draft, target, PROMPTS, params)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert [g.stats.acceptance_lengths for g in got] == [r.stats.acceptance_lengths for r in ref]
    assert sum(a > 1 for r in ref for a in r.stats.acceptance_lengths) >= 3  # the comparison means something


def test_settings_are_checked_where_they_are_chosen():
    with pytest.raises(DFlashError, match="--policy 'greedy' is not one of adaptive, fixed"):
        SpeculationSettings(8, 7, "greedy")  # type: ignore[arg-type]
    with pytest.raises(DFlashError, match="block_size=1"):
        SpeculationSettings(1, 1)
    draft = random_draft(tiny_target("llama").config, block_size=4)
    with pytest.raises(DFlashError, match="for block_size 8 but the drafter's block is 4"):
        dflash_generate(draft, tiny_target("llama"), [1, 2], SamplingParams(max_tokens=2),
                        SpeculationSettings.for_block(8))
    with pytest.raises(DFlashError, match="adaptive policy runs on the batched runtime"):
        dflash_generate(draft, tiny_target("llama"), [1, 2], SamplingParams(max_tokens=2),
                        SpeculationSettings.for_block(4, policy="adaptive"))


def _deployed_parameters(engine, repo, *flags: str) -> dict[str, str]:
    """`deploy triton ENGINE --out REPO FLAGS`'s config.pbtxt parameters."""
    from dflash_trt.serving.repository import parse_config

    res = CliRunner().invoke(main, ["deploy", "triton", str(engine), "--out", str(repo), *flags])
    assert res.exit_code == 0, res.output
    return {k: v.string_value for k, v in parse_config((repo / "dflash" / "config.pbtxt").read_text())
            .parameters.items()}


def test_an_engine_with_a_smaller_max_draft_len_is_served_with_it(tmp_path):
    """An engine built with K = 3 from a block-8 drafter: `serve` verifies at most 3 drafts a step
    under either policy (it used to verify 7, or pick from [0, 1, 3, 7]), refuses a larger K, and
    the flags mean the same on `generate`, `deploy triton` and `bench`."""
    from dflash_trt.serving.backends import BackendSettings, load_backend
    from dflash_trt.serving.protocol import GenerateRequest

    engine = make_tiny_engine(tmp_path, block_size=8, max_draft_len=3)
    for policy, method in (("adaptive", None), ("fixed", "greedy")):
        backend = load_backend(engine, BackendSettings(backend="pytorch", policy=policy, draft_method=method))
        try:
            assert backend.speculation.max_draft_len == 3 and backend.runtime.max_draft_len == 3
            # the draft method reaches the runtime: the one asked for, else the default
            assert backend.runtime.speculation.draft_method == (method or DEFAULT_DRAFT_METHOD)
            assert f"draft method {method or DEFAULT_DRAFT_METHOD}" in backend.describe()
            gens = [backend.submit(GenerateRequest(p, params=SamplingParams(max_tokens=12)))
                    for p in ("Hello world", "Paris", "abc")]
            finals = [g.text()[1] for g in gens]
            decisions = list(getattr(backend.runtime.policy, "decisions", []))
            if policy == "adaptive":
                assert backend.runtime.policy.candidates == [0, 1, 3] and decisions
                assert max(d.k for d in decisions) <= 3
            for f in finals:  # steps = tokens after the prefill's first, minus the accepted drafts
                steps = f.stats.num_output_tokens - 1 - f.stats.total_accepted_draft_tokens
                assert f.stats.total_draft_tokens <= 3 * steps
                if policy == "fixed":  # K = 3 every step; a step counts min(K, tokens left - 1) drafts, and
                    # only the last three steps can have fewer than 4 tokens left (each commits >= 1)
                    assert f.stats.total_draft_tokens >= 3 * (steps - 3)
        finally:
            backend.shutdown()
    with pytest.raises(DFlashError, match="above the 3 this engine was built for"):
        load_backend(engine, BackendSettings(backend="pytorch", max_draft_len=5))

    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--engine", str(engine), "--json", "--max-new-tokens", "10", "Hello"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["speculation"] == {"block_size": 8, "max_draft_len": 3, "policy": "fixed", "draft_method": DEFAULT_DRAFT_METHOD}
    assert len(out["per_position_acceptance"]) <= 3
    res = runner.invoke(main, ["generate", "--engine", str(engine), "--max-draft-len", "4", "Hello"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "above the 3" in res.output
    params = _deployed_parameters(engine, tmp_path / "repo", "--max-draft-len", "2", "--policy", "fixed",
                                  "--backend", "reference")
    assert (params["max_draft_len"], params["policy"], params["backend"]) == ("2", "fixed", "pytorch")
    res = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "r2"), "--max-draft-len", "7"])
    assert res.exit_code == 2 and "above the 3" in res.output and not (tmp_path / "r2").exists()


def test_generate_adaptive_runs_the_batched_runtime_and_stays_lossless(tiny_pair_dirs):
    tdir, ddir = tiny_pair_dirs
    res = CliRunner().invoke(main, ["generate", "--target", str(tdir), "--draft", str(ddir), "--json", "--policy",
                                    "adaptive", "--max-draft-len", "3", "--max-new-tokens", "12", "--compare", "hi"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["speculation"] == {"block_size": 8, "max_draft_len": 3, "policy": "adaptive",
                                  "draft_method": DEFAULT_DRAFT_METHOD}
    assert out["identical_to_plain"] is True and len(out["per_position_acceptance"]) <= 3


def test_policy_schedule_on_generate_serve_and_deploy(tiny_pair_dirs, tmp_path):
    """--policy schedule with --draft-len-schedule means the same on `generate`, `deploy triton` /
    `serve` (the backend's runtime follows the schedule written into config.pbtxt) and is checked
    against K where it is chosen (TensorRT-LLM's rule: the smallest batch size maps to K)."""
    from dflash_trt.draft_len_schedule import DraftLenSchedule
    from dflash_trt.runtime.batched.policy import SchedulePolicy
    from dflash_trt.serving.backends import BackendSettings, load_backend

    tdir, ddir = tiny_pair_dirs
    runner = CliRunner()
    base = ["generate", "--target", str(tdir), "--draft", str(ddir), "--json", "--max-draft-len", "3",
            "--max-new-tokens", "12"]
    res = runner.invoke(main, [*base, "--policy", "schedule", "--draft-len-schedule", "1:3,4:1", "--compare", "hi"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["speculation"] == {"block_size": 8, "max_draft_len": 3, "policy": "schedule", "draft_method": DEFAULT_DRAFT_METHOD,
                                  "draft_len_schedule": {"1": 3, "4": 1}}
    assert out["identical_to_plain"] is True and out["total_draft_tokens"] > 0  # one row: K = 3 drafts a step
    for args, needle in [(["--policy", "schedule"], "none is given"),
                         (["--policy", "schedule", "--draft-len-schedule", "1:2,4:1"], "must map to max_draft_len=3"),
                         (["--draft-len-schedule", "1-3"], "is not BATCH:DRAFT_LEN")]:
        res = runner.invoke(main, [*base, *args, "hi"])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output

    engine = make_tiny_engine(tmp_path, block_size=8, max_draft_len=3)
    params = _deployed_parameters(engine, tmp_path / "repo", "--backend", "pytorch", "--policy", "schedule",
                                  "--draft-len-schedule", "1:3,2:0")
    assert (params["policy"], params["draft_len_schedule"]) == ("schedule", "1:3,2:0")
    backend = load_backend(engine, BackendSettings(backend="pytorch", policy=params["policy"],
                                                   draft_len_schedule=params["draft_len_schedule"]))
    try:
        policy = backend.runtime.policy
        assert isinstance(policy, SchedulePolicy) and policy.schedule == DraftLenSchedule(((1, 3), (2, 0)))
        assert [policy.choose(b, 3).k for b in (1, 2, 3)] == [3, 0, 0]
    finally:
        backend.shutdown()
    res = runner.invoke(main, ["deploy", "triton", str(engine), "--out", str(tmp_path / "r2"), "--policy", "schedule"])
    assert res.exit_code == 2 and "none is given" in res.output and not (tmp_path / "r2").exists()


def test_an_engines_recorded_schedule_is_what_policy_schedule_follows(tmp_path_factory, tmp_path):
    """The node's manifest records the schedule its build derived (EngineManifest.draft_len_schedule()):
    policy schedule follows it unless --draft-len-schedule replaces it, and a lowered K caps it. The
    tiny engine's real manifest with a derived schedule in it, written and read back as a build's is
    (JSON: the schedule's batch sizes come back as ints)."""
    import json

    from dflash_trt.draft_len_schedule import DraftLenSchedule
    from dflash_trt.engine.manifest import MANIFEST_NAME, SpeculationInfo, load_manifest

    base = load_manifest(shared_tiny_engine(tmp_path_factory))
    assert (base.limits.max_draft_len, base.draft.block_size) == (7, 8)
    info = SpeculationInfo(source="derived", max_draft_len=7, requested_max_draft_len=7,
                           draft_len_schedule={4: 7, 16: 3, 64: 1})
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(base.model_copy(update={"speculation": info}).model_dump()))
    manifest = load_manifest(tmp_path)
    recorded = DraftLenSchedule(((4, 7), (16, 3), (64, 1)))
    assert manifest.draft_len_schedule() == recorded
    assert SpeculationSettings.from_manifest(manifest, policy="schedule").schedule == recorded
    assert SpeculationSettings.from_manifest(manifest, 5, "schedule").schedule.steps == ((4, 5), (16, 3), (64, 1))
    given = SpeculationSettings.from_manifest(manifest, policy="schedule", draft_len_schedule="8:7")
    assert given.schedule.steps == ((8, 7),)
    assert SpeculationSettings.from_manifest(manifest, policy="adaptive").schedule is None  # only schedule reads it
    with pytest.raises(DFlashError, match="none is given"):
        SpeculationSettings.from_manifest(manifest, policy="schedule", draft_len_schedule="off")
    with pytest.raises(DFlashError, match="none is given"):  # an engine whose build recorded none
        SpeculationSettings.from_manifest(base, policy="schedule")
