"""CLI of the Slurm / MPI area: `dflash-trt deploy slurm`, `dflash-trt deploy wait-ready`, `dflash-trt launch`,
`dflash-trt doctor`.

Heavy imports (mpi4py, tritonclient, the server) happen inside the commands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash_trt.cli_helpers import friendly_errors


def _own_server_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """`pytorch` (the serving backend's name everywhere) is what deploy/launch call `reference`."""
    return "reference" if value == "pytorch" else value


def server_options(repository: str, http: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ports and the model repository of the servers a job (`deploy slurm`) or a rank (`launch`)
    starts, declared once. The pytorch backend's replicas (old name: reference) count their ports
    from rank 0's by --port-stride. `repository`: whose repository it is and its default."""
    port = click.IntRange(1, 65535)
    options = [
        click.option("--model-repository", type=click.Path(file_okay=False),
                     help=f"The model repository to serve (`dflash-trt deploy triton`): {repository}."),
        click.option("--grpc-port", type=port, default=8001, show_default=True,
                     help="gRPC port (pytorch backend: of rank 0; rank r uses grpc-port + r x port-stride)."),
        *([click.option("--http-port", type=port, default=8000, show_default=True,
                        help="HTTP port (tritonserver, trtllm-serve).")] if http else []),
        click.option("--metrics-port", type=port, default=8002, show_default=True,
                     help="Prometheus metrics port (pytorch backend: of rank 0; rank r uses metrics-port + r x "
                          "port-stride)."),
        click.option("--port-stride", type=click.IntRange(min=1), default=10, show_default=True,
                     help="Port offset between the pytorch backend's replicas (ranks)."),
    ]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


@click.command("slurm")
@click.argument("engine", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default="slurm", show_default=True,
              help="Folder for serve.sbatch, build.sbatch, bench.sbatch, build_spec.yaml and logs/.")
@click.option("--backend", type=click.Choice(["trtllm", "pytorch", "reference"]), default="trtllm", show_default=True,
              callback=_own_server_name,
              help="trtllm: TensorRT-LLM ranks (TP x PP tasks, one per GPU). pytorch (old name: reference): the "
                   "project's own server, independent replicas, no GPU request unless --gpus-per-node.")
@click.option("--server", type=click.Choice(["tritonserver", "trtllm-serve"]), default="tritonserver",
              show_default=True, help="trtllm backend: what rank 0 runs behind trtllm-llmapi-launch.")
@click.option("--job-name", help="Slurm job name prefix (default: the engine name); jobs get -serve/-build/-bench.")
@click.option("--partition", help="sbatch --partition.")
@click.option("--account", help="sbatch --account.")
@click.option("--time", "time_limit", help="sbatch --time, e.g. 04:00:00.")
@click.option("--nodes", type=click.IntRange(min=1), help="Nodes (default: from the engine's mapping).")
@click.option("--gpus-per-node", type=click.IntRange(min=0),
              help="GPUs per node (default: the engine's mapping; none for --backend reference; 0: no GPU "
                   "request, for clusters without GPU gres).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="--backend reference: independent servers, one per task.")
@click.option("--container-image",
              help="pyxis/enroot image for every srun step [default: the image built from deploy/container "
                   "(image.json default_image)]; a registry reference or a .sqsh path.")
@click.option("--no-container", is_flag=True, help="Run the steps on the hosts, with --dflash-bin (no pyxis).")
@click.option("--container-name", default="dflash-trt", show_default=True,
              help="pyxis --container-name: the image is imported once per job and reused by every step.")
@click.option("--exclusive/--no-exclusive", default=None,
              help="sbatch --exclusive for the serve and build jobs [default: on for --backend trtllm].")
@click.option("--build-gpus", type=click.IntRange(min=0),
              help="GPUs of the build job [default: 1 for a GPU engine, 0 for a CPU one].")
@click.option("--build-out", type=click.Path(file_okay=False),
              help="Where the build job writes the engine [default: ENGINE-rebuilt beside ENGINE].")
@click.option("--container-mounts", help="srun --container-mounts SRC:DST[,...]; the engine and --out are "
                                         "always mounted at their own paths.")
@click.option("--container-dflash-bin", default="dflash-trt", show_default=True,
              help="The dflash-trt command inside --container-image.")
@server_options("tritonserver's or every replica's [default: OUT/triton_repo, from `dflash-trt deploy triton`]",
                http=True)
@click.option("--mpi", default="pmix", show_default=True,
              help="srun --mpi plugin (`srun --mpi=list`); pmi2 for an MPICH-only environment.")
@click.option("--ready-timeout", type=click.IntRange(min=1), default=1800, show_default=True,
              help="Seconds the serve job waits for the server to answer ServerReady before failing.")
@click.option("--dflash-bin", type=click.Path(dir_okay=False),
              help="Absolute path of dflash-trt for the job (default: the one running now; jobs do not "
                   "inherit an activated venv).")
@click.option("--bench-args", default="", help="Extra arguments for `dflash-trt bench` in bench.sbatch.")
@click.option("--submit", is_flag=True, help="Submit serve.sbatch with sbatch and print its job id.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check ENGINE's files against its manifest first (`dflash-trt verify`); --no-verify writes "
                   "the scripts from the manifest alone, e.g. where the engine's weights are not copied yet.")
@friendly_errors
def slurm(engine: str, out: str, backend: str, server: str, job_name: str | None, partition: str | None,
          account: str | None, time_limit: str | None, nodes: int | None, gpus_per_node: int | None,
          replicas: int, container_image: str | None, no_container: bool, container_name: str,
          exclusive: bool | None, build_gpus: int | None, build_out: str | None,
          container_mounts: str | None, container_dflash_bin: str,
          model_repository: str | None, grpc_port: int, http_port: int, metrics_port: int, port_stride: int,
          mpi: str, ready_timeout: int, dflash_bin: str | None, bench_args: str, submit: bool, verify: bool) -> None:
    """Write sbatch scripts (serve, build, bench) for the engine directory ENGINE."""
    from dflash_trt.config import load_config
    from dflash_trt.deploy.slurm import SlurmOptions, describe, sbatch, write_jobs

    kw = dict(out=Path(out), backend=backend, server=server, job_name=job_name, partition=partition,
              account=account, time=time_limit, nodes=nodes, gpus_per_node=gpus_per_node, replicas=replicas,
              container_name=container_name, exclusive=exclusive, build_gpus=build_gpus,
              build_out=Path(build_out) if build_out else None, container_mounts=container_mounts,
              container_dflash_bin=container_dflash_bin,
              model_repository=Path(model_repository) if model_repository else None, grpc_port=grpc_port,
              http_port=http_port, metrics_port=metrics_port, port_stride=port_stride, mpi=mpi,
              ready_timeout=ready_timeout, bench_args=bench_args)
    if dflash_bin:
        kw["dflash_bin"] = str(Path(dflash_bin).resolve())
    if container_image and not no_container:
        kw["container_image"] = container_image
    opts = load_config(SlurmOptions, flags=kw, values={"container_image": None} if no_container else None,
                       what="deploy slurm options")
    click.echo(f"[deploy slurm] resolved options:\n{describe(opts)}", err=True)
    if verify:
        from dflash_trt.engine.verify import verify_engine

        verify_engine(engine)  # jobs for an altered engine would fail on the cluster, hours later
    paths = write_jobs(engine, opts)
    for job, path in paths.items():
        click.echo(f"{job}: {path}")
    if submit:
        serve_id = sbatch(paths["serve"])
        click.echo(f"submitted serve job {serve_id}")
        click.echo(f"[deploy slurm] benchmark it with: sbatch --dependency=after:{serve_id} {paths['bench']} {serve_id}",
                   err=True)


@click.command("wait-ready")
@click.argument("urls", nargs=-1, required=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=600, show_default=True,
              help="Seconds to wait for every URL.")
@click.option("--pid", type=int, help="Fail at once when this process (the server step) exits.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between polls.")
@friendly_errors
def wait_ready_cmd(urls: tuple[str, ...], timeout_s: float, pid: int | None, interval: float) -> None:
    """Wait until every server in URLS is ready (HOST:PORT = KServe gRPC ServerReady; http://... = HTTP 200)."""
    from dflash_trt.deploy.ready import wait_ready

    waited = wait_ready(urls, timeout_s, pid=pid, interval_s=interval,
                        on_ready=lambda url, t: click.echo(f"[wait-ready] {url} ready after {t:.1f}s", err=True))
    click.echo(f"[wait-ready] all {len(urls)} endpoint(s) ready after {waited:.1f}s", err=True)


@click.command("launch", context_settings={"ignore_unknown_options": False})
@click.argument("engine", type=click.Path(file_okay=False))
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
@click.option("--backend", type=click.Choice(["trtllm", "pytorch", "reference"]), default="trtllm", show_default=True,
              callback=_own_server_name,
              help="trtllm: world size must equal TP x PP; rank 0 serves, other ranks are TensorRT-LLM workers. "
                   "pytorch (old name: reference): every rank is an independent replica of the project's own "
                   "server on its own ports.")
@click.option("--check", "check_only", is_flag=True,
              help="Only check (world size vs TP x PP, tensorrt_llm importable) on every rank, then exit.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address the reference server binds.")
@server_options("the pytorch backend's [default: a temporary one written per rank for ENGINE]", http=False)
@friendly_errors
def launch_cmd(engine: str, server_cmd: tuple[str, ...], backend: str, check_only: bool, host: str,
               grpc_port: int, metrics_port: int, port_stride: int, model_repository: str | None) -> None:
    """Run ENGINE on this MPI rank (srun --mpi=pmix, mpiexec, or standalone).

    With --backend trtllm, the server command for rank 0 follows `--`, e.g.
    `dflash-trt launch ENGINE -- tritonserver --model-repository=REPO`. Every rank and that command
    run in ENGINE (its llm_api_options.yaml names ./draft), from whatever directory they were started:
    relative paths in the command are relative to ENGINE.
    """
    from dflash_trt.deploy.launch import launch

    code = launch(engine, backend=backend, check_only=check_only, host=host, grpc_port=grpc_port,
                  metrics_port=metrics_port, port_stride=port_stride, server_cmd=list(server_cmd),
                  model_repository=model_repository)
    sys.exit(code)


@click.command("doctor")
@click.argument("engine", type=click.Path(file_okay=False), required=False)
@click.option("--backend", type=click.Choice(["auto", "trtllm", "reference"]), default="auto", show_default=True,
              help="How ENGINE would be served (auto: trtllm for a GPU engine, reference for a CPU one).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
@friendly_errors
def doctor_cmd(engine: str | None, backend: str, as_json: bool) -> None:
    """Report what this environment has (Python, torch, TensorRT-LLM and its DFlash fields, tritonserver,
    GPUs, NVLink topology) and, for ENGINE, every reason it cannot be served here, each with its fix.

    Exits 1 when ENGINE cannot be served here. Every Slurm job runs it first.
    """
    from dflash_trt.deploy.doctor import run_doctor

    sys.exit(run_doctor(engine, backend=backend, as_json=as_json, echo=click.echo))


@click.command("ensure-repository")
@click.argument("engine", type=click.Path(file_okay=False))
@click.argument("repository", type=click.Path(file_okay=False))
@click.option("--backend", type=click.Choice(["auto", "tensorrt_llm", "reference"]), default="auto", show_default=True,
              help="Backend of a repository written here (as `deploy triton --backend`).")
@friendly_errors
def ensure_repository_cmd(engine: str, repository: str, backend: str) -> None:
    """Write the model REPOSITORY for ENGINE if it is missing, else check that it serves ENGINE (serve jobs run this)."""
    from dflash_trt.deploy.ensure_repo import ensure_repository

    done = ensure_repository(engine, repository, backend)  # type: ignore[arg-type]
    click.echo(f"[ensure-repository] {repository}: {done} for {engine}", err=True)


DEPLOY_COMMANDS = [slurm, wait_ready_cmd, ensure_repository_cmd]
COMMANDS = [launch_cmd, doctor_cmd]
