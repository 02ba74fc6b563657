"""The TensorRT-LLM backend: TensorRT-LLM's LLM API with one-model DFlash, configured by the
engine's llm_api_options.yaml (or a Triton repository's model.yaml, which holds the same LLM()
keyword arguments: :func:`llm_kwargs` writes both), behind the serving protocol. Runs on GPU nodes only: TensorRT-LLM
cannot be installed on the development machines, so tests/test_tensorrt_llm_backend.py drives it
with a stand-in ``tensorrt_llm`` module whose names are upstream's, recorded with their source
files and commits in tests/upstream/tensorrt_llm_llmapi.json.

The mapping, upstream names on the left:

- the prompt: our tokenizer contract encodes it (chat template, as the PyTorch backend does) and
  ``LLM.generate_async(inputs=<token ids>, sampling_params=..., streaming=True)`` receives the ids,
  so both backends see the same tokens;
- ``tensorrt_llm.SamplingParams(max_tokens, temperature, top_p, seed, stop, stop_token_ids,
  return_perf_metrics=True)`` from our SamplingParams;
- ``LLM(model=<engine>/target, speculative_config=DFlashDecodingConfig(...), **rest)``: the
  kwargs of :func:`llm_kwargs`, ``max_draft_len`` = our K (``--max-draft-len`` may lower the
  engine's), drafter path absolute;
- each streamed ``RequestOutput.outputs[0].text_diff`` -> a Chunk; the last output's
  ``finish_reason`` ('stop' | 'length' | 'timeout' | 'cancelled'; a timeout is reported as
  cancelled) and ``stop_reason``, ``len(token_ids)`` -> num_output_tokens, ``len(ids)`` ->
  num_prompt_tokens;
- ``outputs[0].request_perf_metrics.speculative_decoding.{total_draft_tokens,
  total_accepted_draft_tokens, acceptance_rate}`` -> the same names in ChunkStats; tau
  = 1 + K x acceptance_rate, because one-model DFlash drafts K tokens every generation step
  (steps = drafted / K);
- ``cancel()`` -> ``RequestOutput.abort()``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from dflash_trt.metrics import time_per_output_token
from dflash_trt.runtime.decoding.tokens import TextCodec
from dflash_trt.serving.protocol import (
    Chunk,
    ChunkStats,
    GenerateRequest,
    Generation,
    GenerationFailed,
    resolve_budget,
)
from dflash_trt.speculation import SpeculationSettings

log = logging.getLogger("dflash_trt.serving")

# upstream CompletionOutput.finish_reason -> ours (FINISH_REASONS)
FINISH_REASON_MAP = {"stop": "stop", "length": "length", "cancelled": "cancelled", "timeout": "cancelled"}


def tensorrt_llm_status() -> tuple[bool, str]:
    """(usable, why): TensorRT-LLM is used only when importable AND it has native DFlash."""
    try:
        import tensorrt_llm  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return False, f"tensorrt_llm is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    version = getattr(tensorrt_llm, "__version__", "?")
    try:
        from tensorrt_llm.llmapi import DFlashDecodingConfig  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001
        return False, f"tensorrt_llm {version} has no tensorrt_llm.llmapi.DFlashDecodingConfig (no native DFlash)"
    return True, f"tensorrt_llm {version} with DFlashDecodingConfig"


def speculative_stats(output: Any, max_draft_len: int) -> dict[str, float]:
    """Our speculative statistics from a CompletionOutput's request_perf_metrics (zeros when absent)."""
    spec = getattr(getattr(output, "request_perf_metrics", None), "speculative_decoding", None)
    if spec is None:
        return {}
    drafted, accepted = int(spec.total_draft_tokens), int(spec.total_accepted_draft_tokens)
    rate = float(spec.acceptance_rate)
    return {"total_draft_tokens": drafted, "total_accepted_draft_tokens": accepted, "acceptance_rate": rate,
            "tau": 1.0 + max_draft_len * rate if drafted else 1.0}


def llm_kwargs(engine_dir: Path, manifest: Any, speculation: SpeculationSettings, root: str | None = None
               ) -> dict[str, Any]:
    """The ``tensorrt_llm.LLM(**kwargs)`` of an engine: its llm_api_options.yaml with the target
    as ``model``, the drafter's path made absolute and ``max_draft_len`` = K. `root`: the engine
    directory as the server will see it (a container path), default `engine_dir` resolved."""
    from dflash_trt.config import read_config_file

    root = root or str(Path(engine_dir).resolve())
    options = read_config_file(Path(engine_dir) / manifest.llm_api_options, "the engine's LLM-API options",
                               fix=f"rebuild the engine with `dflash-trt build` (or `dflash-trt verify {engine_dir}`)")
    spec = dict(options.pop("speculative_config", {}) or {})
    spec["max_draft_len"] = speculation.max_draft_len  # K: the manifest's, or lower (--max-draft-len)
    if spec.get("draft_len_schedule"):  # upstream: the smallest key maps to max_draft_len, none above it
        from dflash_trt.draft_len_schedule import DraftLenSchedule

        schedule = DraftLenSchedule.from_mapping(spec["draft_len_schedule"]).capped(speculation.max_draft_len)
        spec["draft_len_schedule"] = schedule.to_mapping()
    drafter = spec.get("speculative_model")
    if drafter and not Path(drafter).is_absolute():  # paths in the YAML are engine-relative
        spec["speculative_model"] = str(Path(root) / drafter)
    options.pop("model", None)
    return {"model": str(Path(root) / manifest.target.path), "backend": "pytorch", **options,
            "speculative_config": spec}


class TensorRTLLMBackend:
    """TensorRT-LLM's LLM API for one engine (see the module docstring)."""

    backend = "tensorrt_llm"

    def __init__(self, engine_dir: Path, manifest: Any, speculation: SpeculationSettings, codec: TextCodec,
                 default_max_tokens: int, kwargs: dict[str, Any] | None = None) -> None:
        """`kwargs`: LLM() keyword arguments (a repository's model.yaml); default: the engine's."""
        from tensorrt_llm import LLM  # type: ignore[import-not-found]
        from tensorrt_llm.llmapi import DFlashDecodingConfig  # type: ignore[import-not-found]

        self.engine_dir = engine_dir
        self.max_seq_len = manifest.limits.max_seq_len
        self.default_max_tokens = default_max_tokens
        self.speculation = speculation
        self.codec = codec
        options = dict(kwargs if kwargs is not None else llm_kwargs(engine_dir, manifest, speculation))
        spec = dict(options.pop("speculative_config", {}) or {})
        spec.pop("decoding_type", None)
        spec["max_draft_len"] = speculation.max_draft_len
        options.pop("backend", None)  # the LLM API's PyTorch backend is the only one with DFlash
        model = options.pop("model")
        self._llm = LLM(model=model, speculative_config=DFlashDecodingConfig(**spec), **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trtllm-loop", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        return f"tensorrt_llm backend: one-model DFlash, K={self.speculation.max_draft_len} drafts every step"

    def runtime_stats(self) -> dict[str, Any]:
        return {"runtime": "tensorrt_llm", "speculation": self.speculation.to_dict()}

    def submit(self, request: GenerateRequest) -> Generation:
        params = resolve_budget(request.params, self.default_max_tokens, self.max_seq_len)
        ids = request.prompt_ids(self.codec)
        params = resolve_budget(params, self.default_max_tokens, self.max_seq_len, ids)
        g = Generation(request)
        asyncio.run_coroutine_threadsafe(self._run(g, ids, params), self._loop)
        return g

    def _sampling_params(self, params: Any) -> Any:
        from tensorrt_llm import SamplingParams  # type: ignore[import-not-found]

        return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                              seed=params.seed, stop=list(params.stop) or None,
                              stop_token_ids=list(params.stop_token_ids) or None, return_perf_metrics=True)

    async def _run(self, g: Generation, ids: list[int], params: Any) -> None:
        t0 = time.perf_counter()
        try:
            promise = self._llm.generate_async(ids, sampling_params=self._sampling_params(params), streaming=True)
            out, first = None, 0.0
            async for out in promise:
                if g.is_cancelled():
                    promise.abort()
                    break
                o = out.outputs[0]
                if o.text_diff and not out.finished:
                    first = first or time.perf_counter()
                    g.put(Chunk(o.text_diff))
            stats = ChunkStats(num_prompt_tokens=len(ids), queue_s=0.0, max_draft_len=self.speculation.max_draft_len)
            cancelled = g.cancelled.is_set()
            reason, tail, stop_reason = "cancelled", "", None
            if out is not None:
                o = out.outputs[0]
                if not cancelled:
                    tail = o.text_diff
                    reason = FINISH_REASON_MAP.get(o.finish_reason or "length", "length")
                    stop_reason = getattr(o, "stop_reason", None) if reason == "stop" else None
                stats.num_output_tokens = len(o.token_ids)
                for name, value in speculative_stats(o, self.speculation.max_draft_len).items():
                    setattr(stats, name, value)
            end = time.perf_counter()
            stats.decode_s = end - t0
            stats.ttft_s = (first or end) - t0
            stats.tpot_s = time_per_output_token(end - (first or end), stats.num_output_tokens)
            g.put(Chunk(tail, finished=True, finish_reason=reason, stats=stats, stop_reason=stop_reason))
        except Exception as e:  # noqa: BLE001 - the request fails, the backend keeps serving
            log.warning("request failed in TensorRT-LLM: %s: %s", type(e).__name__, e)
            g.put(GenerationFailed(f"generation failed: {type(e).__name__}: {e}"))
        g.end()

    def shutdown(self, cancel_pending: bool = True) -> None:
        self._llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
