"""`dflash-trt launch` under real MPI launchers: standalone (MPI singleton) and `mpiexec` from the
pip `mpich` package. (Under Slurm's `srun --mpi=pmix`: tests/test_slurm_cluster.py.)

TensorRT-LLM cannot be installed here, so the trtllm backend is tested up to its checks: the
world-size refusal and the "tensorrt_llm is not importable" message, on every rank, fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_trt.deploy.launch import check_port_plan, replica_ports, select_mpi_abi
from dflash_trt.errors import DFlashError
from tests.deploy_engines import manifest_engine

BIN = Path(sys.executable).parent
DFLASH = str(BIN / "dflash-trt")
MPIEXEC = BIN / "mpiexec"

pytestmark = pytest.mark.mpi


def run(cmd: list[str], timeout: float = 60) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "SLURM_", "MPI4PY_"))}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def mpiexec(n: int) -> list[str]:
    if not MPIEXEC.exists():
        pytest.skip(f"{MPIEXEC} missing: pip install 'dflash-trt[mpi]'")
    return [str(MPIEXEC), "-n", str(n)]


def test_replica_ports_follow_rank():
    assert [replica_ports(r, 8001, 8002, 10) for r in range(3)] == [(8001, 8002), (8011, 8012), (8021, 8022)]
    check_port_plan(8, 8001, 8002, 10)


@pytest.mark.parametrize("world, grpc, metrics, stride, message", [
    (2, 8001, 8011, 10, "collides"),      # rank 1 gRPC == rank 0 metrics
    (2, 8001, 8002, 1, "collides"),       # stride 1: rank 1 gRPC == rank 0 metrics
    (3, 65000, 65001, 500, "out of range"),
])
def test_port_plan_rejects_collisions(world, grpc, metrics, stride, message):
    with pytest.raises(DFlashError, match=message):
        check_port_plan(world, grpc, metrics, stride)


def test_mpi_abi_follows_the_launcher():
    pmix = {"PMIX_RANK": "0"}
    assert select_mpi_abi(pmix) == "openmpi" and pmix["MPI4PY_MPIABI"] == "openmpi"
    assert select_mpi_abi({"PMIX_RANK": "0", "PMI_FD": "5"}) is None  # PMI-2 (srun --mpi=pmi2)
    assert select_mpi_abi({"PMI_RANK": "0"}) is None  # hydra mpiexec
    assert select_mpi_abi({"PMIX_RANK": "0", "MPI4PY_MPIABI": "mpich"}) == "mpich"  # explicit wins


def test_singleton_refuses_world_size_mismatch(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=2, pp=1)
    rc, out, _ = run([DFLASH, "launch", str(engine), "--backend", "trtllm", "--check"])
    assert rc == 2, out
    assert "rank 0/1: MPI world size 1 != TP x PP = 2 x 1 = 2" in out
    assert "tensorrt_llm is not importable" in out
    assert "Traceback" not in out


def test_every_rank_refuses_fast_under_mpiexec(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=4, pp=1)
    rc, out, elapsed = run([*mpiexec(2), DFLASH, "launch", str(engine), "--backend", "trtllm", "--",
                            "tritonserver", f"--model-repository={tmp_path / 'repo'}"], timeout=60)
    assert rc != 0
    for rank in (0, 1):
        assert f"error: rank {rank}/2: MPI world size 2 != TP x PP = 4 x 1 = 4" in out, out
        assert f"error: rank {rank}/2: tensorrt_llm is not importable" in out, out
    assert elapsed < 30, f"refusal took {elapsed:.1f}s: something blocked"
    assert "Traceback" not in out


def test_trtllm_needs_a_server_command(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=1, pp=1)
    rc, out, _ = run([DFLASH, "launch", str(engine), "--backend", "trtllm"])
    assert rc == 2 and out.strip().splitlines()[-1].startswith("error: --backend trtllm needs the server command")


def test_world_size_match_leaves_only_the_missing_tensorrt_llm(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=2, pp=1)
    rc, out, _ = run([*mpiexec(2), DFLASH, "launch", str(engine), "--backend", "trtllm", "--check"])
    assert rc != 0
    assert "!= TP x PP" not in out  # no mismatch reported
    assert out.count("tensorrt_llm is not importable") == 2


def test_reference_check_sees_every_rank(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=8, pp=1)  # replicas ignore the engine's TP
    rc, out, _ = run([*mpiexec(2), DFLASH, "launch", str(engine), "--backend", "reference", "--check"])
    assert rc == 0, out
    assert "rank 0/2: ok" in out and "rank 1/2: ok" in out


def test_reference_port_collision_refused_on_every_rank(tmp_path):
    engine = manifest_engine(tmp_path / "engine", tp=1, pp=1)
    rc, out, _ = run([*mpiexec(2), DFLASH, "launch", str(engine), "--backend", "reference",
                      "--grpc-port", "9001", "--metrics-port", "9002", "--port-stride", "1"])
    assert rc != 0, out
    assert "error: rank 0/2:" in out and "error: rank 1/2:" in out and "collides" in out
