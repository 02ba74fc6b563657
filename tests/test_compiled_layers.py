"""The target's layers through torch.compile (runtime/compiled_layers.py) decode as the reference loop.

Inductor's CPU backend compiles the same two layer functions its GPU backend does (C++ here,
Triton there), so the compiled path runs here for real: in float64, where a fused kernel's other
summation order cannot flip a token, the batched runtime with compiled layers must give the
reference loop's tokens, its passes compiled once for all layers (regional compilation), and a
pair it cannot compile must be refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_trt.errors import DFlashError
from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched import BatchedRuntime, SequenceRequest
from dflash_trt.runtime.compiled_layers import (
    compile_target_layers,
    compile_errors,
    compile_unavailable,
    compiled_draft_functions,
    compiled_functions,
)
from dflash_trt.runtime.lean_forward import EAGER
from dflash_trt.runtime.target import TargetAdapter
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams

from tests.test_batched_runtime import BUDGETS, PROMPTS, _pair

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=f"{compile_unavailable(torch.device('cpu'))}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_layers_decode_as_the_reference_loop(arch):
    target, draft = _pair(arch, seed=5)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    rt = BatchedRuntime(target, draft,
                        RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=True, torch_compile=True)).start()
    assert TargetAdapter(target).lean.functions == compiled_functions()
    assert draft.layer_functions == compiled_draft_functions()
    assert rt.steps == 0 and rt.graph_stats()["replays"] == 0  # the start-up's warm-up left no trace
    compiled = counters["stats"]["unique_graphs"]
    handles = [rt.add(SequenceRequest(list(p), SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, BUDGETS)]
    rt.run()
    assert [h.result.output_ids for h in handles] == ref
    assert rt.graph_stats()["torch_compile"] is True
    assert counters["stats"]["unique_graphs"] == compiled  # everything compiled at start-up, nothing in requests


def test_one_compiled_graph_serves_every_layer():
    """Regional compilation: the layer is an input of the compiled code, so four layers of one
    shape compile each half once, not once per layer."""
    model = tiny_target("llama", num_layers=4, seed=2).double()
    adapter = TargetAdapter(model)
    compile_target_layers(adapter)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    cos, sin = model.model.rotary_emb(x, position_ids=torch.arange(3)[None].expand(2, 3))
    for layer in model.model.layers:
        q, k, v = adapter.lean.functions.attention_inputs(layer, x, cos[:, None], sin[:, None])
        eq, ek, ev = EAGER.attention_inputs(layer, x, cos[:, None], sin[:, None])
        # transformers' RMSNorm takes its mean in float32 even for a float64 model, and the fused
        # kernel sums in another order: equal to float32's precision, not bit for bit
        torch.testing.assert_close((q, k, v), (eq, ek, ev), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_target_without_a_lean_pass_is_refused_in_one_line():
    adapter = TargetAdapter(tiny_target("gpt_oss", seed=1))
    with pytest.raises(DFlashError, match="no lean pass to compile"):
        compile_target_layers(adapter)


def test_compile_unavailable_names_what_is_missing(monkeypatch):
    assert "not supported on meta" in compile_unavailable(torch.device("meta"))
    monkeypatch.setenv("PATH", "")
    assert "C++ compiler" in compile_unavailable(torch.device("cpu"))


def test_a_compiler_failure_at_start_up_is_one_line():
    """What torch raises when a compiler backend fails (BackendCompilerFailed, from a real backend that
    fails here) becomes the DFlashError the CLI prints as one line."""

    def failing_backend(gm, example_inputs):
        raise RuntimeError("ptxas fatal: Unresolved extern function\nmore lines")

    fn = torch.compile(lambda x: x * 2 + 1, backend=failing_backend)
    with pytest.raises(DFlashError, match=r"^--torch-compile: compiling the layers failed \(ptxas fatal: Unresolved "
                                          r"extern function\); run without --torch-compile$"):
        with compile_errors(True):
            fn(torch.ones(3))
