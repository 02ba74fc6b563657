"""The TensorRT-LLM version gate: the minimum recorded in the manifest is a PUBLISHED release that has
every key llm_api_options.yaml writes.

TensorRT-LLM cannot be installed here, so the field -> first-release table is data
(dflash_trt/engine/trtllm_fields.json) with its sources: PyPI's release list (`pip index versions
--pre tensorrt-llm`), upstream PRs 12794 (DFlash) and 16914 (attention_backend), the published API
references of 1.3.0rc27 and 1.4.0rc1 and tensorrt_llm/llmapi/llm_args.py at NVIDIA/TensorRT-LLM@0004396.
These tests check the table is consistent and that the builder's YAML and manifest follow it.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from packaging.version import Version

from dflash_trt.cli import main
from dflash_trt.engine.llm_api import ENUMS, SECTION_KEYS, TOP_LEVEL_KEYS, llm_api_options, speculative_fields
from dflash_trt.engine.recompute_tail import RecomputeTailMeasurement
from dflash_trt.engine.spec import resolve_spec
from dflash_trt.engine.trtllm_versions import (container_release, min_version, published_versions, requirements,
                                               strip_defaults, table, unmet)
from dflash_trt.errors import DFlashError

DFLASH_FIRST = table()["fields"]["speculative_config.decoding_type"]["values"]["DFlash"]
ATTENTION_BACKEND_FIRST = table()["fields"]["speculative_config.attention_backend"]["first_version"]


def test_every_first_version_is_a_published_release_and_no_13_final_exists():
    published = published_versions()
    assert "1.3.0" not in published  # there is no 1.3.0 final: the old minimum named nothing installable
    for key, entry in table()["fields"].items():
        assert entry["first_version"] in published, key
        assert entry["source"] in table()["sources"], key
        for value, version in entry.get("values", {}).items():
            assert version in published, (key, value)
            assert Version(version) >= Version(entry["first_version"]), (key, value)


def test_every_key_the_yaml_may_write_has_a_first_version():
    fields = table()["fields"]
    for key in TOP_LEVEL_KEYS:
        assert key in fields, key
    for section, keys in SECTION_KEYS.items():
        for key in keys:
            assert f"{section}.{key}" in fields, (section, key)
    # every DFlash attention backend the check accepts has its own first release
    assert ENUMS[("speculative_config", "attention_backend")] == set(
        fields["speculative_config.attention_backend"]["values"])


def test_dflash_came_before_attention_backend():
    assert Version(DFLASH_FIRST) < Version(ATTENTION_BACKEND_FIRST)
    assert DFLASH_FIRST.startswith("1.3.0rc") and ATTENTION_BACKEND_FIRST.startswith("1.3.0rc")


def _opts(**over):
    spec = resolve_spec(None, over)
    return llm_api_options(spec, is_moe=over.get("ep", 1) > 1, max_draft_len=15, max_num_tokens=8192,
                           mask_token_id=7, target_layer_ids=[1, 2])


def test_hopper_engine_runs_on_the_first_dflash_release():
    """Built for the first DFlash release, a Hopper engine keeps VANILLA (upstream's default, left
    out); built for the container's release (the default), it writes FA4, which that release has."""
    opts = _opts(gpu="h100", tp=2, quant="fp8", tensorrt_llm_release=DFLASH_FIRST)
    assert "attention_backend" not in opts["speculative_config"]  # VANILLA is upstream's default
    assert min_version(opts) == DFLASH_FIRST
    fa4 = _opts(gpu="h100", tp=2, quant="fp8")
    assert fa4["speculative_config"]["attention_backend"] == "FA4"
    assert min_version(fa4) == table()["fields"]["speculative_config.attention_backend"]["values"]["FA4"]
    assert Version(min_version(fa4)) <= Version(container_release())


def test_no_release_is_handed_a_key_it_does_not_have():
    """The gate: for every published DFlash release, what the writer emits for it needs no later
    release; a setting that release lacks is refused in one line naming the first that has it."""
    measured = RecomputeTailMeasurement(about="t", commit="c", command="x", pair="p", interval_halfwidth=0.1,
                                        tau_by_tail={"0": 2.0, "16": 2.5, "64": 2.8, "256": 2.9, "all": 3.0},
                                        recommended=64, why="w")
    releases = [r for r in published_versions() if Version(r) >= Version(DFLASH_FIRST)]
    written_tail = []
    for release in releases:
        for gpu in ("h100", "b300"):
            spec = resolve_spec(None, {"gpu": gpu, "tensorrt_llm_release": release})
            fields = speculative_fields(spec, release, head_dim=128, measurement=measured)
            opts = llm_api_options(spec, is_moe=False, max_draft_len=7, max_num_tokens=8192, mask_token_id=7,
                                   target_layer_ids=[1], release=release, fields=fields)
            assert unmet(requirements(opts), release) == {}, (release, gpu)
            if "context_recompute_tail" in opts["speculative_config"]:
                written_tail.append(release)
    tail_first = table()["fields"]["speculative_config.context_recompute_tail"]["first_version"]
    assert written_tail and min(written_tail, key=Version) == tail_first  # written from its first release on
    for over, key in [({"gpu": "b200", "dflash_attention_backend": "TRTLLM"}, "speculative_config.attention_backend"),
                      ({"gpu": "h100", "acceptance_rate_window": 8, "acceptance_rate_threshold": 0.3},
                       "speculative_config.acceptance_rate_window_size")]:
        with pytest.raises(DFlashError, match=f"TensorRT-LLM {DFLASH_FIRST} refuses .*{key} \\(first in "
                                              f"{table()['fields'][key]['first_version']}") as e:
            _opts(tensorrt_llm_release=DFLASH_FIRST, **over)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("release, match", [("1.2.1", "has DFlash from"), ("1.3.0rc99", "not a published"),
                                            ("newest", "not a version")])
def test_a_release_the_build_cannot_write_for_is_one_line(release, match):
    with pytest.raises(DFlashError, match=match) as e:
        _opts(gpu="h100", tensorrt_llm_release=release)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("gpu, backend", [("b300", "auto"), ("b200", "TRTLLM")])
def test_an_engine_that_writes_attention_backend_needs_the_release_that_has_it(gpu, backend):
    opts = _opts(gpu=gpu, tp=8, ep=8, dflash_attention_backend=backend)
    written = opts["speculative_config"]["attention_backend"]
    assert written != "VANILLA"
    needs = requirements(opts)
    assert needs[f"speculative_config.attention_backend={written}"] == ATTENTION_BACKEND_FIRST
    assert min_version(opts) == ATTENTION_BACKEND_FIRST


def test_defaults_are_left_out_and_empty_sections_dropped():
    opts = {"tensor_parallel_size": 1, "kv_cache_config": {"dtype": "auto", "free_gpu_memory_fraction": 0.9},
            "cuda_graph_config": {"enable_padding": True}, "stream_interval": 3,
            "speculative_config": {"decoding_type": "DFlash", "attention_backend": "VANILLA"}}
    assert strip_defaults(opts) == {"cuda_graph_config": {"enable_padding": True}, "stream_interval": 3,
                                    "speculative_config": {"decoding_type": "DFlash"}}


def test_a_key_without_a_recorded_version_is_refused():
    with pytest.raises(DFlashError, match="no entry in trtllm_fields.json"):
        requirements({"speculative_config": {"decoding_type": "DFlash", "dynamic_tree_max_topK": 2}})


def test_unmet_names_what_an_installed_release_lacks():
    needs = requirements(_opts(gpu="b200", tp=4, ep=4))
    assert unmet(needs, ATTENTION_BACKEND_FIRST) == {}
    too_old = unmet(needs, DFLASH_FIRST)
    assert set(too_old) == {"speculative_config.attention_backend", "speculative_config.attention_backend=TRTLLM"}
    assert unmet(needs, "1.2.1")["speculative_config.decoding_type=DFlash"] == DFLASH_FIRST
    with pytest.raises(DFlashError, match="not a version"):
        unmet(needs, "latest")


@pytest.mark.slow
def test_built_engine_records_the_minimum_of_what_it_wrote(tiny_pair_dirs, tmp_path):
    import yaml

    from dflash_trt.engine.manifest import load_manifest

    target, draft = tiny_pair_dirs
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", "--target", str(target), "--draft", str(draft), "--max-seq-len", "256",
                                    "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    m = load_manifest(out)
    opts = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    assert m.min_tensorrt_llm_version == min_version(opts) == DFLASH_FIRST  # CPU engine: VANILLA, left out
    assert m.tensorrt_llm_requirements == requirements(opts)
    assert f">= {DFLASH_FIRST}" in (out / "llm_api_options.yaml").read_text().splitlines()[0]
