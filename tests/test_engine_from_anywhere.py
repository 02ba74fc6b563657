"""Every way dflash-trt starts TensorRT-LLM on an engine works from any working directory.

The engine's llm_api_options.yaml names the drafter `./draft` (engine-relative, so the directory
can move), and TensorRT-LLM resolves speculative_model against its working directory, taking a path
that does not exist there for a hub id (DecodingBaseConfig.speculative_model,
tensorrt_llm/llmapi/llm_args.py @ 0004396720054, recorded in tests/upstream/tensorrt_llm_node.json).
TensorRT-LLM cannot run here, so its two entry points are stand-ins that resolve the paths exactly
that way: a `trtllm-serve` executable (reads --config, resolves model and speculative_model from
its cwd) and a `tensorrt_llm` package whose llmapi.mgmn_leader_node is the module dflash-trt's
launcher runs on rank 0. Each is started from a directory that is not the engine's:
- the engine's launch/trtllm-serve.sh (it cds to the engine first);
- `dflash-trt launch ENGINE -- trtllm-serve ./target --config ./llm_api_options.yaml` under a real
  MPI singleton (mpi4py), as a Slurm job whose working directory is the submit directory would;
- the serve job `deploy slurm` writes (srun --chdir to the engine);
- and, as the control, trtllm-serve given absolute paths from elsewhere: the drafter is not found.
`serve ENGINE` and Triton's model.yaml (absolute paths) are covered in tests/test_tensorrt_llm_backend.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.engine.builder import build_engine, prepare
from dflash_trt.engine.spec import resolve_spec

ROOT = Path(__file__).resolve().parents[1]
NODE = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_node.json").read_text())

TRTLLM_SERVE = """#!{python}
# Stand-in for trtllm-serve: model and speculative_model resolve against the working directory;
# one that is no local directory would be fetched from the hub (not reachable on a node).
import json, os, sys
from pathlib import Path
import yaml
args = sys.argv[1:]
opts = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
model, draft = Path(args[0]), Path(opts["speculative_config"]["speculative_model"])
record = {{"cwd": os.getcwd(), "model": str(model.resolve()), "draft": str(draft.resolve()),
          "found": model.is_dir() and draft.is_dir()}}
Path(os.environ["STANDIN_RECORD"]).write_text(json.dumps(record))
sys.exit(0 if record["found"] else 3)
"""

LEADER = """# Stand-in for tensorrt_llm.llmapi.mgmn_leader_node: `--action stop` ends it; otherwise it
# serves until the server (the stand-in trtllm-serve) has run.
import os, sys, time
from pathlib import Path
if "--action" not in sys.argv:
    deadline = time.monotonic() + 60
    while not Path(os.environ["STANDIN_RECORD"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def engine(tiny_pair_dirs, tmp_path_factory) -> Path:
    tdir, ddir = tiny_pair_dirs
    spec = resolve_spec(None, {"target": str(tdir), "draft": str(ddir), "gpu": "h100", "max_seq_len": 256,
                               "dtype": "bfloat16"})
    return build_engine(prepare(spec), tmp_path_factory.mktemp("built") / "engine", progress=False)


@pytest.fixture
def standins(tmp_path) -> dict:
    bin_dir, pkg = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    serve = bin_dir / "trtllm-serve"
    serve.write_text(TRTLLM_SERVE.format(python=sys.executable))
    serve.chmod(0o755)
    (pkg / "tensorrt_llm" / "llmapi").mkdir(parents=True)
    (pkg / "tensorrt_llm" / "__init__.py").write_text('__version__ = "1.3.0rc27"\n')
    (pkg / "tensorrt_llm" / "llmapi" / "__init__.py").write_text("")
    (pkg / "tensorrt_llm" / "llmapi" / "mgmn_leader_node.py").write_text(LEADER)
    elsewhere = tmp_path / "submit-dir"
    elsewhere.mkdir()
    record = tmp_path / "record.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT)])}
    return {"env": env, "cwd": elsewhere, "record": record}


def _record(standins: dict) -> dict:
    return json.loads(standins["record"].read_text())


def test_the_yaml_names_the_drafter_relative_to_the_engine(engine):
    import yaml

    opts = yaml.safe_load((engine / "llm_api_options.yaml").read_text())
    assert opts["speculative_config"]["speculative_model"] == "./draft"
    assert "speculative_model" in NODE["DFlashDecodingConfig"] and "hub" in NODE["DFlashDecodingConfig"]["speculative_model"]


def test_launch_script_runs_from_any_directory(engine, standins):
    proc = subprocess.run(["bash", str(engine / "launch" / "trtllm-serve.sh")], cwd=standins["cwd"],
                          env=standins["env"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = _record(standins)
    assert got["found"] and got["draft"] == str(engine.resolve() / "draft")


def test_absolute_paths_from_elsewhere_do_not_find_the_drafter(engine, standins):
    """The control: what the YAML alone gives TensorRT-LLM outside the engine directory."""
    proc = subprocess.run(["trtllm-serve", str(engine / "target"), "--config", str(engine / "llm_api_options.yaml")],
                          cwd=standins["cwd"], env=standins["env"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and not _record(standins)["found"]


def test_dflash_trt_launch_runs_the_ranks_in_the_engine_directory(engine, standins):
    cmd = [sys.executable, "-m", "dflash_trt.cli", "launch", str(engine), "--backend", "trtllm", "--",
           "trtllm-serve", "./target", "--config", "./llm_api_options.yaml"]
    proc = subprocess.run(cmd, cwd=standins["cwd"], env=standins["env"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _record(standins)
    assert got["found"] and got["cwd"] == str(engine.resolve())
    assert got["draft"] == str(engine.resolve() / "draft")


def test_the_slurm_serve_job_runs_its_ranks_in_the_engine_directory(engine, tmp_path):
    from dflash_trt.deploy.slurm import SlurmOptions, render_jobs

    for server in ("tritonserver", "trtllm-serve"):
        serve = render_jobs(engine, SlurmOptions(out=tmp_path / "jobs", server=server))["serve"]
        srun = next(line for line in serve.splitlines() if line.startswith("SRUN=("))
        assert '--chdir="$ENGINE"' in srun and f"ENGINE={engine.resolve()}" in serve
