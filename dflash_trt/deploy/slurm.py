"""`dflash-trt deploy slurm`: sbatch scripts (serve, build, bench) for an engine directory.

The templates live in the top-level `deploy/` folder (`{{name}}` placeholders, no Jinja); this
module computes the values from the engine's parallel mapping and the user's options.

Layout rules (TensorRT-LLM: one MPI rank per GPU, world size == TP x PP):
    trtllm:    ntasks = TP x PP, nodes = ceil(ntasks / gpus_per_node), ntasks-per-node = ntasks / nodes,
               one GPU per task (--gpus-per-node = ntasks-per-node unless given)
    reference: ntasks = --replicas (independent replicas, one endpoint per rank), no GPU request
               unless --gpus-per-node is given (the reference runtime runs on CPUs)
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.engine.manifest import EngineManifest, Mapping, load_manifest
from dflash_trt.errors import DFlashError
from dflash_trt.fsutil import write_json_atomic, write_text_atomic

Backend = Literal["trtllm", "reference"]
Server = Literal["tritonserver", "trtllm-serve"]
JOBS = ("serve", "build", "bench")
CONFIG_NAME = "deploy_slurm.json"  # the resolved options, recorded beside the scripts
SPEC_NAME = "build_spec.yaml"


def default_dflash_bin() -> str:
    """The `dflash-trt` next to the running interpreter: jobs do not inherit an activated venv."""
    candidate = Path(sys.executable).parent / "dflash-trt"
    return str(candidate if candidate.exists() else Path(sys.argv[0]).resolve())


def container_image_record() -> dict:
    """deploy/container/image.json: the image the jobs default to, its base and why."""
    from dflash_trt.resources import resource_dir

    return json.loads((resource_dir("deploy") / "container" / "image.json").read_text(encoding="utf-8"))


def default_container_image() -> str:
    return container_image_record()["default_image"]


class SlurmOptions(BaseModel):
    """Everything `dflash-trt deploy slurm` accepts (CLI flags); recorded as deploy_slurm.json."""

    model_config = ConfigDict(extra="forbid")

    out: Path = Path("slurm")
    backend: Backend = "trtllm"
    server: Server = "tritonserver"
    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm time limit, e.g. 04:00:00
    nodes: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    replicas: int = Field(1, ge=1)  # reference backend: independent servers, one per rank
    exclusive: bool | None = None  # None: whole nodes for the TensorRT-LLM backend, shared for reference
    # None: no container (the steps run `dflash_bin` on the host)
    container_image: str | None = Field(default_factory=default_container_image)
    container_name: str = Field("dflash-trt", pattern=r"^[A-Za-z0-9_.-]+$")  # imported once, reused by every step
    container_mounts: str | None = None
    model_repository: Path | None = None  # default <out>/triton_repo
    build_gpus: int | None = Field(None, ge=0)  # None: 1 for a GPU engine, 0 for a CPU one
    build_out: Path | None = None  # None: <engine parent>/<engine name>-rebuilt
    grpc_port: int = Field(8001, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)
    metrics_port: int = Field(8002, ge=1, le=65535)
    port_stride: int = Field(10, ge=1)
    mpi: str = "pmix"  # srun --mpi=...; `pmi2` for the pip mpich
    ready_timeout: int = Field(1800, ge=1)  # seconds until the serve job gives up
    dflash_bin: str = Field(default_factory=default_dflash_bin)
    container_dflash_bin: str = "dflash-trt"  # the CLI inside --container-image
    bench_args: str = ""  # extra arguments for `dflash-trt bench`


class Layout(BaseModel):
    """What the serve job asks Slurm for."""

    model_config = ConfigDict(frozen=True)

    nodes: int
    ntasks: int
    tasks_per_node: int
    gpus_per_node: int  # 0: no GPU request (no --gpus-per-node line)


def plan_layout(mapping: Mapping, opts: SlurmOptions) -> Layout:
    """Nodes, tasks and GPUs for the serve job (DFlashError with the fix when impossible)."""
    if opts.backend == "reference":
        nodes = opts.nodes or 1
        if opts.replicas % nodes:
            raise DFlashError(f"--replicas {opts.replicas} does not split evenly over --nodes {nodes}; "
                              f"use a multiple of {nodes} replicas")
        return Layout(nodes=nodes, ntasks=opts.replicas, tasks_per_node=opts.replicas // nodes,
                      gpus_per_node=opts.gpus_per_node or 0)
    world = mapping.world_size
    gpn = opts.gpus_per_node or mapping.gpus_per_node
    nodes = opts.nodes or -(-world // gpn)
    if world % nodes:
        raise DFlashError(f"TP x PP = {mapping.tp} x {mapping.pp} = {world} ranks do not split evenly over "
                          f"{nodes} nodes; pick --nodes dividing {world}")
    per_node = world // nodes
    if per_node > gpn:
        raise DFlashError(f"{world} ranks on {nodes} node(s) need {per_node} GPUs per node but --gpus-per-node is "
                          f"{gpn}; use --nodes {-(-world // gpn)} or more GPUs per node")
    # One GPU per rank; a larger explicit --gpus-per-node is honoured (e.g. whole-node allocations),
    # and an explicit 0 requests none (clusters without GPU gres: the GPUs come with the node).
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else per_node
    return Layout(nodes=nodes, ntasks=world, tasks_per_node=per_node, gpus_per_node=gpus)


_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def render(template: str, values: dict[str, object]) -> str:
    """Fill `{{name}}` placeholders; a placeholder without a value is a bug, never left in a script."""

    def fill(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise KeyError(f"template placeholder {{{{{m.group(1)}}}}} has no value")
        return str(values[m.group(1)])

    return _PLACEHOLDER.sub(fill, template)


def _template(name: str) -> str:
    from dflash_trt.resources import resource_dir

    return (resource_dir("deploy") / f"{name}.sbatch").read_text(encoding="utf-8")


def _sbatch_lines(opts: SlurmOptions, gpus_per_node: int, exclusive: bool = False) -> str:
    lines = [f"--partition={opts.partition}" if opts.partition else "",
             f"--account={opts.account}" if opts.account else "",
             f"--time={opts.time}" if opts.time else "",
             f"--gpus-per-node={gpus_per_node}" if gpus_per_node else "",
             "--exclusive" if exclusive else ""]
    return "".join(f"#SBATCH {line}\n" for line in lines if line)


def _mount_list(opts: SlurmOptions, paths: list[Path]) -> list[str]:
    """The user's mounts plus each of `paths` at its own path (skipping those already covered)."""
    mounts = [m for m in (opts.container_mounts or "").split(",") if m]
    for path in paths:
        covered = any(path == Path(m.split(":")[0]) or Path(m.split(":")[0]) in path.parents for m in mounts)
        if not covered:
            mounts.append(f"{path}:{path}")
    return mounts


def container_flags(opts: SlurmOptions, workdir: Path, mount_paths: list[Path]) -> str:
    """pyxis/enroot flags for every srun step ("" without a container).

    --container-name makes pyxis import the image once per job and reuse the container in every
    later step; paths are mounted at their own paths, so the same absolute paths work inside.
    """
    if not opts.container_image:
        return ""
    q = shlex.quote
    return (f"--container-image={q(opts.container_image)} --container-name={q(opts.container_name)} "
            f"--container-mounts={q(','.join(_mount_list(opts, mount_paths)))} "
            f"--container-workdir={q(str(workdir))}")


def _job_name(manifest: EngineManifest, opts: SlurmOptions) -> str:
    base = opts.job_name or re.sub(r"[^A-Za-z0-9_.-]+", "-", manifest.name).strip("-") or "dflash"
    return base


def build_sources(manifest: EngineManifest) -> list[Path]:
    """Files the build job reads: the checkpoints (and calibration prompts) named in the recorded spec."""
    spec = manifest.spec
    paths = [spec.get("target"), spec.get("draft"), (spec.get("calibration") or {}).get("prompts")]
    found = []
    for p in paths:
        if isinstance(p, str) and p:
            path = Path(p).expanduser()
            if path.exists():
                found.append(path.resolve())
    return found


def build_output(engine_dir: Path, manifest: EngineManifest, opts: SlurmOptions) -> Path:
    return (opts.build_out or engine_dir.parent / f"{engine_dir.name}-rebuilt").resolve()


def render_jobs(engine_dir: str | Path, opts: SlurmOptions) -> dict[str, str]:
    """{'serve': script, 'build': script, 'bench': script} for the engine (nothing written)."""
    from dflash_trt.engine.llm_api import tensorrt_llm_refusal

    engine_dir = Path(engine_dir).resolve()
    manifest = load_manifest(engine_dir)
    refusal = tensorrt_llm_refusal(manifest)
    if opts.backend == "trtllm" and refusal:
        raise DFlashError(f"--backend trtllm: {refusal} (deploy slurm --backend pytorch)")
    out = opts.out.resolve()
    mapping = manifest.mapping
    layout = plan_layout(mapping, opts)
    log_dir = out / "logs"
    name = _job_name(manifest, opts)
    q = shlex.quote
    repo = (opts.model_repository or out / "triton_repo").resolve()
    step_bin = opts.container_dflash_bin if opts.container_image else opts.dflash_bin
    exclusive = opts.exclusive if opts.exclusive is not None else opts.backend == "trtllm"
    common = {"engine_name": manifest.name, "log_dir": q(str(log_dir)), "dflash_bin": q(opts.dflash_bin),
              "step_bin": q(step_bin), "ready_timeout": opts.ready_timeout}

    layout_desc = f"TP {mapping.tp} x PP {mapping.pp} = {mapping.world_size} ranks"
    if opts.backend == "reference":
        serve_cmd = (f"\"$STEP_DFLASH\" launch \"$ENGINE\" --backend reference --host 0.0.0.0 "
                     f"--grpc-port {opts.grpc_port} --metrics-port {opts.metrics_port} "
                     f"--port-stride {opts.port_stride} --model-repository \"$REPO\"")
        preflight = ""
        endpoint_count, port, scheme, path = layout.ntasks, opts.grpc_port, "", ""
        endpoint_rule = (f"every rank is a replica serving gRPC on {opts.grpc_port} + rank x {opts.port_stride} "
                         f"(metrics {opts.metrics_port} + rank x {opts.port_stride})")
        task_note = " (reference backend: one independent replica per task instead)"
        layout_desc = f"{layout.ntasks} reference replica(s); engine built for {layout_desc}"
        repo_backend = "reference"
    else:
        # Every rank checks world size == TP x PP and that TensorRT-LLM imports, in its own short
        # step, BEFORE the server starts: a mismatch fails the job in seconds instead of hanging.
        preflight = ("# Preflight on EVERY rank: MPI world size == TP x PP and TensorRT-LLM importable.\n"
                     "\"${SRUN[@]}\" --label \"$STEP_DFLASH\" launch \"$ENGINE\" --backend trtllm --check\n")
        if opts.server == "tritonserver":
            serve_cmd = (f"trtllm-llmapi-launch tritonserver --model-repository=\"$REPO\" "
                         f"--grpc-port={opts.grpc_port} --http-port={opts.http_port} "
                         f"--metrics-port={opts.metrics_port}")
            port, scheme, path = opts.grpc_port, "", ""
            endpoint_rule = f"rank 0 (TensorRT-LLM leader) serves Triton gRPC on port {opts.grpc_port}"
        else:
            serve_cmd = (f"trtllm-llmapi-launch trtllm-serve \"$ENGINE\"/{q(manifest.target.path)} "
                         f"--host 0.0.0.0 --port {opts.http_port} --tp_size {mapping.tp} "
                         f"--pp_size {mapping.pp} --ep_size {mapping.ep} "
                         f"--config \"$ENGINE\"/{q(manifest.llm_api_options)}")
            port, scheme, path = opts.http_port, "http://", "/health"
            endpoint_rule = f"rank 0 (TensorRT-LLM leader) serves OpenAI HTTP on port {opts.http_port}"
        endpoint_count = 1
        task_note = ""
        repo_backend = "tensorrt_llm"
    # trtllm-serve reads the engine directly; every other server reads the model repository.
    ensure_repo = "" if opts.backend == "trtllm" and opts.server == "trtllm-serve" else (
        "echo \"[serve] model repository $REPO (written from the engine if missing, checked if present)\"\n"
        f"\"${{ONE[@]}}\" \"$STEP_DFLASH\" deploy ensure-repository \"$ENGINE\" \"$REPO\" --backend {repo_backend}\n")
    serve_mounts = [engine_dir, out] + ([] if out in repo.parents else [repo.parent])
    serve = render(_template("serve"), {
        **common, "job_name": f"{name}-serve", "script_path": q(str(out / "serve.sbatch")), "layout": layout_desc,
        "backend": opts.backend if opts.backend == "reference" else f"trtllm/{opts.server}", "task_note": task_note,
        "nodes": layout.nodes, "ntasks": layout.ntasks, "tasks_per_node": layout.tasks_per_node,
        "sbatch_optional": _sbatch_lines(opts, layout.gpus_per_node, exclusive), "engine_dir": q(str(engine_dir)),
        "repo": q(str(repo)), "container_flags": container_flags(opts, engine_dir, serve_mounts),
        "doctor_backend": "reference" if opts.backend == "reference" else "trtllm", "ensure_repository": ensure_repo,
        "ready_port": port, "port_stride": opts.port_stride, "mpi": q(opts.mpi), "preflight": preflight,
        "serve_command": serve_cmd, "endpoint_rule": endpoint_rule, "endpoint_count": endpoint_count,
        "url_scheme": scheme, "url_path": path,
    })

    # The build (ModelOpt calibration, export) is one process: it gets the GPUs it uses and no more.
    build_gpus = opts.build_gpus if opts.build_gpus is not None else (0 if manifest.gpu == "cpu" else 1)
    spec_path = out / SPEC_NAME
    build_out = build_output(engine_dir, manifest, opts)
    # The output's PARENT is mounted: the build writes a temporary directory beside it and renames it
    # into place, so the engine lands on the host filesystem and outlives the container and the job.
    build_mounts = [out, build_out.parent, *build_sources(manifest)]
    build = render(_template("build"), {
        **common, "job_name": f"{name}-build", "script_path": q(str(out / "build.sbatch")),
        "sbatch_optional": _sbatch_lines(opts, build_gpus, exclusive and build_gpus > 0),
        "spec_path": q(str(spec_path)), "build_out": q(str(build_out)),
        "container_flags": container_flags(opts, out, build_mounts),
        "build_device": "auto" if build_gpus else "cpu", "build_gpus": build_gpus,
    })
    bench = render(_template("bench"), {
        **common, "job_name": f"{name}-bench", "script_path": q(str(out / "bench.sbatch")),
        "sbatch_optional": _sbatch_lines(opts, 0), "bench_args": opts.bench_args,
        "container_flags": container_flags(opts, out, [out]),
    })
    return {"serve": serve, "build": build, "bench": bench}


def write_jobs(engine_dir: str | Path, opts: SlurmOptions) -> dict[str, Path]:
    """Render and write the scripts, the build spec and the resolved options (each atomically)."""
    scripts = render_jobs(engine_dir, opts)  # renders everything first: an error writes nothing
    manifest = load_manifest(engine_dir)
    out = opts.out.resolve()
    # sbatch does not create the folder of --output: a missing one makes the job fail silently.
    (out / "logs").mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for job, text in scripts.items():
        path = out / f"{job}.sbatch"
        write_text_atomic(path, text)
        path.chmod(0o755)
        paths[job] = path
    write_text_atomic(out / SPEC_NAME, yaml.safe_dump(manifest.spec, sort_keys=False))
    record = opts.model_dump(mode="json")
    record["engine_dir"] = str(Path(engine_dir).resolve())
    write_json_atomic(out / CONFIG_NAME, record)
    return paths


def sbatch(script: Path, *args: str, dependency: str | None = None) -> str:
    """Submit with `sbatch --parsable`; return the job id (DFlashError with sbatch's reason)."""
    cmd = ["sbatch", "--parsable"]
    if dependency:
        cmd.append(f"--dependency={dependency}")
    cmd += [str(script), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise DFlashError("sbatch not found: run on a Slurm login node, or drop --submit and copy the scripts there")
    except subprocess.TimeoutExpired:
        raise DFlashError("sbatch did not answer within 60 s: is slurmctld up? (`sinfo`)")
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise DFlashError(f"sbatch {script.name} failed: {reason}")
    return proc.stdout.strip().split(";")[0]  # --parsable: "jobid" or "jobid;cluster"


def describe(opts: SlurmOptions) -> str:
    return json.dumps(opts.model_dump(mode="json"), indent=2)
