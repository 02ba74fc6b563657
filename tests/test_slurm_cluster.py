"""On a REAL one-node Slurm cluster (Debian slurm-wlm + munge, started by the fixture with
scripts/slurm_cluster.sh): the generated serve, build and bench jobs, and `dflash-trt launch`
under `srun --mpi=pmix -n 2`.

Container flags: the jobs are generated with their default pyxis flags (--container-image,
--container-name, --container-mounts, --container-workdir) and run as written. pyxis itself is
not installed here; the cluster loads a STAND-IN SPANK plugin (scripts/pyxis_standin.c) that
gives srun those options, checks every mount source exists and is mounted at its own path,
starts the task in the workdir, prints one "[pyxis-standin] ..." line, and runs the task on the
host (no container, so the jobs get --container-dflash-bin = this venv's dflash-trt).

MPI under srun: Slurm's pmix plugin + Debian Open MPI (libopenmpi3), which mpi4py's wheel loads
with MPI4PY_MPIABI=openmpi (the launcher selects it when it sees PMIx); the pip `mpich` only
speaks PMI-1/2 (`srun --mpi=pmi2`). scripts/install_slurm.sh installs all of it.

Without Slurm these tests are skipped with the reason, except in CI (CI=true), where a missing
Slurm is a failure: run `scripts/install_slurm.sh` (as root) before the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_trt.deploy.slurm import default_container_image
from dflash_trt.sampling_params import SamplingParams
from tests.deploy_engines import gpu_copy, served_engine, with_mapping

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DFLASH = str(BIN / "dflash-trt")
PROMPT = "The capital of France is"
MAX_TOKENS = 16

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; CI must run the Slurm tests: run scripts/install_slurm.sh as root first")
    pytest.skip(reason)


def _free_port_block(n: int) -> int:
    """A base port with n consecutive free ports after it."""
    for base in range(20000 + os.getpid() % 5000 * 4, 60000, 97):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf"), "DFLASH_SLURM_DIR": str(directory),
                    "OMP_NUM_THREADS": "1"}
        for key in [k for k in self.env if k.startswith(("SLURM_JOB", "SLURM_STEP", "PMI", "OMPI_", "MPI4PY_"))]:
            del self.env[key]  # never inherit an enclosing job's identity

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "srun", "munged") if not shutil.which(b)]
    if missing:
        _unavailable(f"Slurm is not installed ({', '.join(missing)} missing)")
    if os.geteuid() != 0:
        _unavailable("the one-node Slurm cluster needs root (slurmd starts job steps as the submitting user)")
    directory = tmp_path_factory.mktemp("slurm")
    cluster = Cluster(directory)
    ctld = _free_port_block(2)
    cluster.env.update(DFLASH_SLURMCTLD_PORT=str(ctld), DFLASH_SLURMD_PORT=str(ctld + 1))
    script = str(ROOT / "scripts" / "slurm_cluster.sh")
    start = cluster.run(script, "start", timeout=60, check=False)
    if start.returncode != 0:
        cluster.run(script, "stop", timeout=60, check=False)
        _unavailable(f"the one-node Slurm cluster did not start: {start.stderr.strip().splitlines()[-1:]}")
    try:
        yield cluster
    finally:
        cluster.run(script, "stop", timeout=60, check=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return served_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def expected_text(engine) -> str:
    """The reference runtime's greedy output for PROMPT (what every server must answer)."""
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.decoding.tokens import TextCodec

    pair = load_pair(PairSource(engine / "target", engine / "draft"))
    codec = TextCodec.of_pair(pair)
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=codec.stop_token_ids)
    result = dflash_generate(pair.draft, pair.target, codec.encode(PROMPT), params)
    text = codec.decode(result.output_ids)
    assert text.strip(), "the fixture's prompt should produce visible text"
    return text


def ask(url: str) -> str:
    from dflash_trt.serving.client import generate

    return generate(url, PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, timeout_s=60).text


def processes_mentioning(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline.strip()}")
    return found


def needs_server() -> None:
    import importlib.util

    if importlib.util.find_spec("dflash_trt.serving") is None:
        pytest.skip("dflash_trt.serving (the reference server) is missing from this checkout")


def test_reference_serve_job_answers_and_cancels_cleanly(cluster, engine, expected_text, tmp_path):
    """sbatch the generated serve job, wait for readiness, ask with tritonclient, scancel."""
    needs_server()
    port = _free_port_block(2)
    out = tmp_path / "jobs"
    submitted = cluster.run(DFLASH, "deploy", "slurm", str(engine), "--out", str(out), "--backend", "reference",
                            "--grpc-port", str(port), "--metrics-port", str(port + 1), "--ready-timeout", "120",
                            "--job-name", "dflash-test", "--container-dflash-bin", DFLASH,
                            "--bench-args", "--num-prompts 1 --max-new-tokens 8 --no-plots", "--submit").stdout
    job = submitted.split("submitted serve job ")[1].split()[0]
    endpoints = out / "logs" / f"endpoints-{job}.txt"
    log = out / "logs" / f"dflash-test-serve-{job}.out"
    try:
        deadline = time.monotonic() + 150
        while not endpoints.exists():
            state = cluster.job_state(job)
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), \
                f"job {job} is {state}: {log.read_text() if log.exists() else 'no log'}"
            assert time.monotonic() < deadline, f"job {job} never became ready: {log.read_text() if log.exists() else ''}"
            time.sleep(0.5)
        urls = endpoints.read_text().split()
        assert urls == [f"localhost:{port}"]
        assert ask(urls[0]) == expected_text
        rank_log = (out / "logs" / f"dflash-test-serve-{job}-rank0.log").read_text()
        assert "reference replica" in rank_log  # per-rank log file (%t)
        # the server step got the container flags (through the pyxis stand-in) and ran in the engine dir
        assert f"[pyxis-standin] image={default_container_image()} name=dflash-trt workdir={engine.resolve()}" in rank_log
        # the serve job wrote the model repository it serves (none existed)
        assert (out / "triton_repo" / "dflash" / "config.pbtxt").is_file()
        # the bench job measures the served endpoint, after the serve job is up
        bench_job = cluster.run("sbatch", "--parsable", str(out / "bench.sbatch"), job).stdout.strip().split(";")[0]
        bench_log = out / "logs" / f"dflash-test-bench-{bench_job}.out"
        assert wait_for_state(cluster, bench_job, 240) == "COMPLETED", bench_log.read_text() if bench_log.exists() else ""
        report = json.loads((out / "logs" / f"bench-{bench_job}" / "bench.json").read_text())
        assert report, "bench.json is empty"
        assert "[pyxis-standin]" in bench_log.read_text() and f"benchmarking localhost:{port}" in bench_log.read_text()
    finally:
        cluster.run("scancel", job, check=False)
    deadline = time.monotonic() + 40
    while cluster.job_state(job) not in ("CANCELLED", "COMPLETED", "GONE"):
        assert time.monotonic() < deadline, f"job {job} still {cluster.job_state(job)} after scancel"
        time.sleep(0.5)
    while processes_mentioning(str(engine)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(engine)) == []
    text = log.read_text()
    assert "[serve] ready" in text
    doctor_line = "ok       engine 'tiny-llama-dflash': reference backend (PyTorch) needs torch"
    assert doctor_line in text and text.index(doctor_line) < text.index("[serve] ready")  # the doctor ran first
    assert cluster.job_state(job) in ("CANCELLED", "GONE")
    # (Whether the ranks log their graceful stop here races with srun SIGKILLing them on its own
    # SIGTERM; the graceful path is asserted with `scancel --signal=TERM` in the srun test.)


def test_serve_job_fails_fast_when_the_server_dies(cluster, engine, tmp_path):
    """A server that cannot start (an engine without weights) fails the job with the reason, at once."""
    needs_server()
    from tests.deploy_engines import manifest_engine

    broken = manifest_engine(tmp_path / "broken", tp=1, pp=1)
    # the doctor passes (reference backend: torch is here); the server then finds no weights
    (broken / "llm_api_options.yaml").write_text((engine / "llm_api_options.yaml").read_text())
    out = tmp_path / "jobs"
    port = _free_port_block(2)
    # --no-verify: the engine is broken on purpose (no weights); the job, not `deploy`, must notice
    submitted = cluster.run(DFLASH, "deploy", "slurm", str(broken), "--out", str(out), "--no-verify", "--backend", "reference",
                            "--grpc-port", str(port), "--metrics-port", str(port + 1), "--ready-timeout", "300",
                            "--job-name", "broken", "--container-dflash-bin", DFLASH, "--submit").stdout
    job = submitted.split("submitted serve job ")[1].split()[0]
    deadline = time.monotonic() + 90  # far below --ready-timeout: the wait notices the dead step
    while cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still {cluster.job_state(job)}"
        time.sleep(0.5)
    assert cluster.job_state(job) == "FAILED"
    log = (out / "logs" / f"broken-serve-{job}.out").read_text()
    assert "exited before" in log and "[serve] FAILED" in log
    assert not (out / "logs" / f"endpoints-{job}.txt").exists()


def wait_for_state(cluster: Cluster, job: str, timeout_s: float) -> str:
    """Wait until `job` leaves the queue; its final state (from the job record, kept MinJobAge seconds)."""
    deadline = time.monotonic() + timeout_s
    while (state := cluster.job_state(job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout_s:.0f}s"
        time.sleep(0.5)
    return state


def test_trtllm_serve_job_stops_at_the_doctor_on_this_gpu_less_node(cluster, engine, tmp_path):
    """No TensorRT-LLM and no GPU here: the doctor (first step) fails the job with its reasons."""
    out = tmp_path / "jobs"
    engine = gpu_copy(engine, tmp_path / "gpu-engine")  # TensorRT-LLM is never handed a CPU engine
    submitted = cluster.run(DFLASH, "deploy", "slurm", str(engine), "--out", str(out), "--backend", "trtllm",
                            "--gpus-per-node", "0", "--no-exclusive", "--job-name", "nogpu",
                            "--container-dflash-bin", DFLASH, "--submit").stdout
    job = submitted.split("submitted serve job ")[1].split()[0]
    assert wait_for_state(cluster, job, 90) == "FAILED"
    log = (out / "logs" / f"nogpu-serve-{job}.out").read_text()
    assert "MISSING  engine 'tiny-llama-dflash' needs TensorRT-LLM >= " in log and "CANNOT be served here" in log, log
    assert "1 per node: 0 GPU(s) visible here" in log
    assert "ensure-repository" not in log and not (out / "triton_repo").exists()  # stopped before anything else


@pytest.mark.slow
def test_build_job_output_survives_the_job(cluster, tiny_pair_dirs, tmp_path):
    """The build job rebuilds an engine from its recorded spec into --build-out on the host filesystem."""
    from dflash_trt.engine.manifest import load_manifest

    target, draft = tiny_pair_dirs
    engine = tmp_path / "engine"
    built = cluster.run(DFLASH, "build", "--target", str(target), "--draft", str(draft), "--max-seq-len", "256",
                        "--out", str(engine), "--no-progress", timeout=300)
    assert built.returncode == 0
    out, rebuilt = tmp_path / "jobs", tmp_path / "store" / "rebuilt"
    rebuilt.parent.mkdir()
    cluster.run(DFLASH, "deploy", "slurm", str(engine), "--out", str(out), "--build-out", str(rebuilt),
                "--job-name", "rebuild", "--container-dflash-bin", DFLASH, "--backend", "pytorch")  # a CPU engine
    job = cluster.run("sbatch", "--parsable", str(out / "build.sbatch")).stdout.strip().split(";")[0]
    log = out / "logs" / f"rebuild-build-{job}.out"
    assert wait_for_state(cluster, job, 300) == "COMPLETED", log.read_text() if log.exists() else "no log"
    text = log.read_text()
    # every step got the container flags, with the spec's checkpoints and the output's folder mounted
    standin = [ln for ln in text.splitlines() if ln.startswith("[pyxis-standin]")]
    assert len(standin) == 3, text  # doctor, build, verify
    for path in (target.resolve(), draft.resolve(), rebuilt.parent.resolve()):
        assert f"{path}:{path}" in standin[1], (path, standin[1])
    assert f"ok: {rebuilt}" in text and "[build] done" in text
    # the engine is on the host filesystem after the job: complete, verified, same build as the original
    assert load_manifest(rebuilt).name == load_manifest(engine).name
    assert (rebuilt / "llm_api_options.yaml").read_text() == (engine / "llm_api_options.yaml").read_text()
    assert not [p for p in rebuilt.parent.iterdir() if p.name != "rebuilt"]  # no temporary left behind


def test_srun_pmix_trtllm_world_size_mismatch_fails_fast(cluster, engine, tmp_path):
    """TP x PP = 1 but 2 ranks: every rank refuses with one line, the step fails in seconds."""
    assert "pmix" in cluster.run("srun", "--mpi=list").stdout + cluster.run("srun", "--mpi=list").stderr
    t0 = time.monotonic()
    engine = gpu_copy(engine, tmp_path / "gpu-engine")  # TensorRT-LLM is never handed a CPU engine
    proc = cluster.run("srun", "--mpi=pmix", "-n", "2", "--label", DFLASH, "launch", str(engine),
                       "--backend", "trtllm", "--", "tritonserver", f"--model-repository={tmp_path}",
                       timeout=90, check=False)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for rank in (0, 1):
        assert f"error: rank {rank}/2: MPI world size 2 != TP x PP = 1 x 1 = 1" in out, out
        assert f"error: rank {rank}/2: tensorrt_llm is not importable" in out, out
    assert "Open MPI" in out  # MPI over PMIx, not two singletons
    assert elapsed < 45, f"the refusal took {elapsed:.0f}s"


def test_srun_pmix_reference_replicas_answer_on_their_ports(cluster, engine, expected_text):
    needs_server()
    base = _free_port_block(4)
    name = f"replicas-{os.getpid()}"
    cmd = ["srun", "--mpi=pmix", "-n", "2", "--label", f"--job-name={name}", DFLASH, "launch", str(engine), "--backend", "reference",
           "--host", "127.0.0.1", "--grpc-port", str(base), "--metrics-port", str(base + 1), "--port-stride", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env,
                            start_new_session=True)
    try:
        from dflash_trt.deploy.ready import wait_ready

        urls = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 2}"]  # grpc-port + rank x stride
        wait_ready(urls, timeout_s=120, pid=proc.pid, interval_s=0.5)
        assert [ask(u) for u in urls] == [expected_text, expected_text]
        # SIGTERM to the ranks through Slurm (SIGTERM to srun itself makes srun SIGKILL them)
        job = cluster.run("squeue", "-h", "-o", "%i", f"--name={name}").stdout.split()
        assert len(job) == 1, job
        cluster.run("scancel", "--signal=TERM", job[0])
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "rank 0/2: stopped" in out and "rank 1/2: stopped" in out, out
    assert processes_mentioning(str(engine)) == []


def test_engine_mapping_helper_roundtrip(engine, tmp_path):
    """The fixture helper rewrites only the mapping (used for the mismatch test above)."""
    from dflash_trt.engine.manifest import load_manifest

    copy = tmp_path / "e"
    shutil.copytree(engine, copy)
    with_mapping(copy, tp=4, pp=2)
    m = load_manifest(copy)
    assert (m.mapping.tp, m.mapping.pp, m.mapping.world_size) == (4, 2, 8)
    assert m.name == load_manifest(engine).name
