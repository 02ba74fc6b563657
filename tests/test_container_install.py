"""deploy/container/Dockerfile's install commands give a working dflash_trt on the image's Python.

No Docker engine or NGC image is reachable here, so the image is stood in for by a virtual
environment holding what the TensorRT-LLM release image brings that dflash-trt depends on:
torch (2.13 CPU here; 2.9 in the image) and the transformers TensorRT-LLM pins (4.57.1,
requirements.txt @ 000867d9b1ad in tests/upstream/tensorrt_llm_node.json), kept as they are. That
base is made once in ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/container-image-base; every run
then makes a FRESH virtual environment that sees the base (a .pth file, as the image's
site-packages), copies the repository as `COPY .` does, and runs the Dockerfile's own RUN line for
dflash-trt, read from the file (so the test and the Dockerfile cannot drift), with only its paths
moved into the temporary directory. That line ends in `dflash-trt --version` and `dflash-trt
doctor`. Then the fresh environment must do what model.py does inside tritonserver with the
TensorRT-LLM backend: write a repository for a GPU engine (built here from a checkpoint and
tokenizer saved by transformers 5) and encode a prompt with the engine's tokenizer under
transformers 4.57, token for token as this environment's transformers 5 does.
The flash-attn RUN (a CUDA build) cannot run here: its pin and import are checked as data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests.engine_fixtures import shared_tiny_engine
except ImportError:  # tests/ is not a package
    from engine_fixtures import shared_tiny_engine

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
NODE = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_node.json").read_text())
# numpy < 2: the same requirements.txt pins it (NODE["transformers_pin"]["note"]), so the image holds a
# numpy 1.x, which the Dockerfile's pin line carries into dflash-trt's install (Triton's Python
# backend needs it too)
BASE_PINS = ["torch==2.13.0", NODE["transformers_pin"]["requirement"],
             f"huggingface_hub=={NODE['transformers_pin']['companions']['huggingface_hub']}", "numpy<2"]


def run_instructions(text: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    logical = re.sub(r"\\\n\s*", " ", text)
    return [line[4:].strip() for line in logical.splitlines() if line.startswith("RUN ")]


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def image_base() -> Path:
    """A virtual environment with the image's torch and transformers, made once and cached."""
    cache = Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-trt")
    base = cache / "container-image-base"
    done = base / "dflash-trt-pins.txt"
    if done.is_file() and done.read_text().split() == BASE_PINS:
        return base
    shutil.rmtree(base, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True, timeout=300)
    proc = subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "--quiet", *BASE_PINS],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"could not make the image stand-in ({' '.join(BASE_PINS)}): "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    done.write_text("\n".join(BASE_PINS) + "\n")  # written last: a half-made base is remade
    return base


def _copy_build_context(dest: Path) -> None:
    """`COPY .` of the repository: the tracked files (.dockerignore leaves out only untracked ones)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv on the image stand-in after the Dockerfile's dflash-trt RUN line."""
    [run] = [r for r in run_instructions(DOCKERFILE.read_text()) if "/opt/dflash-trt/src[" in r]
    tmp = tmp_path_factory.mktemp("image")
    fresh, src = tmp / "venv", tmp / "opt" / "dflash-trt" / "src"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    (_site_packages(fresh) / "_image_base.pth").write_text(str(_site_packages(image_base())) + "\n")
    _copy_build_context(src)
    command = run.replace("/opt/dflash-trt", str(tmp / "opt" / "dflash-trt"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{fresh / 'bin'}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=900)
    return {"proc": proc, "venv": fresh, "env": env, "command": command, "tmp": tmp}


def test_the_dockerfiles_install_line_gives_a_working_dflash_trt(installed):
    proc = installed["proc"]
    assert proc.returncode == 0, (installed["command"], proc.stderr[-3000:])
    assert "dflash-trt, version" in proc.stdout  # `dflash-trt --version`, then `dflash-trt doctor`
    assert "ok       python" in proc.stdout
    pins = (installed["tmp"] / "opt" / "dflash-trt" / "image-pins.txt").read_text()
    assert NODE["transformers_pin"]["requirement"] in pins  # the image's transformers is kept, not upgraded


def test_the_installed_package_serves_a_gpu_engines_text_under_the_images_transformers(installed, tmp_path_factory,
                                                                                       tmp_path):
    from dflash_trt.engine.builder import build_engine, prepare
    from dflash_trt.engine.manifest import load_manifest
    from dflash_trt.engine.spec import resolve_spec
    from dflash_trt.serving.backends import _codec

    assert installed["proc"].returncode == 0
    source = shared_tiny_engine(tmp_path_factory)  # a checkpoint and tokenizer saved by transformers 5
    spec = resolve_spec(None, {"target": str(source / "target"), "draft": str(source / "draft"), "gpu": "h100",
                               "max_seq_len": 256, "dtype": "bfloat16"})
    engine = build_engine(prepare(spec), tmp_path / "engine", progress=False)
    py, env = str(installed["venv"] / "bin" / "python"), installed["env"]
    repo = subprocess.run([str(installed["venv"] / "bin" / "dflash-trt"), "deploy", "triton", str(engine), "--out",
                           str(tmp_path / "repo")], env=env, capture_output=True, text=True, timeout=300)
    assert repo.returncode == 0, repo.stderr[-2000:]
    code = ("import json, sys, transformers, dflash_trt\n"
            "from dflash_trt.engine.manifest import load_manifest\n"
            "from dflash_trt.serving.backends import _codec\n"
            "from pathlib import Path\n"
            "e = Path(sys.argv[1])\n"
            "print(json.dumps([transformers.__version__, dflash_trt.__file__, _codec(e, load_manifest(e)).encode(sys.argv[2])]))")
    prompt = "The capital of France is Paris."
    proc = subprocess.run([py, "-c", code, str(engine), prompt], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, where, ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert version == NODE["transformers_pin"]["requirement"].split("==")[1]
    assert str(installed["venv"]) in where  # the installed copy, not this checkout
    assert ids == _codec(engine, load_manifest(engine)).encode(prompt)


def test_the_image_carries_flash_attn_for_dflash_vanilla_attention():
    """Recorded: DFlash's VANILLA path imports exactly this (dflash_attention.py @ 0352547); the
    release image ships flash-attn-4 only (install_fa4.sh @ 22de8b3)."""
    text = DOCKERFILE.read_text()
    [run] = [r for r in run_instructions(text) if "flash-attn==" in r]
    version = re.search(r"^ARG FLASH_ATTN_VERSION=(\S+)$", text, re.M).group(1)
    assert version == NODE["flash_attn"]["pypi"].split()[1]
    assert "--no-build-isolation" in run and "${FLASH_ATTN_VERSION}" in run
    assert f'python -c "{NODE["dflash_attention"]["VANILLA"]["import"]}"' in run
    # built before dflash-trt is installed, so the image's `dflash-trt doctor` sees it
    runs = run_instructions(text)
    assert runs.index(run) < next(i for i, r in enumerate(runs) if "/opt/dflash-trt/src[" in r)
