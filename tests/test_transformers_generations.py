"""Every config.json an engine ships reads the same under transformers 4.57 as under transformers 5.

TensorRT-LLM pins transformers==4.57.1 (NVIDIA/TensorRT-LLM requirements.txt @ 000867d9b1ad) and
builds its RoPE from the config object's `rope_theta` / `rope_scaling`
(tensorrt_llm/_torch/attention_backend/interface.py @ 000a01de66f0, RopeParams.from_config); both
recorded in tests/upstream/tensorrt_llm_node.json. transformers 5 writes `rope_parameters` only, so
4.57 would silently fall back to its class defaults. This test builds real engines (`--quant none`
for Llama, Llama with llama3 scaling, Qwen3 and gpt-oss with YaRN, and a ModelOpt FP8 export) from
checkpoints (and tokenizers) saved by this environment's transformers 5, then reads each engine's
target and drafter config.json, and the target's tokenizer, with transformers 4.57's OWN classes, installed from the package index (pure
Python, --no-deps, with the huggingface_hub it requires) into the project's cache dir
(${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/transformers-4.57.1) once and reused, and run in a child
process. RoPE values are chosen away from every class default, so a fallback cannot pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.engine.builder import build_engine, prepare
from dflash_trt.checkpoints.hf_config_compat import both_generations
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.errors import DFlashError

UPSTREAM = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_node.json").read_text())
PIN = UPSTREAM["transformers_pin"]
VERSION = PIN["requirement"].split("==")[1]

# (arch, rope_parameters as transformers 5 holds them): none equals a 4.57 class default.
CASES = {
    "llama": ("llama", {"rope_type": "default", "rope_theta": 100000.0}),  # the embedded SmolLM2's RoPE
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "qwen3": ("qwen3", {"rope_type": "default", "rope_theta": 1000000.0}),
    "gpt_oss": ("gpt_oss", {"rope_type": "yarn", "rope_theta": 250000.0, "factor": 16.0, "beta_fast": 16.0,
                            "beta_slow": 2.0, "truncate": False, "original_max_position_embeddings": 256}),
}

PROMPT = "The capital of France is Paris."
READER = """
import json, os, sys
from transformers import AutoConfig, AutoTokenizer, __version__
out = {"version": __version__}
for d in sys.argv[1:]:
    c = AutoConfig.from_pretrained(d)
    out[d] = {"model_type": c.model_type, "rope_theta": getattr(c, "rope_theta", None),
              "rope_scaling": getattr(c, "rope_scaling", None), "dtype": str(getattr(c, "torch_dtype", None))}
    if os.path.isfile(os.path.join(d, "tokenizer_config.json")):  # as TensorRT-LLM loads the tokenizer
        out[d]["ids"] = AutoTokenizer.from_pretrained(d).encode(%r)
print(json.dumps(out))
""" % PROMPT


def _cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-trt")


def transformers_457() -> Path:
    """transformers 4.57 (and its huggingface_hub) in a --target dir of the cache, installed once."""
    home = _cache_dir() / f"transformers-{VERSION}"
    if (home / "transformers" / "__init__.py").is_file():
        return home
    tmp = home.with_name(home.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp),
           PIN["requirement"], f"huggingface_hub=={PIN['companions']['huggingface_hub']}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"could not install {PIN['requirement']} from the package index: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(home)  # a half-installed copy never looks complete
    return home


def read_with_457(dirs: list[Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(transformers_457()), "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", READER, *map(str, dirs)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("version") == VERSION
    return {Path(k): v for k, v in out.items()}


def _save_source(root: Path, arch: str, rope: dict) -> tuple[Path, Path]:
    """A tiny checkpoint saved by THIS transformers (5: rope_parameters only) and a drafter for it."""
    from dflash_trt.runtime.tiny import random_draft, tiny_target

    try:
        from tests.engine_fixtures import VOCAB_SIZE, save_tiny_tokenizer
    except ImportError:  # tests/ is not a package
        from engine_fixtures import VOCAB_SIZE, save_tiny_tokenizer

    model = tiny_target(arch, seed=0, hidden_size=64, intermediate_size=96, vocab_size=VOCAB_SIZE)
    model.config.rope_parameters = dict(rope)
    tdir, ddir = root / "target", root / "draft"
    model.save_pretrained(tdir)
    save_tiny_tokenizer(tdir)  # written by transformers 5: tokenizer_class TokenizersBackend
    random_draft(model.config, num_layers=1, block_size=8).save_pretrained(ddir)
    saved = json.loads((tdir / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    return tdir, ddir


def _expected_457(rope: dict) -> tuple[float, dict | None]:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return rope["rope_theta"], (None if scaling == {"rope_type": "default"} else scaling)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """case -> (engine dir, the rope_parameters its source checkpoint was saved with)."""
    out = {}
    for case, (arch, rope) in CASES.items():
        root = tmp_path_factory.mktemp(case)
        tdir, ddir = _save_source(root, arch, rope)
        spec = resolve_spec(None, {"target": str(tdir), "draft": str(ddir), "gpu": "h100", "max_seq_len": 256,
                                   "dtype": "bfloat16"})
        out[case] = (build_engine(prepare(spec), root / "engine", progress=False), rope, tdir)
    # The quantized path: ModelOpt's export rewrites config.json from the model (transformers 5 form).
    root = tmp_path_factory.mktemp("fp8")
    tdir, ddir = _save_source(root, "llama", CASES["llama"][1])
    spec = resolve_spec(None, {"target": str(tdir), "draft": str(ddir), "gpu": "h100", "max_seq_len": 256,
                               "quant": "fp8", "gate.enabled": False, "calibration.num_samples": 2,
                               "calibration.max_length": 16})
    out["llama_fp8"] = (build_engine(prepare(spec), root / "engine", progress=False), CASES["llama"][1], tdir)
    return out


def test_transformers_457_reads_every_engine_config_as_transformers_5_does(engines):
    from transformers import AutoConfig, AutoTokenizer

    dirs = [engine / sub for engine, _, _ in engines.values() for sub in ("target", "draft")]
    old = read_with_457(dirs)
    for case, (engine, rope, _) in engines.items():
        theta, scaling = _expected_457(rope)
        got = old[engine / "target"]
        assert (got["rope_theta"], got["rope_scaling"]) == (theta, scaling), case
        assert got["dtype"] == "torch.bfloat16", case
        # the tokenizer loads under 4.57 and encodes as transformers 5 does
        assert got["ids"] == AutoTokenizer.from_pretrained(engine / "target").encode(PROMPT), case
        # transformers 5 reads the same file back to the parameters it was saved with
        new = AutoConfig.from_pretrained(engine / "target").rope_parameters
        assert {k: new[k] for k in rope} == rope, case
        # the drafter (z-lab form, qwen3) carries the target's base frequency in both generations
        draft = old[engine / "draft"]
        assert draft["model_type"] == "qwen3" and draft["rope_theta"] == theta, case
        assert AutoConfig.from_pretrained(engine / "draft").rope_parameters["rope_theta"] == theta, case


def test_a_config_in_transformers_5_form_alone_is_what_4_57_misreads(engines, tmp_path):
    """The control: the source checkpoints as transformers 5 saved them, without the added keys,
    read by 4.57 fall back to the class default (the silent bug this guards against)."""
    _, _, tdir = engines["llama"]
    assert json.loads((tdir / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    probe = tmp_path / "config-only"
    probe.mkdir()
    shutil.copy(tdir / "config.json", probe / "config.json")
    got = read_with_457([probe])[probe]
    assert got["rope_theta"] == 10000.0 != CASES["llama"][1]["rope_theta"]


def test_source_rope_keys_are_kept_and_a_disagreeing_one_is_refused():
    written = {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert both_generations(written, {"rope_theta": 500000}) == {**written, "rope_theta": 500000, "rope_scaling": None}
    with pytest.raises(DFlashError, match="disagrees with rope_parameters"):
        both_generations(written, {"rope_theta": 10000.0})
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096}
    # gpt-oss as released: the source's rope_scaling lacks nothing transformers 5 kept; it is kept as is
    source = {"rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}
    out = both_generations({"rope_parameters": yarn}, source)
    assert out["rope_scaling"] == source["rope_scaling"] and out["rope_theta"] == 150000.0
