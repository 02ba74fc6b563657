"""The one config loader (dflash_trt/config.py): file + flags -> strict pydantic -> one line.

Every configuration goes through it: the build spec, the bench config, the train config, the
engine manifest, the repository settings and the Slurm options; each is exercised here through
its own entry point, with real files on disk and the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from click.testing import CliRunner
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash_trt.cli import main
from dflash_trt.config import config_line, config_record, load_config
from dflash_trt.errors import DFlashError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    depth: int = Field(2, ge=1, le=8)
    name: str = "s"


class Demo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(4, ge=1)
    mode: Literal["fast", "slow"] = "fast"
    prompts: str | list[str] | None = None
    levels: list[int] = Field(default_factory=lambda: [1])
    section: Section = Field(default_factory=Section)
    max_new_tokens: int = 8

    @model_validator(mode="after")
    def _fast_is_small(self) -> Demo:
        if self.mode == "fast" and self.size > 100:
            raise ValueError("--mode fast runs at most size 100; lower --size or use --mode slow")
        return self


def _error(**kw) -> str:
    with pytest.raises(DFlashError) as e:
        load_config(Demo, what="demo config", **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_then_values_then_file_then_flags(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("size: 5\nmax-new-tokens: 9\nsection:\n  depth: 3\n  name: file\n")
    cfg = load_config(Demo, f, {"size": 7, "mode": None, "section.name": "flag"}, what="demo config",
                      values={"mode": "slow", "size": 1, "levels": [2, 3]})
    assert (cfg.size, cfg.mode, cfg.levels, cfg.max_new_tokens) == (7, "slow", [2, 3], 9)
    assert (cfg.section.depth, cfg.section.name) == (3, "flag")  # a dotted flag reaches the section
    assert load_config(Demo, what="demo config") == Demo()


def test_json_and_empty_files(tmp_path: Path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"size": 3, "section": {"depth": 4}}))
    assert load_config(Demo, j, what="demo config").section.depth == 4
    empty = tmp_path / "e.yaml"
    empty.write_text("")
    assert load_config(Demo, empty, what="demo config") == Demo()


@pytest.mark.parametrize("text, suffix, needle", [
    ("size: [1\n", ".yaml", "is not valid YAML"),
    ('{"size": 1', ".json", "is not valid JSON"),
    ("- 1\n- 2\n", ".yaml", "must hold a mapping of key: value, not a list"),
])
def test_unreadable_files_are_one_line(tmp_path: Path, text: str, suffix: str, needle: str):
    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    msg = _error(file=f)
    assert msg.startswith(f"demo config {f} ") and needle in msg and msg.endswith("fix the file")
    assert f"demo config {tmp_path / 'none.yaml'} not found" in _error(file=tmp_path / "none.yaml")


def test_unknown_keys_name_the_section_its_keys_and_the_nearest(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("section:\n  dept: 3\n")
    msg = _error(file=f)
    assert msg == (f"demo config {f}: unknown key 'section.dept' (did you mean 'depth'?); valid keys in section: "
                   f"depth, name; correct or remove it in {f}")
    f.write_text("zzz: 1\n")
    assert "unknown key 'zzz'; valid keys: size, mode, prompts, levels, section, max_new_tokens;" in _error(file=f)


def test_bad_values_name_the_key_the_value_the_range_and_the_fix(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("section:\n  depth: 9\n")
    assert _error(file=f) == (f"demo config {f}: section.depth=9: Input should be less than or equal to 8; "
                              f"fix it in {f}")
    # given as a flag, the fix names the flag
    assert _error(flags={"size": 0}) == ("demo config: size=0: Input should be greater than or equal to 1; "
                                         "change --size")
    assert _error(flags={"mode": "warp"}).startswith("demo config: mode='warp': Input should be 'fast' or 'slow'")
    # a union says every accepted form once; a list item is named with its index
    assert "prompts=5: Input should be a valid string or Input should be a valid list" in _error(flags={"prompts": 5})
    assert "levels[1]='x': Input should be a valid integer" in _error(flags={"levels": [1, "x"]})
    # a check across fields keeps its own message; a caller's fix replaces the generic one
    assert _error(flags={"size": 500}) == ("demo config: --mode fast runs at most size 100; lower --size or use "
                                           "--mode slow")
    with pytest.raises(DFlashError, match=r"size=0: .*; rebuild it$"):
        load_config(Demo, flags={"size": 0}, what="demo config", fix="rebuild it")


def test_a_dotted_flag_under_a_scalar_is_refused(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("section: 3\n")
    assert "section must be a mapping to hold section.depth" in _error(file=f, flags={"section.depth": 2})


def test_the_printed_line_and_the_record_reload_to_the_same_config():
    cfg = load_config(Demo, flags={"size": 6, "section.name": "x", "levels": [3]}, what="demo config")
    line = config_line("demo", cfg)
    assert line.startswith("[demo] resolved config: {") and "\n" not in line
    recorded = json.loads(line.split(": ", 1)[1])
    assert recorded == config_record(cfg)
    assert load_config(Demo, values=recorded, what="demo config") == cfg


# -- every configuration of the product, through its own entry point --------------------------

def test_build_spec(tmp_path: Path):
    from dflash_trt.engine.spec import resolve_spec

    f = tmp_path / "s.yaml"
    f.write_text("gpu: h100\ncalibration:\n  num-samples: 3\n")  # a flag's spelling is accepted in the file
    assert resolve_spec(f, {"gate.max_tau_drop": 0.2}).calibration.num_samples == 3
    with pytest.raises(DFlashError, match=r"build spec: gate.max_tau_drop=1.5: Input should be less than 1"):
        resolve_spec(None, {"gate.max_tau_drop": 1.5})


def test_bench_config(tmp_path: Path):
    from dflash_trt.bench.config import resolve_config

    f = tmp_path / "b.yaml"
    f.write_text("concurrency: [4, 1]\ntemperature: -1\n")
    with pytest.raises(DFlashError, match=rf"bench config {f}: temperature=-1: .*; fix it in {f}"):
        resolve_config(str(f), {})
    assert resolve_config(str(f), {"temperature": 0.5}).concurrency == [1, 4]


def test_train_config_file_and_flags(tiny_pair_dirs, tmp_path: Path):
    target_dir, _ = tiny_pair_dirs
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"steps": 3, "block_size": 1}))
    res = CliRunner().invoke(main, ["train-draft", "--target", str(target_dir), "--out", str(tmp_path / "d"),
                                    "--config", str(f)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"error: train-draft config {f}: block_size=1: Input should be greater than or equal to 2; fix it in {f}" \
        in res.output
    assert not (tmp_path / "d").exists()


def test_engine_manifest(tmp_path: Path):
    from dflash_trt.engine.manifest import MANIFEST_NAME, load_manifest
    from tests.deploy_engines import manifest_engine

    engine = manifest_engine(tmp_path / "e", tp=1, pp=1)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["limits"]["max_draft_len"] = 0
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(DFlashError) as e:
        load_manifest(engine)
    assert str(e.value) == (f"engine manifest {engine / MANIFEST_NAME}: limits.max_draft_len=0: Input should be "
                            f"greater than or equal to 1; rebuild the engine with this dflash-trt version")


def test_repository_settings():
    from dflash_trt.serving.repository import resolve_repo_settings

    assert resolve_repo_settings({"backend": "reference", "max_queue": None}).backend == "pytorch"  # old alias
    with pytest.raises(DFlashError, match=r"^repository settings: max_queue=0: .*; change --max-queue$"):
        resolve_repo_settings({"max_queue": 0})


def test_slurm_options_are_one_line_errors(tmp_path: Path):
    """A --container-name Slurm cannot use was a pydantic traceback before it went through the loader."""
    from tests.deploy_engines import manifest_engine

    engine = manifest_engine(tmp_path / "e", tp=1, pp=1)
    res = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(tmp_path / "jobs"),
                                    "--container-name", "a b"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "error: deploy slurm options: container_name='a b': String should match pattern" in res.output
    assert "change --container-name" in res.output and not (tmp_path / "jobs").exists()


def test_doctor_reads_llm_api_options_through_the_loader(tmp_path: Path):
    """`doctor ENGINE` on an engine whose llm_api_options.yaml is gone or corrupt: one line, rebuild."""
    from tests.deploy_engines import manifest_engine

    engine = manifest_engine(tmp_path / "e", tp=1, pp=1)
    res = CliRunner().invoke(main, ["doctor", str(engine)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"error: llm_api_options {engine / 'llm_api_options.yaml'} not found; rebuild the engine" in res.output
    (engine / "llm_api_options.yaml").write_text("speculative_config: [\n")
    res = CliRunner().invoke(main, ["doctor", str(engine)])
    assert res.exit_code == 2 and "is not valid YAML" in res.output and "rebuild the engine" in res.output
