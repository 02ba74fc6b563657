"""`dflash-trt deploy ensure-repository ENGINE REPO`, the serve job's step before the server starts:
the repository is written from the engine when missing and checked when present (a repository of
another engine, or one Triton would refuse, fails with the command that regenerates it)."""

from __future__ import annotations

from click.testing import CliRunner

from dflash_trt.cli import main
from tests.deploy_engines import manifest_engine


def run(*args: str):
    return CliRunner().invoke(main, ["deploy", "ensure-repository", *args])


def test_written_when_missing_then_checked(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 1, 1)
    repo = tmp_path / "repo"
    first = run(str(engine), str(repo), "--backend", "reference")
    assert first.exit_code == 0, first.output
    assert "written" in first.output and (repo / "dflash" / "config.pbtxt").is_file()
    again = run(str(engine), str(repo))
    assert again.exit_code == 0 and "checked" in again.output


def test_a_repository_of_another_engine_is_refused(tmp_path):
    a, b = manifest_engine(tmp_path / "a", 1, 1), manifest_engine(tmp_path / "b", 1, 1, name="other")
    repo = tmp_path / "repo"
    assert run(str(a), str(repo)).exit_code == 0
    res = run(str(b), str(repo))
    assert res.exit_code != 0 and res.output.startswith("error: ")
    assert f"serves engine {a.resolve()}, not {b.resolve()}" in res.output
    assert f"dflash-trt deploy triton {b.resolve()} --out {repo} --force" in res.output


def test_a_config_triton_would_refuse_fails_before_the_server(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 1, 1)
    repo = tmp_path / "repo"
    assert run(str(engine), str(repo)).exit_code == 0
    (repo / "dflash" / "config.pbtxt").write_text('name: "dflash"\nbackend: "python"\nnot_a_field: 1\n')
    res = run(str(engine), str(repo))
    assert res.exit_code != 0 and "is not a valid Triton ModelConfig" in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run(str(engine), str(empty))
    assert res.exit_code != 0 and "has no model" in res.output


def test_a_corrupt_repository_record_is_one_line(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 1, 1)
    repo = tmp_path / "repo"
    assert run(str(engine), str(repo)).exit_code == 0
    (repo / "dflash_trt_repo.json").write_text('{"engine_dir": ')
    res = run(str(engine), str(repo))
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.startswith(f"error: repository record {repo / 'dflash_trt_repo.json'} is not valid JSON")
    assert f"regenerate it: dflash-trt deploy triton {engine.resolve()} --out {repo} --force" in res.output
