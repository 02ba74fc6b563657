"""The serve job's model repository: written from the engine when missing, checked when present.

A repository left from another engine (or hand-edited into something Triton will not load) must
fail the job before the server starts, with the command that fixes it, instead of serving the
wrong model or failing minutes later inside tritonserver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from dflash_trt.errors import DFlashError

RepoBackend = Literal["auto", "tensorrt_llm", "reference"]


def ensure_repository(engine_dir: str | Path, repo: str | Path, backend: RepoBackend = "auto") -> str:
    """Write `repo` for `engine_dir` if it does not exist; otherwise check it serves that engine.

    Returns "written" or "checked"; DFlashError (one line, with the fix) when the repository is
    unusable for this engine.
    """
    from dflash_trt.config import read_config_file
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.serving.repository import REPO_RECORD, TritonRepoSettings, generate_repository, read_model_config

    engine_dir, repo = Path(engine_dir).resolve(), Path(repo)
    load_manifest(engine_dir)  # a broken engine is reported as such, not as a repository problem
    regenerate = f"regenerate it: dflash-trt deploy triton {engine_dir} --out {repo} --force"
    if not repo.exists():
        generate_repository(engine_dir, repo, TritonRepoSettings(backend=backend, engine_path=str(engine_dir)))
        return "written"
    models = sorted(p for p in repo.iterdir() if p.is_dir() and (p / "config.pbtxt").is_file()) if repo.is_dir() else []
    if not models:
        raise DFlashError(f"model repository {repo} has no model (no */config.pbtxt); {regenerate}")
    for model in models:
        read_model_config(model)  # strict parse: a config Triton would refuse fails here
    record_path = repo / REPO_RECORD
    if record_path.is_file():
        record = read_config_file(record_path, "repository record", fix=regenerate)
        served = (record.get("settings") or {}).get("engine_path") or record.get("engine_dir")
        if served and Path(served).resolve() != engine_dir:
            raise DFlashError(f"model repository {repo} serves engine {served}, not {engine_dir}; {regenerate}")
    return "checked"
