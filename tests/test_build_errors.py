"""`dflash-trt build` / `plan` refuse bad requests before any heavy work: exit != 0, ONE line.

Each case runs the real CLI (click's runner, the same entry point as the console script) on
known architectures or small on-disk configs, so no weights are loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main


def run_cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code != 0, result.output
    err = result.stderr.strip()
    assert "Traceback" not in result.output + result.stderr
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_unknown_yaml_key_is_refused(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("gpu: h100\ntpp: 2\n")
    r = run_cli("plan", "--spec", str(spec), "--target", "qwen3-8b")
    assert_one_line_error(r, "unknown key 'tpp'", "tp")


def test_misplaced_nested_key_is_refused(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("gate:\n  max_tau_drop: 0.1\n  num_samples: 3\n")  # num_samples belongs to calibration
    r = run_cli("plan", "--spec", str(spec), "--target", "qwen3-8b")
    assert_one_line_error(r, "gate.num_samples", "max_tau_drop")


def test_bad_yaml_syntax_is_one_line(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("gpu: [h100\n")
    assert_one_line_error(run_cli("plan", "--spec", str(spec), "--target", "qwen3-8b"), "not valid YAML")


def test_tp_that_splits_heads_is_refused():
    # SmolLM2-135M: 9 heads; TP 2 would cut a head in half.
    r = run_cli("plan", "--target", "smollm2-135m", "--tp", "2", "--gpu", "h100")
    assert_one_line_error(r, "--tp 2", "9 heads", "[1, 3, 9]")


def test_kv_heads_that_cannot_be_sharded_are_refused(tmp_path: Path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
           "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 8, "vocab_size": 1000,
           "intermediate_size": 1536, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_cli("plan", "--target", str(tmp_path), "--tp", "12", "--gpu", "h100", "--gpus-per-node", "16")
    assert_one_line_error(r, "8 KV heads")


def test_kv_head_replication_rule_is_accepted():
    # SmolLM2: 3 KV heads at TP 9 -> tp % kv == 0: replicated, one KV head per rank.
    r = run_cli("plan", "--target", "smollm2-135m", "--tp", "9", "--gpu", "h100", "--gpus-per-node", "16", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["plan"]["kv_heads_per_rank"] == 1


def test_nvfp4_on_hopper_suggests_fp8():
    r = run_cli("plan", "--target", "qwen3-8b", "--quant", "nvfp4", "--gpu", "h100")
    assert_one_line_error(r, "nvfp4", "h100", "--quant fp8")


def test_world_size_beyond_available_gpus_is_refused():
    r = run_cli("plan", "--target", "gpt-oss-120b", "--tp", "8", "--pp", "2", "--ep", "8", "--gpu", "b300")
    assert_one_line_error(r, "16", "exceeds the 8 GPUs")


def test_ep_must_divide_tp_and_needs_moe():
    assert_one_line_error(run_cli("plan", "--target", "gpt-oss-120b", "--tp", "8", "--ep", "3", "--gpu", "b300"),
                          "--ep 3 must divide --tp 8")
    assert_one_line_error(run_cli("plan", "--target", "qwen3-8b", "--tp", "2", "--ep", "2", "--gpu", "h100"),
                          "dense")


def test_max_num_tokens_must_hold_a_decode_step():
    r = run_cli("plan", "--target", "qwen3-8b", "--gpu", "h100", "--max-batch-size", "64", "--max-draft-len", "15",
                "--max-num-tokens", "512")
    assert_one_line_error(r, "64 * 16 = 1024")


def test_missing_checkpoint_is_refused(tmp_path: Path):
    r = run_cli("build", "--target", str(tmp_path / "nope"), "--draft", str(tmp_path / "nope-draft"))
    assert_one_line_error(r, "nope", "neither a checkpoint directory nor a known architecture")


def test_checkpoint_without_weights_is_refused(tmp_path: Path, tiny_pair_dirs):
    _, draft = tiny_pair_dirs
    (tmp_path / "config.json").write_text((tiny_pair_dirs[0] / "config.json").read_text())
    r = run_cli("build", "--target", str(tmp_path), "--draft", str(draft), "--max-seq-len", "256")
    assert_one_line_error(r, "no *.safetensors")


def test_build_of_a_known_architecture_needs_a_checkpoint(tiny_pair_dirs):
    r = run_cli("build", "--target", "qwen3-8b", "--draft", str(tiny_pair_dirs[1]), "--gpu", "h100")
    assert_one_line_error(r, "known architecture", "dflash-trt plan")


def test_draft_len_must_fit_the_block(tiny_pair_dirs):
    target, draft = tiny_pair_dirs  # block_size 8
    r = run_cli("build", "--target", str(target), "--draft", str(draft), "--max-seq-len", "256",
                "--max-draft-len", "8", "--dry-run")
    assert_one_line_error(r, "max_draft_len=8", "block_size-1=7")


def test_dry_run_validates_and_writes_nothing(tmp_path: Path, tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    out = tmp_path / "engine"
    r = run_cli("build", "--target", str(target), "--draft", str(draft), "--max-seq-len", "256", "--dry-run",
                "--out", str(out), "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["dry_run"] is True
    assert "resolved build spec" in r.stderr and "Memory plan" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (Path(__file__).parents[1] / "build").glob("*.yaml")))
def test_shipped_recipes_are_valid_specs(recipe: str):
    from dflash_trt.engine.spec import resolve_spec

    spec = resolve_spec(Path(__file__).parents[1] / "build" / f"{recipe}.yaml")
    assert spec.name and spec.gpu in ("b300", "b200", "h200", "h100", "cpu")


def test_flags_override_the_yaml(tmp_path: Path):
    from dflash_trt.engine.spec import resolve_spec

    f = tmp_path / "s.yaml"
    f.write_text("tp: 4\nquant: fp8\ngate:\n  max_tau_drop: 0.2\n")
    s = resolve_spec(f, {"tp": 2, "gate.max_tau_drop": None, "calibration.num_samples": 3})
    assert (s.tp, s.quant, s.gate.max_tau_drop, s.calibration.num_samples) == (2, "fp8", 0.2, 3)


def test_calibration_prompts_from_files_lists_and_the_project_sets(tmp_path: Path):
    from dflash_trt.engine.calibration import load_calibration_prompts
    from dflash_trt.errors import DFlashError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"text": "b"}\n\n"c"\n{"turns": ["d", "e"]}\n')
    assert load_calibration_prompts(str(f), 10) == ["a", "b", "c", "d"]
    assert load_calibration_prompts(str(f), 2) == ["a", "b"]
    t = tmp_path / "p.txt"
    t.write_text("one\n\ntwo\n")
    assert load_calibration_prompts(str(t), 10) == ["one", "two"]
    assert load_calibration_prompts(["x", " ", "y"], 10) == ["x", "y"]
    default = load_calibration_prompts(None, 5)
    assert len(default) == 5 and all(isinstance(p, str) and p for p in default)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DFlashError, match="invalid JSON .* line 1"):
        load_calibration_prompts(str(bad), 10)
    with pytest.raises(DFlashError, match="no calibration prompts"):
        load_calibration_prompts([" "], 10)
