"""`dflash-trt deploy triton`, `dflash-trt serve`, `dflash-trt client`. Heavy imports stay inside."""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_trt.cli_helpers import (DRAFT_METHOD_HELP, draft_len_schedule_option, draft_method_option, friendly_errors,
                                    max_draft_len_option, policy_option, prefix_cache_options)
from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import DTYPE_NAMES
from dflash_trt.serving.backends import BACKEND_ALIASES, BACKENDS, normalize_backend
from dflash_trt.serving.limits import DEFAULT_MAX_STREAMS
from dflash_trt.speculation import DEFAULT_DRAFT_METHOD

_BACKEND_HELP = ("Runtime inside the model: auto = TensorRT-LLM when it is importable and has DFlash, else pytorch; "
                 "tensorrt_llm = require it; pytorch = dflash-trt's own runtime: the batched runtime with --policy "
                 "(the reference loop, one request at a time, for pairs it cannot run). `reference` = pytorch.")


def backend_option(help: str):
    """`--backend`: auto | tensorrt_llm | pytorch (`reference`, the old name of pytorch, still accepted)."""
    return click.option("--backend", type=click.Choice([*BACKENDS, *BACKEND_ALIASES]), default="auto",
                        show_default=True, callback=lambda ctx, param, value: normalize_backend(value), help=help)


def _settings(**kw):
    from dflash_trt.serving.repository import resolve_repo_settings

    return resolve_repo_settings(kw)


def _repo_options(fn):
    for opt in reversed([
        click.option("--model-name", default="dflash", show_default=True, help="Triton model name (folder name)."),
        backend_option(_BACKEND_HELP),
        click.option("--default-max-tokens", type=click.IntRange(min=1), default=None,
                     help="max_tokens when a request sends none [default: min(256, max_seq_len / 2)]."),
        click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Requests that may wait for the runtime before new ones get UNAVAILABLE."),
        max_draft_len_option("K: the most drafts a step verifies [default: the engine's limits.max_draft_len; "
                             "lower only: the engine's memory plan holds that many]."),
        policy_option("adaptive", "pytorch backend: adaptive = k <= K per step from measured costs (never slower "
                                  "than plain decoding); fixed = K every step (reproducible tau); schedule = the "
                                  "draft-length schedule's k at the step's batch size (--draft-len-schedule, else "
                                  "the engine's: as the TensorRT-LLM node does). TensorRT-LLM follows its "
                                  "llm_api_options.yaml."),
        draft_method_option(DRAFT_METHOD_HELP + f" [default: {DEFAULT_DRAFT_METHOD} on the pytorch backend, match on "
                                                "tensorrt_llm, the only one its engine runs]"),
        draft_len_schedule_option(),
        click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None,
                     help="Weights dtype for the pytorch backend [default: the engine's: its 16-bit dtype for a GPU "
                          "engine, float32 for a CPU one]."),
        click.option("--device", default=None,
                     help="Device for the pytorch backend (cpu, cuda, cuda:N) [default: the engine's: cuda for a GPU "
                          "engine, cpu for a CPU one; not this machine's]."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=None,
                     help="pytorch backend: capture the greedy draft and verify passes as CUDA graphs at load and "
                          "replay them [default: on for --device cuda, off on cpu]."),
        click.option("--torch-compile/--no-torch-compile", default=None,
                     help="pytorch backend: the target's and the drafter's layers through torch.compile, compiled at "
                          "load (fewer, fused kernels; needs Triton on a GPU) [default: off]."),
        click.option("--decoupled/--no-decoupled", default=False, show_default=True,
                     help="Decoupled transaction policy (model.yaml triton_config, as tensorrtllm_backend's llmapi "
                          "model): only a decoupled model streams; only a model that is not decoupled answers "
                          "unary ModelInfer and HTTP infer."),
    ]):
        fn = opt(fn)
    return prefix_cache_options(fn)


@click.command("triton")
@click.argument("engine", type=click.Path(file_okay=False))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@_repo_options
@click.option("--engine-path", default=None,
              help="The engine directory as the server will see it (e.g. its path inside a container) "
                   "[default: ENGINE, resolved].")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@friendly_errors
def triton(engine: str, out: str, model_name: str, backend: str, default_max_tokens: int | None, max_queue: int,
           max_draft_len: int | None, policy: str, draft_method: str | None, draft_len_schedule: str | None,
           dtype: str | None, device: str | None, cuda_graphs: bool | None, torch_compile: bool | None,
           decoupled: bool, engine_path: str | None, force: bool, prefix_cache: bool | None,
           prefix_cache_mib: float | None) -> None:
    """Write a Triton model repository for ENGINE in tensorrtllm_backend's llmapi shape (Python backend).

    Serve it with `tritonserver --model-repository OUT` (TensorRT-LLM container) or `dflash-trt serve
    --model-repository OUT` anywhere else.
    """
    from dflash_trt.engine.verify import verify_engine
    from dflash_trt.serving.repository import generate_repository

    settings = _settings(model_name=model_name, backend=backend, default_max_tokens=default_max_tokens,
                         max_queue=max_queue, max_draft_len=max_draft_len, policy=policy, draft_method=draft_method,
                         draft_len_schedule=draft_len_schedule, dtype=dtype, device=device, cuda_graphs=cuda_graphs,
                         torch_compile=torch_compile, decoupled=decoupled, engine_path=engine_path,
                         prefix_cache=prefix_cache, prefix_cache_mib=prefix_cache_mib)
    if Path(engine).is_dir():  # (a missing one is named by generate_repository)
        verify_engine(engine)  # an altered engine is refused here, not by the server at startup
    click.echo(f"[deploy triton] engine={Path(engine).resolve()} out={out} "
               + " ".join(f"{k}={v}" for k, v in settings.model_dump().items()), err=True)
    repo = generate_repository(engine, out, settings, overwrite=force)
    click.echo(str(repo / settings.model_name / "config.pbtxt"))


def _default_engine() -> Path:
    """With no SOURCE: the one engine `dflash-trt build` (no arguments) wrote under ./engines."""
    from dflash_trt.engine.manifest import MANIFEST_NAME

    root = Path("engines")
    found = sorted(p for p in root.iterdir() if (p / MANIFEST_NAME).is_file()) if root.is_dir() else []
    if len(found) == 1:
        click.echo(f"[serve] no SOURCE given: serving {found[0]}", err=True)
        return found[0]
    if not found:
        raise DFlashError("no SOURCE given and no engine under ./engines; run `dflash-trt build` first or pass an "
                          "engine directory / --model-repository")
    raise DFlashError(f"no SOURCE given and several engines under ./engines ({', '.join(p.name for p in found)}); "
                      f"pass one of them")


@click.command()
@click.argument("source", required=False, type=click.Path(file_okay=False))
@click.option("--model-repository", type=click.Path(file_okay=False), default=None,
              help="Model repository to serve (from `dflash-trt deploy triton`). Or give an engine directory as "
                   "SOURCE: it is turned into a temporary repository.")
@click.option("--address", "--grpc-address", "address", default="127.0.0.1", show_default=True,
              help="Address every endpoint binds (0.0.0.0 to accept remote clients).")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=8001, show_default=True,
              help="Triton's gRPC port (KServe v2); 0 picks a free one.")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help="Triton's HTTP port (KServe v2 REST, the generate extension; tritonserver's default is 8000); "
                   "0 picks a free one. [default: off]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=8002, show_default=True,
              help="Triton's Prometheus /metrics port (nv_inference_*, dflash_*, vLLM's and TensorRT-LLM's "
                   "speculation counters); 0 picks a free one.")
@click.option("--allow-metrics/--no-allow-metrics", default=True, show_default=True, help="Serve Prometheus metrics.")
@click.option("--openai-port", type=click.IntRange(0, 65535), default=9000, show_default=True,
              help="The OpenAI-compatible front (/v1/models, /v1/completions, /v1/chat/completions), a client of "
                   "Triton, as Triton's own OpenAI frontend (port 9000); 0 picks a free one.")
@click.option("--openai/--no-openai", "openai_on", default=True, show_default=True,
              help="Start the OpenAI-compatible front beside tritonserver.")
@click.option("--load-model", "load_models", multiple=True, help="Load only this model (repeatable).")
@click.option("--exit-timeout-secs", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM/SIGINT, time in-flight requests get to finish (Triton's --exit-timeout-secs); a "
                   "second signal stops at once.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=1), default=900.0, show_default=True,
              help="Seconds tritonserver gets to load every model before `serve` gives up.")
@click.option("--max-streams", type=click.IntRange(min=1), default=DEFAULT_MAX_STREAMS, show_default=True,
              help="Requests in flight through the OpenAI front; past it HTTP 429. (Triton's own endpoints are "
                   "limited by the model's --max-queue: UNAVAILABLE past it.)")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write 'host:grpc_port metrics_port http_port openai_port' here once serving (0: not served).")
@_repo_options
@friendly_errors
def serve(source: str | None, model_repository: str | None, address: str, grpc_port: int, http_port: int | None,
          metrics_port: int, allow_metrics: bool, openai_port: int, openai_on: bool, load_models: tuple[str, ...],
          exit_timeout_secs: float, ready_timeout_s: float, max_streams: int, ready_file: str | None, model_name: str,
          backend: str, default_max_tokens: int | None, max_queue: int, max_draft_len: int | None, policy: str,
          draft_method: str | None, draft_len_schedule: str | None, dtype: str | None, device: str | None,
          cuda_graphs: bool | None, torch_compile: bool | None, decoupled: bool, prefix_cache: bool | None,
          prefix_cache_mib: float | None) -> None:
    """Serve a model repository (or an engine directory) on the real Triton Inference Server.

    Runs tritonserver (on PATH, in /opt/tritonserver as in NVIDIA's containers, or the one `make setup`
    installed) over the repository, whose model.py runs in Triton's Python backend, and the OpenAI-compatible
    front beside it. Stopping `serve` stops everything it started. The options --model-name, --backend,
    --default-max-tokens, --max-queue, --max-draft-len, --policy, --draft-method, --draft-len-schedule,
    --dtype, --device, --cuda-graphs, --torch-compile, --decoupled and --prefix-cache(-mib) apply when SOURCE is
    an engine directory.
    """
    import logging
    import shutil
    import sys
    import tempfile

    from dflash_trt.serving.serve import run_serve
    from dflash_trt.serving.tritonserver import ServerPorts, require_tritonserver

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if source and model_repository:
        raise DFlashError("give either SOURCE or --model-repository, not both")
    install = require_tritonserver()  # before any repository is written: one line naming what is missing
    tmp = None
    if model_repository is None:
        from dflash_trt.engine.manifest import MANIFEST_NAME
        from dflash_trt.serving.repository import generate_repository

        engine = Path(source) if source else _default_engine()
        if not (engine / MANIFEST_NAME).is_file() and any(engine.glob("*/config.pbtxt")):
            model_repository = str(engine)  # SOURCE was a repository after all
        else:
            settings = _settings(model_name=model_name, backend=backend, default_max_tokens=default_max_tokens,
                                 max_queue=max_queue, max_draft_len=max_draft_len, policy=policy,
                                 draft_method=draft_method, draft_len_schedule=draft_len_schedule, dtype=dtype,
                                 device=device, cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                                 decoupled=decoupled, prefix_cache=prefix_cache, prefix_cache_mib=prefix_cache_mib)
            _check_device_here(engine, settings)
            tmp = Path(tempfile.mkdtemp(prefix="dflash-trt-repo-"))
            model_repository = str(generate_repository(engine, tmp / "repo", settings))
    ports = ServerPorts(grpc=grpc_port, http=http_port, metrics=metrics_port if allow_metrics else None,
                        address=address)
    click.echo(json.dumps({"model_repository": model_repository, "tritonserver": str(install.binary),
                           "found": install.origin, "grpc": f"{address}:{grpc_port}", "http_port": http_port,
                           "metrics_port": ports.metrics, "openai_port": openai_port if openai_on else None,
                           "load_model": list(load_models) or "all", "exit_timeout_secs": exit_timeout_secs}),
               err=True)
    try:
        code = run_serve(model_repository, ports, openai_port=openai_port if openai_on else None,
                         models=list(load_models) or None, exit_timeout_s=exit_timeout_secs, ready_file=ready_file,
                         max_streams=max_streams, ready_timeout_s=ready_timeout_s)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(code)


def _check_device_here(engine: Path, settings) -> None:
    """`serve ENGINE` runs the pytorch backend on THIS machine: a device it lacks is one line now,
    before tritonserver starts (model.py checks again, for any repository)."""
    from dflash_trt.checkpoints.placement import runtime_device
    from dflash_trt.engine.manifest import MANIFEST_NAME, load_manifest

    if (engine / MANIFEST_NAME).is_file():
        resolved = settings.for_engine(load_manifest(engine))
        if resolved.backend == "pytorch":
            runtime_device(resolved.device)


@click.command("setup-tritonserver")
@click.option("--wheel", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Install from this nvidia-pytriton wheel file instead of downloading it.")
@click.option("--force", is_flag=True, help="Reinstall even when an install is there.")
@friendly_errors
def setup_tritonserver(wheel: str | None, force: bool) -> None:
    """Install the real Triton Inference Server (2.51, with its Python backend) for machines without
    NVIDIA's container: from PyPI's nvidia-pytriton wheel into the dflash-trt cache (`make setup` runs it).
    Prints where it is, then what `doctor` would say of it."""
    from dflash_trt.serving.triton_install import install
    from dflash_trt.serving.tritonserver import find_tritonserver, stub_problems

    root = install(wheel=Path(wheel) if wheel else None, force=force)
    found = find_tritonserver()
    click.echo(f"tritonserver installed in {root}; `dflash-trt serve` runs {found.binary if found else '?'} "
               f"({found.origin if found else 'none found'})")
    for problem in stub_problems(found):
        click.echo(f"warning: {problem}", err=True)


@click.command()
@click.argument("prompt")
@click.option("--url", default="localhost:8001", show_default=True,
              help="host:port: a Triton gRPC server (`dflash-trt serve`, tritonserver); http[s]://host:port: an "
                   "OpenAI-compatible server (`dflash-trt serve`'s front on :9000, vllm serve, trtllm-serve).")
@click.option("--raw", is_flag=True,
              help="Send PROMPT as raw text, no chat template (as upstream's llmapi clients do; OpenAI: "
                   "/v1/completions). [default: one chat turn]")
@click.option("--model", "model", default="dflash", show_default=True, help="Model name in the repository.")
@click.option("--stream/--no-stream", default=False, show_default=True, help="Print text as it is accepted.")
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate [default: the model's].")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy) [default: 0].")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass [default: 1].")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the output ends before it.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the final response.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, finish_reason, statistics).")
@friendly_errors
def client(prompt: str, url: str, model: str, stream: bool, max_tokens: int | None, temperature: float | None,
           top_p: float | None, seed: int | None, stop: tuple[str, ...], timeout_s: float, as_json: bool,
           raw: bool) -> None:
    """Send PROMPT to a Triton gRPC or an OpenAI-compatible server; print the answer and its DFlash statistics.

    PROMPT goes as one user turn through the target's chat template (gRPC: text_input_format=user, applied by
    the model; OpenAI: /v1/chat/completions), as `dflash-trt generate` encodes it; --raw sends it as it is."""
    from dflash_trt.serving.client import generate, per_position_acceptance
    from dflash_trt.serving.openai_client import generate_openai

    printer = (lambda t: click.echo(t, nl=False)) if stream and not as_json else None
    send = generate_openai if url.startswith(("http://", "https://")) else generate
    result = send(url, prompt, model=model, stream=stream, on_text=printer, timeout_s=timeout_s, raw=raw,
                  max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)
    ppa = per_position_acceptance(result.stats)
    if as_json:
        click.echo(json.dumps({"text": result.text, "finish_reason": result.finish_reason, **result.stats,
                               "per_position_acceptance": ppa, "ttft_s": result.ttft_s, "latency_s": result.latency_s}))
        return
    click.echo("" if stream else result.text)
    s = result.stats
    # accepted / drafted at each draft position (1 = the first token after the anchor)
    positions = "-" if ppa is None else " ".join(f"{x:.2f}" for x in ppa) or "none drafted"
    click.echo(
        f"\n[{'openai' if send is generate_openai else 'triton'}] finish={result.finish_reason} "
        f"tokens={s.get('num_output_tokens', '?')} tau={s.get('tau', 0.0):.2f} acceptance_rate={s.get('acceptance_rate', 0.0):.2f} "
        f"drafted={s.get('total_draft_tokens', '?')} accepted={s.get('total_accepted_draft_tokens', '?')} "
        f"per-position acceptance=[{positions}] ttft={result.ttft_s * 1e3:.0f}ms latency={result.latency_s * 1e3:.0f}ms",
        err=True)


DEPLOY_COMMANDS = [triton]
COMMANDS = [serve, client, setup_tritonserver]
