"""Shared fixtures: tiny random pairs saved on disk, in the same formats real checkpoints use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# Test tiers (markers in pyproject.toml). `make test-fast` runs what none of these mark.
# embedded: loads the 135M embedded target (its conversion cache, seconds per load).
EMBEDDED_MODULES = {"test_embedded_target", "test_embedded_drafter", "test_embedded_batched", "test_embedded_prefix_cache"}
# integration: real servers and subprocesses (gRPC, HTTP, the CLI in a child process), ModelOpt
# quantization and export, drafter training runs.
INTEGRATION_MODULES = {
    "test_build_engine", "test_build_dequant", "test_build_gate_e2e", "test_train_batched", "test_train_tiny", "test_triton_server",
    "test_triton_cli", "test_bench_endpoint", "test_launch_ready",
    # transformers 4.57 installed from the package index into the cache; the Dockerfile's pip commands
    "test_transformers_generations", "test_container_install", "test_engine_from_anywhere",
    # speculators 0.9.0's config and model classes, in a child process (tests/oracles.py installs them)
    "test_speculators_configs",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in EMBEDDED_MODULES:
            item.add_marker(pytest.mark.embedded)
        if module in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)


def _save_pair(root: Path, target, draft) -> tuple[Path, Path]:
    """Saves a pair as the tests load it: root/target and root/draft."""
    tdir, ddir = root / "target", root / "draft"
    target.save_pretrained(tdir)
    draft.save_pretrained(ddir)
    return tdir, ddir


def save_tiny_pair(root: Path, arch: str = "llama", block_size: int = 8, draft_layers: int = 1, seed: int = 0,
                   **target_kw) -> tuple[Path, Path]:
    """A tiny target (HF directory, safetensors) and a random drafter (z-lab format) under root."""
    from dflash_trt.runtime.tiny import random_draft, tiny_target

    target = tiny_target(arch, seed=seed, **target_kw)
    draft = random_draft(target.config, num_layers=draft_layers, block_size=block_size, seed=seed)
    return _save_pair(root, target, draft)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a tiny Llama target and a random 1-layer drafter, block 8. Its
    drafts are (almost) never accepted: where a test claims acceptance, use rigged_pair_dirs."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


def save_rigged_pair(root: Path, arch: str = "llama", block_size: int = 8, **target_kw) -> tuple[Path, Path]:
    """save_tiny_pair's layout (float32), the pair rigged as tests/test_zlab_oracle.rig rigs it: the
    drafter proposes its anchor token and the target repeats tokens often, so long accepted runs
    happen beside rejections."""
    from dflash_trt.runtime.tiny import random_draft, tiny_target
    from tests.test_zlab_oracle import rig

    target = tiny_target(arch, seed=1, **target_kw)
    draft = random_draft(target.config, block_size=block_size, seed=3, num_key_value_heads=4)
    rig(target, draft)
    return _save_pair(root, target, draft)


@pytest.fixture(scope="session")
def rigged_pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a tiny Llama pair whose drafts are accepted (save_rigged_pair), block 8."""
    return save_rigged_pair(tmp_path_factory.mktemp("rigged_pair"))


# -- the real Triton servers most serving tests share (tests/triton_servers.py) -----------------------
@pytest.fixture(scope="session")
def triton_streaming(tmp_path_factory):
    """tritonserver over a DECOUPLED repository of the tiny engine (the only kind that streams),
    policy fixed (every step drafts K, so the speculation counters move), HTTP, metrics and the
    OpenAI front; shared by the session."""
    from tests.engine_fixtures import shared_tiny_engine
    from tests.triton_servers import serve_engine

    from dflash_trt.serving.repository import TritonRepoSettings

    served = serve_engine(shared_tiny_engine(tmp_path_factory), tmp_path_factory.mktemp("triton-streaming"),
                          TritonRepoSettings(decoupled=True, policy="fixed"))
    yield served
    served.stop()


@pytest.fixture(scope="session")
def triton_unary(tmp_path_factory):
    """tritonserver over the default repository of the tiny engine: not decoupled (as upstream's
    model.yaml), so it answers unary ModelInfer and HTTP infer; the serving default policy."""
    from tests.engine_fixtures import shared_tiny_engine
    from tests.triton_servers import serve_engine

    served = serve_engine(shared_tiny_engine(tmp_path_factory), tmp_path_factory.mktemp("triton-unary"))
    yield served
    served.stop()
