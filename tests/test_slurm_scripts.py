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
from dflash_trt.deploy.slurm import container_image_record
from tests.deploy_engines import manifest_engine

DEFAULT_IMAGE = container_image_record()["default_image"]


def sbatch_directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            assert key not in out, f"duplicate #SBATCH {key}"
            out[key] = value
    return out


def _arrays(script: str) -> dict[str, str]:
    """NAME=(...) bash arrays of the script, each with the arrays it uses expanded."""
    arrays: dict[str, str] = {}
    for m in re.finditer(r"^([A-Z_]+)=\((.*)\)$", script, re.M):
        arrays[m.group(1)] = re.sub(r'"\$\{([A-Z_]+)\[@\]\}"', lambda a: arrays.get(a.group(1), ""), m.group(2))
    return arrays


def srun_lines(script: str) -> list[str]:
    """Every srun invocation, with the SRUN/PER_NODE/ONE/CONTAINER arrays expanded where used."""
    arrays = _arrays(script)
    lines = []
    for line in script.splitlines():
        line = line.strip()
        m = re.match(r'"\$\{([A-Z_]+)\[@\]\}"(.*)', line)
        if m and arrays.get(m.group(1), "").startswith("srun "):
            lines.append(arrays[m.group(1)] + m.group(2))
        elif line.startswith("srun "):
            lines.append(line)
    return lines


def generate(tmp_path: Path, engine: Path, *args: str) -> dict[str, str]:
    out = tmp_path / "jobs"
    # --no-verify: manifest_engine writes the manifest alone (a b300 engine's weights cannot be built here)
    result = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(out), "--no-verify", *args])
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
    assert "--exclusive" in d  # TensorRT-LLM ranks get whole nodes
    runs = srun_lines(serve)
    # doctor on every node, the model repository (written or checked), preflight on every rank, the server
    assert len(runs) == 4, runs
    doctor, ensure, preflight, server = runs
    assert "--ntasks-per-node=1" in doctor and '"$STEP_DFLASH" doctor "$ENGINE" --backend trtllm' in doctor
    assert '--ntasks=1 ' in ensure and 'deploy ensure-repository "$ENGINE" "$REPO" --backend tensorrt_llm' in ensure
    assert "--mpi=pmix" in preflight and "--mpi=pmix" in server
    assert "launch" in preflight and "--backend trtllm --check" in preflight
    assert "--output=" in server and "%t" in server  # one log per rank
    assert re.search(r'trtllm-llmapi-launch tritonserver --model-repository="\$REPO" --grpc-port=8001', server)
    assert server.rstrip().endswith("&")  # in the background, so the script can wait for readiness
    assert "deploy wait-ready" in serve and "exit 1" in serve  # never-ready fails the job
    # every step runs in the default image, imported once per job by name
    assert all(f"--container-image={DEFAULT_IMAGE}" in r and "--container-name=dflash-trt" in r for r in runs)

    build = sbatch_directives(scripts["build"])
    # the build is one process: one GPU for a GPU engine, not the serving layout's
    assert (build["--nodes"], build["--ntasks"], int(build["--gpus-per-node"])) == ("1", "1", 1)
    assert "--device auto" in scripts["build"]
    bench = sbatch_directives(scripts["bench"])
    assert "--gpus-per-node" not in bench and "--exclusive" not in bench  # the client needs no GPU
    assert '"$STEP_DFLASH" bench --url "$URL" --out "$LOG_DIR/bench-$SLURM_JOB_ID"' in scripts["bench"]
    for job in ("build", "bench"):
        assert '"$STEP_DFLASH" doctor' in srun_lines(scripts[job])[0]  # every job starts with the doctor


def test_options_recorded_and_spec_written(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 1)
    scripts = generate(tmp_path, engine, "--job-name", "gptoss")
    out = tmp_path / "jobs"
    record = json.loads((out / "deploy_slurm.json").read_text())
    assert record["job_name"] == "gptoss" and record["engine_dir"] == str(engine.resolve())
    dflash = record["dflash_bin"]
    assert Path(dflash).is_absolute() and Path(dflash).exists()  # jobs don't inherit an activated venv
    assert f"DFLASH={shlex.quote(dflash)}" in scripts["serve"]
    assert record["container_image"] == DEFAULT_IMAGE
    spec = yaml.safe_load((out / "build_spec.yaml").read_text())
    assert spec == json.loads((engine / "dflash_trt.json").read_text())["spec"]
    assert '--spec "$SPEC"' in scripts["build"]
    assert sbatch_directives(scripts["serve"])["--job-name"] == "gptoss-serve"
    assert (out / "logs").is_dir()  # sbatch does not create the --output folder itself
    assert all((out / f"{j}.sbatch").stat().st_mode & 0o111 for j in ("serve", "build", "bench"))


def _mounts(run: str) -> list[str]:
    return re.search(r"--container-mounts=(\S+)", run).group(1).split(",")


def test_container_flags_on_every_srun(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    image = "nvcr.io#team/dflash-trt:trtllm-1.3.0rc27"
    scripts = generate(tmp_path, engine, "--container-image", image, "--container-mounts", "/lustre:/lustre",
                       "--container-name", "dfl")
    assert_bash_syntax(scripts, tmp_path)
    jobs = (tmp_path / "jobs").resolve()
    for job in ("serve", "build", "bench"):
        runs = srun_lines(scripts[job])
        assert runs
        for r in runs:
            assert f"--container-image={shlex.quote(image)}" in r and "--container-name=dfl" in r
            assert "/lustre:/lustre" in _mounts(r) and f"{jobs}:{jobs}" in _mounts(r)
    for r in srun_lines(scripts["serve"]):
        assert f"{engine.resolve()}:{engine.resolve()}" in _mounts(r)
        assert f"--container-workdir={engine.resolve()}" in r
    # inside the image the steps run the image's dflash-trt; the readiness wait runs on the host
    assert "STEP_DFLASH=dflash-trt" in scripts["serve"]
    assert '"$DFLASH" deploy wait-ready' in scripts["serve"]


def test_build_job_mounts_its_sources_and_a_persistent_output(tmp_path):
    """The build reads the checkpoints its spec names and writes beside --build-out: both are mounted."""
    import json

    engine = manifest_engine(tmp_path / "engine", 1, 1)
    target, draft, prompts = tmp_path / "ckpt" / "target", tmp_path / "drafts" / "d1", tmp_path / "calib.jsonl"
    for d in (target, draft):
        d.mkdir(parents=True)
    prompts.write_text("{}\n")
    data = json.loads((engine / "dflash_trt.json").read_text())
    data["spec"].update(target=str(target), draft=str(draft), calibration={"prompts": str(prompts)})
    data["gpu"] = "cpu"
    (engine / "dflash_trt.json").write_text(json.dumps(data))
    out = tmp_path / "persist" / "rebuilt"
    scripts = generate(tmp_path, engine, "--backend", "pytorch", "--build-out", str(out))
    build = scripts["build"]
    d = sbatch_directives(build)
    assert "--gpus-per-node" not in d and "--exclusive" not in d  # a CPU engine's build uses no GPU
    assert "--device cpu" in build and f"OUT={out.resolve()}" in build
    for r in srun_lines(build):
        mounts = _mounts(r)
        for path in (target, draft, prompts, out.parent):
            assert f"{path.resolve()}:{path.resolve()}" in mounts, (path, mounts)
    assert any('"$STEP_DFLASH" verify "$OUT"' in r for r in srun_lines(build))


def test_no_container_runs_the_host_cli(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 1)
    scripts = generate(tmp_path, engine, "--no-container", "--no-exclusive")
    for job, text in scripts.items():
        assert "--container" not in text, job
    assert "--exclusive" not in scripts["serve"]
    record = json.loads((tmp_path / "jobs" / "deploy_slurm.json").read_text())
    assert record["container_image"] is None
    assert f"STEP_DFLASH={shlex.quote(record['dflash_bin'])}" in scripts["serve"]


def test_trtllm_serve_variant(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    scripts = generate(tmp_path, engine, "--server", "trtllm-serve", "--http-port", "9000")
    assert_bash_syntax(scripts, tmp_path)
    runs = srun_lines(scripts["serve"])
    assert not any("ensure-repository" in r for r in runs)  # trtllm-serve reads the engine itself
    server = runs[-1]
    assert "trtllm-llmapi-launch trtllm-serve" in server
    assert "--tp_size 8 --pp_size 2" in server and "--port 9000" in server
    assert '--config "$ENGINE"/llm_api_options.yaml' in server
    assert 'URLS+=("http://${HOSTS[rank / 8]}:$((PORT + rank * PORT_STRIDE))/health")' in scripts["serve"]


def test_reference_backend_requests_no_gpu(tmp_path):
    engine = manifest_engine(tmp_path / "engine", 8, 1)
    scripts = generate(tmp_path, engine, "--backend", "reference", "--replicas", "2", "--mpi", "pmi2")
    assert_bash_syntax(scripts, tmp_path)
    d = sbatch_directives(scripts["serve"])
    assert "--gpus-per-node" not in d and "--exclusive" not in d  # the test cluster has no GPUs / no gres
    assert (d["--nodes"], d["--ntasks"], d["--ntasks-per-node"]) == ("1", "2", "2")
    doctor, ensure, server = srun_lines(scripts["serve"])
    assert "doctor \"$ENGINE\" --backend reference" in doctor
    assert "ensure-repository \"$ENGINE\" \"$REPO\" --backend reference" in ensure
    assert "--mpi=pmi2" in server
    assert "launch \"$ENGINE\" --backend reference" in server and "--port-stride 10" in server
    assert '--model-repository "$REPO"' in server
    assert "for ((rank = 0; rank < 2; rank++))" in scripts["serve"]  # one endpoint per replica
    assert "trtllm-llmapi-launch" not in server and "--backend trtllm" not in server
    # `pytorch`, the serving backend's name everywhere, writes the same jobs as its old name
    same = generate(tmp_path / "p", engine, "--backend", "pytorch", "--replicas", "2", "--mpi", "pmi2")
    assert [line.replace(str(tmp_path / "p"), str(tmp_path)) for line in srun_lines(same["serve"])] == \
        srun_lines(scripts["serve"])


@pytest.mark.parametrize("args, message", [
    (["--nodes", "3"], "do not split evenly"),
    (["--nodes", "1"], "need 16 GPUs per node"),
    (["--backend", "reference", "--replicas", "3", "--nodes", "2"], "does not split evenly"),
])
def test_impossible_layouts_fail_cleanly(tmp_path, args, message):
    engine = manifest_engine(tmp_path / "engine", 8, 2)
    out = tmp_path / "jobs"
    result = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(out), "--no-verify", *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: ")
    assert not (out / "serve.sbatch").exists()  # nothing half-written


def test_not_an_engine_directory(tmp_path):
    result = CliRunner().invoke(main, ["deploy", "slurm", str(tmp_path), "--out", str(tmp_path / "jobs")])
    assert result.exit_code != 0 and "dflash_trt.json missing" in result.output
    assert not (tmp_path / "jobs").exists()


def test_a_cpu_engine_is_not_handed_to_tensorrt_llm(tmp_path):
    """A CPU engine is float32; TensorRT-LLM's DFlash kernels take fp16/bf16 only
    (tests/upstream/tensorrt_llm_node.json): --backend trtllm is one line, nothing is written."""
    import json

    engine = manifest_engine(tmp_path / "engine", 1, 1)
    data = json.loads((engine / "dflash_trt.json").read_text())
    data["gpu"] = "cpu"
    (engine / "dflash_trt.json").write_text(json.dumps(data))
    out = tmp_path / "jobs"
    r = CliRunner().invoke(main, ["deploy", "slurm", str(engine), "--out", str(out), "--no-verify"])
    assert r.exit_code == 2 and "float16/bfloat16 on a GPU only" in r.output and "--backend pytorch" in r.output
    assert not (out / "serve.sbatch").exists() and "Traceback" not in r.output
