"""The target's and the drafter's layers through torch.compile (runtime/gpu/compiled_layers.py) decode as the
reference loop, DFlash2's convolutions included.

Inductor's CPU backend compiles the same two layer functions its GPU backend does (C++ here,
Triton there), so the compiled path runs here for real: in float64, where a fused kernel's other
summation order cannot flip a token, the batched runtime with compiled layers must give the
reference loop's tokens, its passes compiled once for all layers (regional compilation), and a
pair it cannot compile must be refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from dflash_trt.errors import DFlashError
from dflash_trt.runtime import dflash_generate
from dflash_trt.runtime.batched.runtime import BatchedRuntime, SequenceRequest
from dflash_trt.runtime.gpu.compiled_layers import (
    compile_target_layers,
    compile_errors,
    compile_unavailable,
    compiled_draft_functions,
    compiled_functions,
)
from dflash_trt.runtime.drafters.dflash2 import DFLASH2_EAGER
from dflash_trt.runtime.drafters.dflash import DRAFT_EAGER, draft_attention_inputs, draft_layer_output
from dflash_trt.runtime.targets.lean_forward import EAGER, attention_inputs, layer_output
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams

from tests.test_batched_runtime import BUDGETS, PROMPTS, _pair

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=f"{compile_unavailable(torch.device('cpu'))}")


# the four compiled layer halves, by the code torch.compile caches its graphs on
COMPILED_HALVES = {"attention_inputs": attention_inputs, "layer_output": layer_output,
                   "draft_attention_inputs": draft_attention_inputs, "draft_layer_output": draft_layer_output}


def _compiled_variants() -> dict[str, int]:
    """How many compiled variants (dynamo cache entries: one per shape class) each half holds."""
    return {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in COMPILED_HALVES.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_layers_decode_as_the_reference_loop(arch):
    """Past a function's recompile limit torch.compile runs it eagerly without a word: here a hit
    limit fails the test (fail_on_recompile_limit_hit), every half holds compiled code after
    start-up, none at its limit, and requests compile nothing more."""
    target, draft = _pair(arch, seed=5)
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)).output_ids for p, m in zip(PROMPTS, BUDGETS)]
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        rt = BatchedRuntime(target, draft,
                            RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=True, torch_compile=True)).start()
    assert TargetAdapter(target).lean.functions == compiled_functions()
    assert draft.layer_functions == compiled_draft_functions(DRAFT_EAGER)
    assert rt.steps == 0 and rt.graph_stats()["replays"] == 0  # the start-up's warm-up left no trace
    compiled, variants = counters["stats"]["unique_graphs"], _compiled_variants()
    assert compiled > before and all(1 <= n < torch._dynamo.config.recompile_limit for n in variants.values()), variants
    handles = [rt.add(SequenceRequest(list(p), SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, BUDGETS)]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        rt.run()
    assert [h.result.output_ids for h in handles] == ref
    assert rt.graph_stats()["torch_compile"] is True
    # everything compiled at start-up, nothing in requests
    assert counters["stats"]["unique_graphs"] == compiled and _compiled_variants() == variants


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["capture", "warm-up"])
def test_a_compiler_failure_in_the_runtimes_start_up_is_one_line(cuda_graphs):
    """Start-up compiles in its capture of the static shapes, else in its warm-up decode: both run
    under compile_errors. Inductor's own check of its C++ compiler fails here for real (a compiler
    that is /bin/false; no cached kernel may stand in for the compile)."""
    target, draft = _pair("llama", seed=5)
    runtime = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=cuda_graphs,
                                                           torch_compile=True))
    torch._dynamo.reset()  # no compiled variant of an earlier test may serve these shapes
    try:
        with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false"), "fx_graph_cache": False}), \
                torch._functorch.config.patch(enable_autograd_cache=False), \
                pytest.raises(DFlashError, match=r"^--torch-compile: compiling the layers failed \(No working C\+\+ "
                                                 r"compiler found in .*\); run without --torch-compile$"):
            runtime.start()
    finally:
        torch._dynamo.reset()


def test_compiled_dflash2_layers_decode_as_the_reference_loop():
    """A DFlash2 drafter's layers compile with their convolutions (their own halves, not v1's), at
    start-up: the same tokens and per-step acceptance as the reference loop, nothing compiled in
    requests."""
    from tests.test_batched_dflash2 import rigged_pair

    target, draft = rigged_pair("dflash2+fields")
    ref = [dflash_generate(draft, target, p, SamplingParams(max_tokens=m)) for p, m in zip(PROMPTS, BUDGETS)]
    rt = BatchedRuntime(target, draft,
                        RuntimeOptions(max_batch=4, max_seq_len=64, cuda_graphs=True, torch_compile=True)).start()
    assert draft.layer_functions == compiled_draft_functions(DFLASH2_EAGER) != compiled_draft_functions(DRAFT_EAGER)
    compiled = counters["stats"]["unique_graphs"]
    handles = [rt.add(SequenceRequest(list(p), SamplingParams(max_tokens=m))) for p, m in zip(PROMPTS, BUDGETS)]
    rt.run()
    assert [h.result.output_ids for h in handles] == [r.output_ids for r in ref]
    assert [h.result.stats.acceptance_lengths for h in handles] == [r.stats.acceptance_lengths for r in ref]
    assert counters["stats"]["unique_graphs"] == compiled


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
