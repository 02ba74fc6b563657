"""The runtime, training's feature capture and sampling on a device (tests/device_harness.py).

The meta legs run each pass under strict_devices: the reference loop and the batched runtime
decode whole requests there (HostReads answers their host reads with zeros), training's feature
capture runs until its copy of features to the host (where a meta tensor stops). Every op on the
way kept its tensors on the model's device, or the leg fails.
The cuda legs (skipped here, with the reason) run the same paths for values on a GPU; the
multi-GPU ones need two.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from dflash_trt.checkpoints.placement import home_device, model_devices
from dflash_trt.errors import DFlashError
from dflash_trt.runtime.batched.runtime import BatchedRuntime, SequenceRequest, unsupported_reason
from dflash_trt.runtime.reference.generate import dflash_generate
from dflash_trt.runtime.decoding.sampling import sample, sample_checked
from dflash_trt.runtime.targets.adapter import TargetAdapter
from dflash_trt.runtime.tiny import random_draft, tiny_target
from dflash_trt.runtime_options import RuntimeOptions
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.speculation import SpeculationSettings

try:
    from tests.device_harness import DEVICES, NO_GPU, HostReads, needs_cuda, strict_devices
except ImportError:  # tests/ is not a package
    from device_harness import DEVICES, NO_GPU, HostReads, needs_cuda, strict_devices

LAYERS = [0, 2]


LOOP = "generate.dflash_generate"  # where the reference loop's own host reads are made


def _pair(device: str = "cpu", **draft_kw):
    target = tiny_target("llama", seed=0, num_layers=3)
    draft = random_draft(target.config, num_layers=1, block_size=4, seed=0, **draft_kw)
    return target.to(device), draft.to(device)


def _spread(target: torch.nn.Module) -> torch.nn.Module:
    """The target over two devices as a device map leaves it: the embedding and layer 0 on the
    CPU (home), the rest on meta."""
    target.model.layers[1:].to("meta")
    target.model.norm.to("meta")
    target.lm_head.to("meta")
    return target


# -- where a model lives ----------------------------------------------------------------------------


def test_home_device_is_the_input_embeddings():
    target, draft = _pair()
    assert home_device(target) == home_device(draft) == torch.device("cpu")
    draft.to("meta")  # a model without an input embedding: its first parameter's
    assert home_device(draft) == torch.device("meta")
    spread = _spread(target)
    assert home_device(spread) == torch.device("cpu") and model_devices(spread) == [torch.device("cpu"),
                                                                                      torch.device("meta")]
    spread.model.embed_tokens.to("meta")
    assert home_device(spread) == torch.device("meta")


def test_the_batched_runtime_refuses_a_target_spread_over_devices():
    """issue 36: its per-layer caches are indexed from the home device and its draft head sits on
    the lm_head's device; it runs a target on one device, the reference loop runs a spread one."""
    target, draft = _pair()
    assert unsupported_reason(target, draft) is None
    _spread(target)
    why = unsupported_reason(target, draft)
    assert why == "the target is spread over 2 devices (cpu, meta); the batched runtime runs a target on one device"
    with pytest.raises(DFlashError, match="^batched runtime: the target is spread over 2 devices"):
        BatchedRuntime(target, draft, RuntimeOptions()).start()


def test_draft_vocab_moves_with_the_drafter(tmp_path):
    """issue 36: draft_vocab was a plain attribute, left on the CPU by `.to(device)`."""
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.drafters.draft_vocab import save_draft_vocab

    _, draft = _pair()
    draft.save_pretrained(tmp_path / "d")
    save_draft_vocab(tmp_path / "d", torch.arange(40), 1.0)
    assert load_drafter(tmp_path / "d", device="meta").draft_vocab.device.type == "meta"
    loaded = load_drafter(tmp_path / "d")
    assert loaded.to("meta").draft_vocab.device.type == "meta"
    cast = load_drafter(tmp_path / "d").to(torch.bfloat16)  # ids stay int64 through a cast
    assert cast.draft_vocab.dtype == torch.long and cast.draft_vocab.tolist() == list(range(40))
    assert "draft_vocab" not in cast.state_dict()  # it ships as draft_vocab.json, never in the weights


# -- the passes ----------------------------------------------------------------------------------


def test_the_reference_loop_drafts_and_verifies_on_the_models_device():
    """Prefill, then every step's draft and verify passes on meta: the loop's host reads (the first
    token, each step's acceptance and tokens) answer zeros, so it runs to its budget, one token a step."""
    target, draft = _pair("meta")
    with strict_devices(), HostReads() as reads:
        result = dflash_generate(draft, target, [1, 2, 3, 4], SamplingParams(max_tokens=4))
    assert result.output_ids == [0, 0, 0, 0] and result.stats.num_steps == 3  # 3 draft + verify steps
    assert set(reads.where()) == {"generate.dflash_generate"}


# family, draft method, temperature: DFlash2's walk (argmax, or sampled with its q scattered over
# the vocabulary), the one-hot q of argmax drafts, and v1's sampled q, each verified as the method says
METHODS = [("dflash2", "match", 0.0), ("dflash2", "probabilistic", 0.8), ("dflash2", "greedy", 0.8),
           ("dflash", "probabilistic", 0.8)]


@pytest.mark.parametrize("family, method, temperature", METHODS, ids=["-".join(map(str, m)) for m in METHODS])
def test_each_drafter_family_and_draft_method_drafts_and_verifies_on_the_models_device(family, method, temperature):
    """DFlash2's convolutions and candidate walk, and rejection sampling (runtime/decoding/rejection.py) against
    each kind of q, on meta under strict_devices. The host reads are the loop's own three a step (the
    accepted count, the next token, the accepted tokens) and the first token's: none in the drafter's
    walk or the rejection test, where each would be one more wait for the GPU a step (or a slot)."""
    target, draft = _pair("meta", family=family)
    speculation = SpeculationSettings(block_size=4, max_draft_len=3, draft_method=method)
    with strict_devices(), HostReads() as reads:
        result = dflash_generate(draft, target, [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=temperature),
                                 speculation)
    steps = result.stats.num_steps
    assert result.output_ids == [0, 0, 0, 0] and steps == 3
    assert Counter(reads.reads) == {("int", LOOP): 1 + 2 * steps, ("tolist", LOOP): steps}


@pytest.mark.parametrize("device", DEVICES)
def test_dflash2s_convolution_over_blocks_laid_end_to_end_stays_on_their_device(device):
    """Several blocks end to end (vLLM's and TensorRT-LLM's layout) mask each tap at the block's
    start with a slot index made on the blocks' device; the reference loop runs one block, so it
    never takes this path."""
    from dflash_trt.runtime.drafters.dflash2 import grouped_dynamic_conv

    gen = torch.Generator().manual_seed(0)
    x, dynamic, base = (torch.randn(*shape, generator=gen).to(device) for shape in ((2, 8, 16), (2, 8, 2, 2), (2, 16)))
    with strict_devices():
        y = grouped_dynamic_conv(x, dynamic, base, group_size=8, block_size=4)  # [2, 8, 16]: two blocks of 4
    assert y.device.type == device and y.shape == x.shape


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_the_batched_runtime_drafts_and_verifies_on_the_models_device(static):
    """Start-up and whole steps on meta. With static shapes, start-up runs every draft and verify
    shape on padding rows (their capture) and the steps replay them; eagerly, a greedy and a
    sampled row run the drafter's catch-up, steady drafting and both verifications. Each step's
    one host read is the download (answered with zeros: every token 0, one a step)."""
    target, draft = _pair("meta")
    options = RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=static)
    with strict_devices(), HostReads() as reads:
        runtime = BatchedRuntime(target, draft, options).start()
        assert reads.reads == []  # start-up reads nothing back
        runtime.add(SequenceRequest([1, 2, 3], SamplingParams(max_tokens=4)))
        runtime.add(SequenceRequest([5, 6], SamplingParams(max_tokens=5, temperature=0 if static else 0.8)))
        runtime.run()
    assert runtime.steps == 5 and reads.where() == ["host_transfers.HostTransfers.download"] * runtime.steps
    if static:
        counters = runtime.graphs.counters
        assert counters.captured > 0 and counters.replays >= 2 * 4 and counters.misses == 0


def test_prefix_cache_hits_copy_on_the_models_device_and_read_nothing_back():
    """The prefix cache on meta: a request caches its blocks (the pool allocated on the caches'
    device), the next one hits and copies them into its slot; every tensor stays on meta and each
    step's one host read is still the download."""
    target, draft = _pair("meta")
    prompt = [1 + i % 50 for i in range(40)]  # one full block of 32
    with strict_devices(), HostReads() as reads:
        runtime = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64)).start()
        runtime.add(SequenceRequest(prompt, SamplingParams(max_tokens=3)))
        runtime.run()
        second = runtime.add(SequenceRequest(prompt[:36] + [7, 8], SamplingParams(max_tokens=3)))
        runtime.run()
    assert second.result.stats.num_cached_tokens == 32
    assert runtime.prefix_cache.pools[0][0][0].device.type == "meta"
    assert reads.where() == ["host_transfers.HostTransfers.download"] * runtime.steps


@pytest.mark.parametrize("device", DEVICES)
def test_target_adapter_keeps_logits_and_features_on_the_home_device(device):
    target, _ = _pair(device)
    adapter = TargetAdapter(target)
    ids = torch.tensor([[1, 2, 3]], device=device)
    with strict_devices():
        logits, feats = adapter.forward(ids, torch.arange(3, device=device)[None], adapter.new_cache(), LAYERS)
    assert logits.device.type == feats.device.type == device and feats.shape == (1, 3, 2 * 64)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_stays_on_the_logits_device(device):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(device)
    gen = torch.Generator(device=device).manual_seed(0) if device != "meta" else None
    with strict_devices():
        outs = [sample(logits), sample(logits, 0.7, 0.9, gen), *sample_checked(logits, 0.7, 0.9, gen)]
    assert all(o.device.type == device and o.shape == (3,) for o in outs)


@needs_cuda
def test_on_a_gpu_the_reference_loop_and_the_batched_runtime_give_the_cpu_tokens():
    cpu_t, cpu_d = _pair()
    want = dflash_generate(cpu_d, cpu_t, [1, 2, 3, 4], SamplingParams(max_tokens=12)).output_ids
    gpu_t, gpu_d = _pair("cuda")
    assert dflash_generate(gpu_d, gpu_t, [1, 2, 3, 4], SamplingParams(max_tokens=12)).output_ids == want
    for graphs in (False, True):
        runtime = BatchedRuntime(gpu_t, gpu_d, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=graphs)).start()
        seq = runtime.add(SequenceRequest([1, 2, 3, 4], SamplingParams(max_tokens=12)))
        runtime.run()
        assert seq.result.output_ids == want


# -- CUDA graphs on the model's GPU ------------------------------------------------------------------


class _CudaRecorder:
    """Stands in for torch.cuda where no GPU is (the real one cannot run here): records which
    device each stream belongs to and which device is current at every capture and replay. The
    process's current device is cuda:0; the model (and so every graph) is on cuda:1."""

    def __init__(self) -> None:
        self.current = torch.device("cuda:0")
        self.seen: list[tuple[str, torch.device]] = []
        rec = self

        class Stream:
            def __init__(self, device=None) -> None:
                self.device = torch.device(device) if device is not None else rec.current
                rec.seen.append(("stream made", self.device))

            def wait_stream(self, other) -> None:
                pass

        class CUDAGraph:
            def replay(self) -> None:
                rec.seen.append(("replay under", rec.current))

        self.Stream, self.CUDAGraph = Stream, CUDAGraph

    @contextlib.contextmanager
    def device(self, d) -> Iterator[None]:
        old, self.current = self.current, torch.device(d)
        try:
            yield
        finally:
            self.current = old

    def current_stream(self, device=None):
        return self.Stream(device)

    @contextlib.contextmanager
    def stream(self, s) -> Iterator[None]:
        self.seen.append(("warm-up on", s.device))
        yield

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None) -> Iterator[None]:
        # torch.cuda.graph's default capture stream is made once per process, on cuda:0 here
        self.seen.append(("capture on", stream.device if stream is not None else torch.device("cuda:0")))
        self.seen.append(("capture under", self.current))
        yield

    def synchronize(self, device=None) -> None:
        self.seen.append(("synchronize", torch.device(device) if device is not None else self.current))

    def graph_pool_handle(self) -> object:
        return object()

    def memory_reserved(self, device=None) -> int:
        return 0


def test_cuda_graphs_capture_and_replay_on_the_models_gpu(monkeypatch):
    """issue 36: graphs were captured on the current device's streams, with no device context: a
    model on cuda:1 was captured on cuda:0's."""
    from dflash_trt.runtime.gpu.cuda_graphs import static_passes

    rec = _CudaRecorder()
    for name in ("Stream", "CUDAGraph", "device", "current_stream", "stream", "graph", "synchronize",
                 "graph_pool_handle", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(rec, name))
    graphs = static_passes(torch.device("cuda:1"))
    x = torch.ones(3)
    graphs.capture("k", lambda t: (t * 2,), x)  # warm-up, then the capture (at start-up)
    replayed = graphs("k", lambda t: (t * 2,), x)  # a replay: the recorder's graph computes nothing
    assert graphs.counters.captured == 1 and graphs.counters.replays == 1 and len(replayed) == 1
    assert {what for what, _ in rec.seen} >= {"stream made", "warm-up on", "capture on", "capture under",
                                             "synchronize", "replay under"}
    assert [(what, dev) for what, dev in rec.seen if dev != torch.device("cuda:1")] == []
    assert rec.current == torch.device("cuda:0")  # the process's current device is left as it was


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs two GPUs ({NO_GPU})")
def test_cuda_graphs_on_the_second_gpu_give_the_eager_tokens():
    target, draft = _pair("cuda:1")
    eager = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64)).start()
    graphed = BatchedRuntime(target, draft, RuntimeOptions(max_batch=2, max_seq_len=64, cuda_graphs=True)).start()
    outs = []
    for runtime in (eager, graphed):
        seq = runtime.add(SequenceRequest([1, 2, 3, 4], SamplingParams(max_tokens=16)))
        runtime.run()
        outs.append(seq.result.output_ids)
    assert outs[0] == outs[1] and torch.cuda.current_device() == 0


# -- training's features -------------------------------------------------------------------------


def test_compute_features_feeds_the_target_on_its_device_and_keeps_features_on_the_host():
    """issue 36: ids and positions were made on the CPU for a target on a GPU. On meta the pass runs
    whole and the features' copy to the host is where it stops (a meta tensor has no data)."""
    from dflash_trt.train.data import compute_features

    target, _ = _pair("meta")
    with strict_devices(), pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        compute_features(target, [{"ids": [1, 2, 3, 4]}, {"ids": [5, 6]}], LAYERS, progress=False)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_features_of_a_gpu_target_come_back_to_the_host(device):
    from dflash_trt.prompts import Prompt
    from dflash_trt.train.answers import AnswerSettings, generate_answers
    from dflash_trt.train.data import compute_features

    target, _ = _pair(device)
    seqs = [{"ids": [1, 2, 3, 4]}, {"ids": [5, 6]}]
    assert all(f.device.type == "cpu" for f in compute_features(target, seqs, LAYERS, progress=False))
    prompts = [Prompt("p0", "chat", "train", "hi"), Prompt("p1", "chat", "train", "a longer one")]
    for via in ("runtime", "hf"):
        rows = generate_answers(target, None, prompts, AnswerSettings(max_new_tokens=4, batch_size=2,
                                                                      capture_layer_ids=tuple(LAYERS), progress=False),
                                via=via)
        assert all(r["feats"].device.type == "cpu" for r in rows)


def test_hf_generate_capture_copies_each_forwards_features_to_the_host():
    """issue 36: every answer row kept its features on the GPU. The capture hook copies each
    forward's layer outputs to the host as they are made (on meta: where it stops)."""
    from dflash_trt.train.answers import _LayerCapture

    target, _ = _pair("meta")
    capture = _LayerCapture(target, tuple(LAYERS))
    try:
        with strict_devices(), pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            target(input_ids=torch.tensor([[1, 2, 3]], device="meta"))
    finally:
        capture.remove()


def test_online_training_generates_its_answers_without_features(tmp_path):
    """issue 36: online mode captured every answer's features only to drop them."""
    from dflash_trt.train.config import TrainConfig
    from dflash_trt.train.dataset import training_sequences

    target, _ = _pair()
    cfg = TrainConfig(out=str(tmp_path / "draft"), max_prompts=2, max_new_tokens=3, gen_batch_size=2)
    online, _ = training_sequences(cfg, target, None, None, progress=False)
    assert online and all("feats" not in s for s in online)
    cfg = TrainConfig(out=str(tmp_path / "draft2"), max_prompts=2, max_new_tokens=3, gen_batch_size=2)
    cached, _ = training_sequences(cfg, target, None, LAYERS, progress=False)
    assert all(s["feats"].shape[-1] == 2 * 64 for s in cached)
