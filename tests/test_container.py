"""deploy/container: the image the jobs default to holds a TensorRT-LLM that accepts every key
dflash-trt may write (Docker and NGC are not reachable here, so the image is checked as data:
image.json's sources are TensorRT-LLM's docker/ files and Triton's compatibility matrix)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

from dflash_trt.deploy.slurm import SlurmOptions, container_image_record
from dflash_trt.engine.trtllm_versions import container_release, published_versions, table

ROOT = Path(__file__).resolve().parents[1]


def test_base_image_holds_the_release_engines_are_built_for():
    """`build` writes for the container's release unless told otherwise (trtllm_versions.container_release),
    and never hands a release a key it lacks (tests/test_trtllm_versions.py): the base must be that
    release, and have the attention backends and the schedule the build prefers."""
    record = container_image_record()
    base = record["base"]
    assert base["image"] == f"nvcr.io/nvidia/tensorrt-llm/release:{base['tensorrt_llm']}"
    assert base["tensorrt_llm"] in published_versions() and base["tensorrt_llm"] == container_release()
    fields = table()["fields"]
    preferred = [fields["speculative_config.attention_backend"]["values"][v] for v in ("TRTLLM", "FA4")]
    for first in [*preferred, fields["speculative_config.draft_len_schedule"]["first_version"]]:
        assert Version(base["tensorrt_llm"]) >= Version(first)


def test_no_triton_trtllm_image_has_dflash_and_the_table_agrees_with_the_version_gate():
    dflash_first = Version(table()["fields"]["speculative_config.decoding_type"]["values"]["DFlash"])
    for image in container_image_record()["candidates"]["images"]:
        if image["dflash"] is not None:
            assert image["dflash"] == (Version(image["tensorrt_llm"]) >= dflash_first), image
        if "-trtllm-python-py3" in image["image"]:
            assert image["dflash"] is False


def test_dockerfile_builds_from_the_recorded_base_and_installs_this_repository():
    text = (ROOT / "deploy" / "container" / "Dockerfile").read_text()
    record = container_image_record()
    assert re.search(rf"^ARG TRTLLM_IMAGE={re.escape(record['base']['image'])}$", text, re.M)
    assert re.search(rf"^ARG TRITON_IMAGE={re.escape(record['triton']['image'])}$", text, re.M)
    assert "COPY --from=triton /opt/tritonserver/backends/python" in text
    assert 'pip install --no-cache-dir -c /opt/dflash-trt/image-pins.txt "/opt/dflash-trt/src[' in text
    assert "dflash-trt doctor" in text
    assert f"-t {record['default_image']} ." in text
    assert SlurmOptions().container_image == record["default_image"]
