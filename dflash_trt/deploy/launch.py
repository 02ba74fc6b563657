"""`dflash-trt launch`: start an engine on every MPI rank (srun --mpi=pmix, mpiexec, or alone).

Rank and world size come from mpi4py, whichever launcher started us: `srun --mpi=pmix` (PMIx),
`srun --mpi=pmi2` or `mpiexec` (PMI), or none at all (an MPI singleton: rank 0 of 1).

Backends:
- trtllm: TensorRT-LLM shards the engine over TP x PP ranks. Every rank first checks, on its
  own, that the world size equals TP x PP and that `tensorrt_llm` imports; a mismatch is the
  classic cause of hangs, so each rank refuses with one clear line and the job fails in seconds.
  Then TensorRT-LLM's leader/worker convention (as `trtllm-llmapi-launch`): rank 0 runs the
  server command, the other ranks run TensorRT-LLM's MPI worker loop. Every rank, and the server
  command, runs IN THE ENGINE DIRECTORY: llm_api_options.yaml names the drafter `./draft`, and
  TensorRT-LLM resolves it against its working directory (a path that does not exist there is
  taken for a hub id), so it works whatever directory srun / mpiexec started in. Relative paths
  in the server command are therefore relative to the engine directory too, as in its launch/
  scripts.
- reference: tritonserver over a repository of the project's pytorch backend, which does not
  shard; ranks are independent replicas (like Triton's multi-instance mode), one endpoint per rank:
      grpc port    = --grpc-port    + rank * --port-stride
      metrics port = --metrics-port + rank * --port-stride
  e.g. defaults 8001/8002, stride 10: rank 0 -> 8001/8002, rank 1 -> 8011/8012.

SIGTERM (scancel, `scancel --signal=TERM`, mpiexec forwarding it) stops every rank gracefully and
it exits 0. (srun itself answers its own SIGTERM by SIGKILLing the tasks: signal through Slurm.)
No collective operation can block forever: the only one, a barrier before exit so that every
rank has printed its verdict, is non-blocking with a timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_trt.errors import DFlashError

Backend = Literal["trtllm", "reference"]
EXIT_REFUSED = 2
BARRIER_TIMEOUT_S = 10.0
# Environment a child must not inherit: a second MPI_Init under the same PMI/PMIx identity is
# undefined behaviour (TensorRT-LLM's launcher strips the same prefixes for the same reason).
MPI_ENV_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "MPI_", "UCX_", "I_MPI_", "HYDRA_", "MPICH_")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    library: str  # first line of MPI_Get_library_version

    @property
    def tag(self) -> str:
        return f"rank {self.rank}/{self.world_size}"


def select_mpi_abi(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Pick the MPI the mpi4py wheel loads, from how this process was launched.

    The pip `mpich` speaks PMI-1/2 only and aborts under a PMIx launcher ("unsupported PMI
    version PMIx"), so under `srun --mpi=pmix` (PMIX_RANK set, no PMI_FD) the wheel must load
    Open MPI. An explicit MPI4PY_MPIABI always wins; source builds of mpi4py ignore it.
    """
    if "MPI4PY_MPIABI" in env:
        return env["MPI4PY_MPIABI"]
    if "PMIX_RANK" in env and "PMI_FD" not in env and "PMI_PORT" not in env:
        env["MPI4PY_MPIABI"] = "openmpi"
        return "openmpi"
    return None


def mpi_rank_info() -> tuple[Any, RankInfo]:
    """(COMM_WORLD, RankInfo); initializes MPI through mpi4py."""
    abi = select_mpi_abi()
    try:
        from mpi4py import MPI
    except ImportError as e:
        hint = ("under srun --mpi=pmix install Open MPI (apt-get install libopenmpi3) or use srun --mpi=pmi2"
                if abi == "openmpi" else "pip install 'dflash-trt[mpi]'")
        raise DFlashError(f"mpi4py cannot load an MPI library ({str(e).splitlines()[0]}); {hint}")
    comm = MPI.COMM_WORLD
    library = MPI.Get_library_version().strip().splitlines()[0].strip()
    return comm, RankInfo(comm.Get_rank(), comm.Get_size(), library)


def converge(comm: Any, timeout_s: float = BARRIER_TIMEOUT_S) -> bool:
    """A barrier that gives up after `timeout_s` (True when every rank arrived)."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def log(info: RankInfo, message: str) -> None:
    print(f"[launch] {info.tag}: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# TensorRT-LLM backend
# --------------------------------------------------------------------------------------------

def trtllm_problems(manifest: Any, info: RankInfo) -> list[str]:
    """Why this rank cannot run the engine with TensorRT-LLM (empty: it can). Local, no MPI calls."""
    problems = []
    m = manifest.mapping
    if info.world_size != m.world_size:
        problems.append(
            f"MPI world size {info.world_size} != TP x PP = {m.tp} x {m.pp} = {m.world_size} of engine "
            f"{manifest.name!r}; launch exactly {m.world_size} ranks, one per GPU "
            f"(srun -n {m.world_size} / sbatch --ntasks={m.world_size}), or rebuild the engine for {info.world_size}")
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as e:  # ImportError, or its CUDA libraries failing to load
        problems.append(
            f"tensorrt_llm is not importable here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"run inside the dflash-trt container (deploy/container: TensorRT-LLM >= {manifest.min_tensorrt_llm_version}; "
            "the Triton trtllm-python-py3 images have no DFlash; `dflash-trt doctor ENGINE` lists what is missing) "
            "or use --backend reference")
    return problems


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}


def run_trtllm_roles(info: RankInfo, server_cmd: list[str]) -> int:  # pragma: no cover - needs TensorRT-LLM + GPUs
    """TensorRT-LLM's leader/worker convention, in this already-initialized MPI process.

    Rank 0 starts `server_cmd` (e.g. tritonserver or trtllm-serve) WITHOUT the MPI environment
    and runs TensorRT-LLM's leader node, through which the server's LLM() drives the worker
    ranks; the other ranks run TensorRT-LLM's worker node. Same env protocol as the upstream
    `trtllm-llmapi-launch` (TLLM_SPAWN_PROXY_PROCESS*).
    """
    import runpy
    import secrets
    import socket
    import subprocess
    import threading

    if info.rank != 0:
        log(info, "worker: running tensorrt_llm.llmapi.mgmn_worker_node")
        sys.argv = ["mgmn_worker_node"]
        runpy.run_module("tensorrt_llm.llmapi.mgmn_worker_node", run_name="__main__")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"TLLM_SPAWN_PROXY_PROCESS": "1",
                       "TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR": f"tcp://127.0.0.1:{port}",
                       "TLLM_SPAWN_PROXY_PROCESS_IPC_HMAC_KEY": secrets.token_hex(32)})
    log(info, f"leader: starting {' '.join(server_cmd)}")
    server = subprocess.Popen(server_cmd, env=_clean_env())

    def stop_leader_when_server_exits() -> None:
        server.wait()
        subprocess.run([sys.executable, "-m", "tensorrt_llm.llmapi.mgmn_leader_node", "--action", "stop"],
                       env=_clean_env() | {k: v for k, v in os.environ.items() if k.startswith("TLLM_")})

    threading.Thread(target=stop_leader_when_server_exits, daemon=True).start()
    sys.argv = ["mgmn_leader_node"]
    try:
        runpy.run_module("tensorrt_llm.llmapi.mgmn_leader_node", run_name="__main__")
    finally:
        if server.poll() is None:
            server.terminate()
    return server.wait()


# --------------------------------------------------------------------------------------------
# Reference backend
# --------------------------------------------------------------------------------------------

def replica_ports(rank: int, grpc_port: int, metrics_port: int, stride: int) -> tuple[int, int]:
    """(grpc, metrics) ports of replica `rank`: base + rank * stride."""
    return grpc_port + rank * stride, metrics_port + rank * stride


def check_port_plan(world_size: int, grpc_port: int, metrics_port: int, stride: int) -> None:
    """Every replica's ports are valid and no two endpoints collide (checked before any server starts)."""
    used: dict[int, str] = {}
    for r in range(world_size):
        for kind, port in zip(("grpc", "metrics"), replica_ports(r, grpc_port, metrics_port, stride)):
            if not 0 < port < 65536:
                raise DFlashError(f"rank {r} {kind} port {port} is out of range; lower --grpc-port/--metrics-port "
                                  f"or --port-stride ({world_size} ranks)")
            if port in used:
                raise DFlashError(f"rank {r} {kind} port {port} collides with {used[port]}; use a --port-stride "
                                  f"of at least 2 and --metrics-port outside --grpc-port + k x stride")
            used[port] = f"rank {r} {kind}"


def run_reference_replica(engine_dir: Path, info: RankInfo, host: str, grpc_port: int, metrics_port: int,
                          stride: int, model_repository: Path | None = None) -> int:
    """Serve the engine on tritonserver (its pytorch backend) on this rank's ports, as `dflash-trt
    serve` does.

    Without `model_repository`, each rank writes its own temporary repository for the engine
    (pytorch backend), as `dflash-trt serve ENGINE` does, and removes it on exit.
    """
    import importlib.util
    import shutil
    import tempfile

    if importlib.util.find_spec("dflash_trt.serving") is None:
        raise DFlashError("the serving package (dflash_trt.serving) is not part of this installation; "
                          "reinstall dflash-trt or use --backend trtllm")
    from dflash_trt.serving.repository import TritonRepoSettings, generate_repository
    from dflash_trt.serving.serve import run_serve
    from dflash_trt.serving.tritonserver import ServerPorts, require_tritonserver

    require_tritonserver()  # one line naming what is missing, before a repository is written
    grpc, metrics = replica_ports(info.rank, grpc_port, metrics_port, stride)
    tmp = None
    try:
        if model_repository is None:
            tmp = Path(tempfile.mkdtemp(prefix=f"dflash-trt-rank{info.rank}-"))
            model_repository = generate_repository(engine_dir, tmp / "repo", TritonRepoSettings(backend="pytorch"))
        log(info, f"reference replica: {model_repository} on {host}:{grpc} (gRPC), metrics :{metrics}")
        # run_serve handles SIGTERM itself once serving: in-flight requests finish, then it returns.
        return run_serve(model_repository, ServerPorts(grpc=grpc, metrics=metrics, address=host), openai_port=None)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception in the main thread, so servers unwind through `finally`."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def launch(engine_dir: str | Path, backend: Backend = "trtllm", check_only: bool = False, host: str = "0.0.0.0",
           grpc_port: int = 8001, metrics_port: int = 8002, port_stride: int = 10,
           server_cmd: list[str] | None = None, model_repository: str | Path | None = None) -> int:
    """Run this rank's part; return the process exit code. Every refusal is printed by every rank."""
    from dflash_trt.engine.manifest import load_manifest

    engine_dir = Path(engine_dir).resolve()
    # Errors every rank finds alike, raised before MPI starts (a plain one-line error per rank).
    manifest = load_manifest(engine_dir)
    if backend == "trtllm":
        from dflash_trt.engine.llm_api import tensorrt_llm_refusal

        refusal = tensorrt_llm_refusal(manifest)
        if refusal:
            raise DFlashError(f"--backend trtllm: {refusal} (launch --backend pytorch)")
    if backend == "reference":
        check_port_plan(1, grpc_port, metrics_port, port_stride)
    elif not check_only and not server_cmd:
        raise DFlashError("--backend trtllm needs the server command for rank 0 after `--`, e.g. "
                          "`dflash-trt launch ENGINE -- tritonserver --model-repository=REPO`")
    comm, info = mpi_rank_info()
    log(info, f"{info.library}; backend {backend}; engine {manifest.name!r} "
              f"(TP {manifest.mapping.tp} x PP {manifest.mapping.pp})")

    problems: list[str] = []
    if backend == "trtllm":
        problems = trtllm_problems(manifest, info)
    else:
        try:
            check_port_plan(info.world_size, grpc_port, metrics_port, port_stride)
        except DFlashError as e:
            problems = [str(e)]
    if problems:
        for p in problems:
            print(f"error: {info.tag}: {p}", file=sys.stderr, flush=True)
        # Let every rank print its verdict before any exits (srun aborts the step at the first
        # exit), but never wait more than BARRIER_TIMEOUT_S: ranks that disagree must not hang.
        converge(comm)
        # No MPI_Finalize: it synchronizes, and a rank that passed the checks may be serving.
        os._exit(EXIT_REFUSED)
    if check_only:
        log(info, "ok: world size matches TP x PP and tensorrt_llm imports" if backend == "trtllm"
            else f"ok: replica ports {replica_ports(info.rank, grpc_port, metrics_port, port_stride)}")
        converge(comm)
        return 0

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    code = 0
    try:
        if backend == "trtllm":
            os.chdir(engine_dir)  # ./draft and ./target resolve here, on every rank (module docstring)
            code = run_trtllm_roles(info, server_cmd or [])
        else:
            repo = Path(model_repository).resolve() if model_repository else None
            code = run_reference_replica(engine_dir, info, host, grpc_port, metrics_port, port_stride, repo)
    except KeyboardInterrupt as e:  # SIGTERM (scancel) or Ctrl-C: a requested, clean shutdown
        log(info, f"stopped ({e or 'interrupt'})")
        code = 0
    except Exception as e:  # noqa: BLE001
        # This rank cannot serve. Leave NOW without MPI_Finalize: it would wait for the ranks that
        # are serving, so the job would hang half-up; exiting makes srun/mpiexec end the step.
        if isinstance(e, DFlashError):
            print(f"error: {info.tag}: {e}", file=sys.stderr, flush=True)
        else:
            import traceback

            traceback.print_exc()
            print(f"error: {info.tag}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code if isinstance(e, DFlashError) else 1)
    else:
        log(info, f"stopped (exit code {code})")
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not converge(comm):
        # Another rank is gone or stuck: MPI_Finalize could block on it; leave without it.
        log(info, "other ranks did not reach shutdown; exiting without MPI_Finalize")
        sys.stderr.flush()
        os._exit(code)
    return code
