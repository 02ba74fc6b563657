"""`dflash-trt deploy slurm`: the generated sbatch scripts, checked without a cluster.

The scripts must parse (`bash -n`), and their #SBATCH lines and srun flags must match the
engine's parallel mapping. Flags and commands are checked against the real names: sbatch/srun
(--nodes, --ntasks-per-node, --gpus-per-node, --mpi=pmix, %t), pyxis (--container-image,
--container-mounts), TensorRT-LLM (trtllm-llmapi-launch, trtllm-serve --tp_size/--pp_size/--config)
and Triton (tritonserver --model-repository/--grpc-port/--http-port/--metrics-port), which cannot
run here. The real one-node cluster runs them in test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash_trt.cli import main
from tests.deploy_engines import manifest_engine


def sbatch_directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            assert key not in out, f"duplicate #SBATCH {key}"
            out[key] = value
    return out


def srun_lines(script: str) -> list[str]:
    """Every srun invocation, with the SRUN=(...) array expanded where it is used."""
    m = re.search(r"^SRUN=\((.*)\)$", script, re.M)
    base = m.group(1) if m else ""
    lines = []
    for line in script.splitlines():
        line = line.strip()
        if line.startswith('"${SRUN[@]}"'):
            lines.append(line.replace('"${SRUN[@]}"', base, 1))
        elif line.startswith("srun "):
            lines.append(line)
    return lines


def generate(tmp_path: Path, engine: Path, *args: str) -> dict[str, str]:
    out = tmp_path / "jobs"
    result = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return {job: (out / f"{job}.sbatch").read_text() for job in ("serve", "build", "bench")}


def assert_bash_syntax(scripts: dict[str, str], tmp_path: Path) -> None:
    for job, text in scripts.items():
        path = tmp_path / f"check-{job}.sh"
        path.write_text(text)
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{job}: {proc.stderr}"
        assert "{{" not in text, f"{job}: unfilled placeholder"


# (tp, pp, gpus_per_node) -> (nodes, ntasks, ntasks_per_node, gpus_per_node requested)
LAYOUTS = {
    "1x8-tp8": ((8, 1, 8), (1, 8, 8, 8)),
    "2x8-tp8-pp2": ((8, 2, 8), (2, 16, 8, 8)),
    "1x1": ((1, 1, 1), (1, 1, 1, 1)),
}


@pytest.mark.parametrize("layout", LAYOUTS.keys())
def test_trtllm_serve_matches_mapping(tmp_path, layout):
    (tp, pp, gpn), (nodes, ntasks, per_node, gpus) = LAYOUTS[layout]
    engine = manifest_engine(tmp_path / "engine", tp, pp, gpn)
    scripts = generate(tmp_path, engine, "--partition", "batch", "--account", "llm", "--time", "02:00:00")
    assert_bash_syntax(scripts, tmp_path)
    serve = scripts["serve"]
    d = sbatch_directives(serve)
    assert (int(d["--nodes"]), int(d["--ntasks"]), int(d["--ntasks-per-node"]), int(d["--gpus-per-node"])) == \
        (nodes, ntasks, per_node, gpus)
    assert int(d["--ntasks"]) == tp * pp == nodes * per_node  # one rank per GPU, world size = TP x PP
    assert (d["--partition"], d["--account"], d["--time"]) == ("batch", "llm", "02:00:00")
    runs = srun_lines(serve)
    assert len(runs) == 2  # preflight on every rank, then the server
    assert all("--mpi=pmix" in r for r in runs)
    assert "launch" in runs[0] and "--backend trtllm --check" in runs[0]
    server = runs[1]
    assert "--output=" in server and "%t" in server  # one log per rank
    assert re.search(r"trtllm-llmapi-launch tritonserver --model-repository=\S+ --grpc-port=8001", server)
    assert server.rstrip().endswith("&")  # in the background, so the script can wait for readiness
    assert "deploy wait-ready" in serve and "exit 1" in serve  # never-ready fails the job
    assert "container" not in serve  # no image given: no pyxis flags

    build = sbatch_directives(scripts["build"])
    assert (build["--nodes"], build["--ntasks"], int(build["--gpus-per-node"])) == ("1", "1", per_node)
    bench = sbatch_directives(scripts["bench"])
    assert "--gpus-per-node" not in bench  # the client needs no GPU
    assert '"$DFLASH" bench --url "$URL"' in scripts["bench"]


def test_options_recorded_and_spec_written(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 1)
    scripts = generate(tmp_path, engine, "--job-name", "gptoss")
    out = tmp_path / "jobs"
    record = json.loads((out / "deploy_slurm.json").read_text())
    assert record["job_name"] == "gptoss" and record["engine_dir"] == str(engine.resolve())
    dflash = record["dflash_bin"]
    assert Path(dflash).is_absolute() and Path(dflash).exists()  # jobs don't inherit an activated venv
    assert f"DFLASH={shlex.quote(dflash)}" in scripts["serve"]
    spec = yaml.safe_load((out / "build_spec.yaml").read_text())
    assert spec == json.loads((engine / "dflash_trt.json").read_text())["spec"]
    assert '--spec "$SPEC"' in scripts["build"]
    assert sbatch_directives(scripts["serve"])["--job-name"] == "gptoss-serve"
    assert (out / "logs").is_dir()  # sbatch does not create the --output folder itself
    assert all((out / f"{j}.sbatch").stat().st_mode & 0o111 for j in ("serve", "build", "bench"))


def test_container_flags_on_every_srun(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    image = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"
    scripts = generate(tmp_path, engine, "--container-image", image, "--container-mounts", "/lustre:/lustre")
    assert_bash_syntax(scripts, tmp_path)
    for job in ("serve", "build"):
        runs = srun_lines(scripts[job])
        assert runs
        for r in runs:
            assert f"--container-image={image}" in r
            mounts = re.search(r"--container-mounts=(\S+)", r).group(1).split(",")
            assert "/lustre:/lustre" in mounts and f"{engine.resolve()}:{engine.resolve()}" in mounts
    # inside the image the step runs the image's dflash-trt; the readiness wait runs on the host
    assert "dflash-trt launch" in srun_lines(scripts["serve"])[0]
    assert '"$DFLASH" deploy wait-ready' in scripts["serve"]


def test_trtllm_serve_variant(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    scripts = generate(tmp_path, engine, "--server", "trtllm-serve", "--http-port", "9000")
    assert_bash_syntax(scripts, tmp_path)
    server = srun_lines(scripts["serve"])[1]
    assert "trtllm-llmapi-launch trtllm-serve" in server
    assert "--tp_size 8 --pp_size 2" in server and "--port 9000" in server
    assert '--config "$ENGINE"/llm_api_options.yaml' in server
    assert 'URLS+=("http://${HOSTS[rank / 8]}:$((PORT + rank * PORT_STRIDE))/health")' in scripts["serve"]


def test_reference_backend_requests_no_gpu(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 1)
    scripts = generate(tmp_path, engine, "--backend", "reference", "--replicas", "2", "--mpi", "pmi2")
    assert_bash_syntax(scripts, tmp_path)
    d = sbatch_directives(scripts["serve"])
    assert "--gpus-per-node" not in d  # the test cluster has no GPUs / no gres
    assert (d["--nodes"], d["--ntasks"], d["--ntasks-per-node"]) == ("1", "2", "2")
    runs = srun_lines(scripts["serve"])
    assert len(runs) == 1 and "--mpi=pmi2" in runs[0]
    assert "launch \"$ENGINE\" --backend reference" in runs[0] and "--port-stride 10" in runs[0]
    assert "for ((rank = 0; rank < 2; rank++))" in scripts["serve"]  # one endpoint per replica
    assert "trtllm" not in runs[0]
    # `pytorch`, the serving backend's name everywhere, writes the same jobs as its old name
    same = generate(tmp_path / "p", engine, "--backend", "pytorch", "--replicas", "2", "--mpi", "pmi2")
    assert srun_lines(same["serve"]) == runs


@pytest.mark.parametrize("args, message", [
    (["--nodes", "3"], "do not split evenly"),
    (["--nodes", "1"], "need 16 GPUs per node"),
    (["--backend", "reference", "--replicas", "3", "--nodes", "2"], "does not split evenly"),
])
def test_impossible_layouts_fail_cleanly(tmp_path, args, message):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    out = tmp_path / "jobs"
    result = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(out), *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: ")
    assert not (out / "serve.sbatch").exists()  # nothing half-written


def test_not_an_engine_directory(tmp_path):
    result = CliRunner().invoke(main, ["deploy", "slurm", str(tmp_path), "--out", str(tmp_path / "jobs")])
    assert result.exit_code != 0 and "dflash_trt.json missing" in result.output
    assert not (tmp_path / "jobs").exists()
