"""RuntimeOptions (dflash_trt/runtime_options.py): how a pair is loaded and run, defined once.

The dtype vocabulary is one list that every command's --dtype reads (read here from the real
click commands), with no alias any command would refuse; a bad value built in code is one
DFlashError line naming the flag; the configs that inherit the choices (serve's BackendSettings,
bench's BenchConfig) hand them on whole; the defaults that follow an engine live here."""

from __future__ import annotations

import click
import pydantic
import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import (
    DTYPE_CHOICES,
    DTYPE_NAMES,
    RuntimeOptions,
    engine_dtype_name,
    engine_runtime_defaults,
    torch_dtype,
)


def _dtype_choices(*path: str) -> dict[str, tuple[str, ...]]:
    """{option name: its choices} of the dtype options of the command at `path` (e.g. deploy triton)."""
    from dflash_trt.cli import main

    cmd: click.Command = main
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
    return {p.opts[0]: tuple(p.type.choices) for p in cmd.params
            if isinstance(p, click.Option) and "dtype" in p.name and isinstance(p.type, click.Choice)}


def test_every_command_reads_the_one_dtype_vocabulary():
    assert DTYPE_NAMES == ("float32", "bfloat16", "float16") and DTYPE_CHOICES == ("auto", *DTYPE_NAMES)
    for path in (("serve",), ("deploy", "triton"), ("bench",), ("train-data",)):
        assert _dtype_choices(*path) == {"--dtype": DTYPE_NAMES}, path
    assert _dtype_choices("train-draft") == {"--save-dtype": DTYPE_NAMES}
    assert _dtype_choices("generate") == {"--dtype": DTYPE_CHOICES}  # a free string before (it took fp32)
    assert _dtype_choices("build") == {"--dtype": DTYPE_CHOICES, "--compute-dtype": DTYPE_CHOICES}


def test_names_resolve_and_no_alias_is_accepted():
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    assert torch_dtype("auto", "meta") == torch.bfloat16  # resolved for the device (a GPU stand-in)
    for alias in ("fp32", "bf16", "fp16"):
        with pytest.raises(DFlashError, match=rf"--dtype '{alias}' is not a dtype; use one of auto, float32"):
            torch_dtype(alias)
        with pytest.raises(DFlashError, match=r"runtime options: --dtype"):
            RuntimeOptions(dtype=alias)


@pytest.mark.parametrize("values, flag", [
    ({"max_batch": 0}, "--max-batch-size 0"),
    ({"max_seq_len": 1}, "--max-seq-len 1"),
    ({"verify_chunk": 0}, "verify_chunk"),
    ({"compute_dtype": "double"}, "--compute-dtype 'double'"),
    ({"cuda_graphs": "often"}, "--cuda-graphs 'often'"),
])
def test_a_bad_option_is_one_line_naming_its_flag(values, flag):
    with pytest.raises(DFlashError) as e:
        RuntimeOptions(**values)
    text = str(e.value)
    assert text.startswith(f"runtime options: {flag}") and "\n" not in text and "; change " in text
    with pytest.raises(DFlashError, match=r"unknown option 'policy'; use one of device, dtype"):
        RuntimeOptions(policy="adaptive")  # what a step drafts is SpeculationSettings', not an option


def test_options_are_frozen_and_replace_validates():
    options = RuntimeOptions(max_batch=4)
    with pytest.raises(pydantic.ValidationError):
        options.max_batch = 8  # type: ignore[misc]
    wider = options.replace(max_batch=8, cuda_graphs=True)
    assert (wider.max_batch, wider.cuda_graphs, options.max_batch) == (8, True, 4)
    with pytest.raises(DFlashError, match="--max-batch-size 0"):
        options.replace(max_batch=0)


def test_weights_and_run_dtypes():
    assert RuntimeOptions().weights_dtype() == RuntimeOptions().run_dtype() == torch.float32
    upcast = RuntimeOptions(dtype="bfloat16", compute_dtype="float32")
    assert (upcast.weights_dtype(), upcast.run_dtype()) == (torch.bfloat16, torch.float32)
    # "auto" on a device that is not a CPU keeps the 16-bit weights (a CPU decides by what it multiplies)
    assert RuntimeOptions(dtype="bfloat16", compute_dtype="auto", device="meta").run_dtype() == torch.bfloat16
    assert RuntimeOptions(dtype="float16", compute_dtype="auto").run_dtype() == torch.float32  # fp16 on any CPU


def test_the_configs_hand_their_choices_on_whole():
    from dflash_trt.bench.config import BenchConfig
    from dflash_trt.serving.backends import BackendSettings

    # model.py (copied into every repository, old ones included) builds BackendSettings from the
    # config.pbtxt parameters by these names
    served = BackendSettings(backend="pytorch", dtype="bfloat16", device="cpu", default_max_tokens=8, max_queue=2,
                             policy="fixed", max_draft_len=3, cuda_graphs=None, torch_compile=True)
    options = RuntimeOptions.of(served, max_batch=4, max_seq_len=64)
    assert (options.dtype, options.torch_compile, options.pack, options.max_batch) == ("bfloat16", True, True, 4)
    bench = BenchConfig(dtype="float16", pack=False, cuda_graphs=True)
    assert RuntimeOptions.of(bench).model_dump(include={"dtype", "pack", "cuda_graphs"}) == {
        "dtype": "float16", "pack": False, "cuda_graphs": True}
    with pytest.raises(pydantic.ValidationError):
        BenchConfig(dtype="bf16")  # the bench --config file's alias went with the vocabulary


def test_the_engine_decides_how_it_runs_and_is_stored():
    assert engine_runtime_defaults(False, "float32") == {"device": "cpu", "dtype": "float32"}
    assert engine_runtime_defaults(True, "float16") == {"device": "cuda", "dtype": "float16"}
    assert engine_runtime_defaults(True, None) == {"device": "cuda", "dtype": "bfloat16"}
    assert engine_dtype_name("float16", "bfloat16", emulated=False) == "float16"  # --dtype wins
    assert engine_dtype_name("auto", "torch.float16", emulated=False) == "float16"  # the checkpoint's 16 bits
    assert engine_dtype_name("auto", "float32", emulated=False) == "bfloat16"  # a GPU engine: 16 bits
    assert engine_dtype_name("auto", "float32", emulated=True) == "float32"  # the CPU recipe keeps float32
