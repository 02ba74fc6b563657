"""Engine directories for the Slurm / launcher tests, written without `dflash-trt build`.

`manifest_engine` writes only a valid dflash_trt.json (enough for script generation, which reads
nothing else); `served_engine` is a complete tiny engine (weights, tokenizer, manifest) that the
reference server can load, with the parallel mapping the test needs. Swap both for the real
builder once `dflash-trt build` can target a given mapping on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.engine.manifest import MANIFEST_NAME, EngineManifest, load_manifest


def manifest_engine(root: Path, tp: int, pp: int, gpus_per_node: int = 8, name: str = "demo-engine") -> Path:
    """An engine directory holding only its manifest, for the given TP x PP mapping."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = EngineManifest(
        name=name, created="2026-11-22T00:00:00+00:00", gpu="b300",
        mapping={"tp": tp, "pp": pp, "ep": 1, "gpus_per_node": gpus_per_node},
        quantization={"weights": "nvfp4", "kv_cache": "fp8"}, limits={},
        target={"architecture": "GptOssForCausalLM", "num_layers": 36, "hidden_size": 2880, "vocab_size": 201088},
        draft={"block_size": 16, "mask_token_id": 200000, "target_layer_ids": [1, 9, 17, 25, 33]},
        min_tensorrt_llm_version="1.3.0rc27", versions={"dflash_trt": "test"},
        spec={"name": name, "gpu": "b300", "tp": tp, "pp": pp, "gpus_per_node": gpus_per_node, "quant": "nvfp4"},
        files={},
    )
    (root / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    # the YAML a repository's model.yaml is made from (llm_kwargs); its keys are checked elsewhere
    (root / manifest.llm_api_options).write_text(
        f"tensor_parallel_size: {tp}\npipeline_parallel_size: {pp}\n"
        "speculative_config: {decoding_type: DFlash, max_draft_len: 7, speculative_model: ./draft}\n",
        encoding="utf-8")
    return root


def with_mapping(engine: Path, tp: int, pp: int = 1, gpus_per_node: int = 8) -> Path:
    """Rewrite an engine's manifest with another parallel mapping (weights untouched)."""
    manifest = load_manifest(engine)
    mapping = manifest.mapping.model_copy(update={"tp": tp, "pp": pp, "gpus_per_node": gpus_per_node})
    data = manifest.model_copy(update={"mapping": mapping}).model_dump(mode="json")
    (engine / MANIFEST_NAME).write_text(json.dumps(data, indent=2), encoding="utf-8")
    return engine


def gpu_copy(engine: Path, dest: Path, gpu: str = "h100", dtype: str = "bfloat16") -> Path:
    """A copy of `engine` whose manifest records a GPU build (`gpu`, `dtype`): the paths that hand an
    engine to TensorRT-LLM refuse a CPU one (engine/llm_api.tensorrt_llm_refusal). Weights unchanged."""
    import shutil

    shutil.copytree(engine, dest)
    manifest = load_manifest(dest)
    quantization = manifest.quantization.model_copy(update={"dtype": dtype})
    data = manifest.model_copy(update={"gpu": gpu, "quantization": quantization}).model_dump(mode="json")
    (dest / MANIFEST_NAME).write_text(json.dumps(data, indent=2), encoding="utf-8")
    return dest


def served_engine(root: Path, tp: int = 1, pp: int = 1) -> Path:
    """A complete tiny engine the reference server loads (tests/engine_fixtures.py), mapping TP x PP."""
    from tests.engine_fixtures import make_tiny_engine

    return with_mapping(make_tiny_engine(root), tp, pp, gpus_per_node=max(1, tp * pp))
