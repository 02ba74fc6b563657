"""The target's own answers to the train prompts: a drafter's training data, made by ONE function.

DFlash is trained to predict what THE TARGET would say next, so the answers are the target's
own (its chat template), never taken from a data set. :func:`generate_answers` writes them
either way a run needs:

- greedy (temperature 0): the self-distilled data `train-draft` trains on, one answer per
  prompt, every one exactly the answer batch-1 greedy decoding gives;
- sampled (temperature > 0, ``samples`` answers per prompt): more contexts per prompt (a GPU
  job, ``dflash-trt train-data --samples 8 --temperature 0.7``); all rows are drawn in one
  sampling call per step from the global generator seeded with ``seed``, so the same seed and
  batch give the same answers.

Both run on the continuous-batching runtime (runtime/batched/runtime.py: a finished answer's row takes
the next prompt at once; about twice as fast as HF ``generate`` over fixed batches on the 2-core
CPU, which keeps stepping finished rows until the batch's longest answer ends). Targets that
runtime does not run (sliding windows, attention sinks) fall back to HF ``generate`` over fixed
left-padded batches; a batched greedy answer there can differ from the batch-1 answer in rare
near-ties, which costs a little acceptance, never correctness.

Rows (the answer-file format of dflash_trt/train/data.py), in the order answers finish:
``{"id", "category", "prompt_len", "ids"}`` with ids = prompt + answer, ending with the stop
token when it was hit; a sampled answer's id is ``<prompt id>#s<j>``. With
``capture_layer_ids`` a row also holds ``"feats"`` [T-1, n*H] (bfloat16, on the host): the target's features
at those layers for every position it was FED, captured while generating, so no second target
pass over the data is needed.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dflash_trt.errors import DFlashError

OnBatch = Callable[[list[dict[str, Any]]], None]
log = logging.getLogger("dflash_trt.train")


@dataclass(frozen=True)
class AnswerSettings:
    """How answers are decoded; recorded in the answer file's meta."""

    max_new_tokens: int = 256
    batch_size: int = 64  # rows decoded together (a sampled job: prompts per batch x samples)
    samples: int = 1  # answers per prompt (> 1 only when sampling)
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # the global generator's seed when sampling
    capture_layer_ids: tuple[int, ...] | None = None  # also return the target's features there
    time_limit_s: float | None = None  # start no new answer after this many seconds
    progress: bool = True

    def __post_init__(self) -> None:
        if self.samples > 1 and self.temperature <= 0:
            raise DFlashError(f"--samples {self.samples}: greedy answers to one prompt are all the same; "
                              f"sample with --temperature > 0 or use --samples 1")
        if self.temperature < 0 or self.samples < 1 or self.batch_size < 1:
            raise DFlashError("--samples and the batch size must be >= 1 and --temperature >= 0")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


def train_prompts(shuffle_seed: int = 0, limit: int | None = None) -> list[Any]:
    """The project's TRAIN prompts (never the eval ones), shuffled, then interleaved by category
    so that any prefix covers every category."""
    from dflash_trt.prompts import interleave, load_prompts

    prompts = load_prompts("train")
    random.Random(shuffle_seed).shuffle(prompts)
    return interleave(prompts)[:limit]


def generate_answers(model: Any, tokenizer: Any, prompts: list[Any], settings: AnswerSettings = AnswerSettings(),
                     on_batch: OnBatch | None = None, via: Literal["auto", "runtime", "hf"] = "auto",
                     ) -> list[dict[str, Any]]:
    """The target's answers to `prompts` (objects with .id/.category/.prompt); see the module
    docstring. `on_batch(rows so far)` is called after every `settings.batch_size` finished
    answers and at the end (to save partial results: any subset of an interleaved prompt list is
    still a usable training set). `via` forces a path (tests); auto = the runtime when it can."""
    from dflash_trt.runtime.batched.runtime import unsupported_reason
    from dflash_trt.runtime.decoding.tokens import TextCodec

    codec = TextCodec(tokenizer, int(model.config.vocab_size))  # the ids `generate` would feed the target
    encoded = [(p, codec.encode(p.prompt)) for p in prompts]
    if not encoded:
        return []
    if via == "auto":  # the reference loop (runtime/opener.py's fallback) has no batched answers nor features
        why = unsupported_reason(model)
        via = "hf" if why else "runtime"
        if why:
            log.info("answers through HF generate over fixed batches: the batched runtime cannot run this target (%s)",
                     why)
    run = _answers_with_hf_generate if via == "hf" else _answers_on_runtime
    return run(model, encoded, settings, first_eos(model.config), on_batch)


def first_eos(config: Any) -> int:
    """The target's (first) end-of-sequence id: what answers stop on and HF batches pad with."""
    eos = config.eos_token_id
    return int(eos if isinstance(eos, int) else (eos or [0])[0])


def left_padded(id_lists: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [len(id_lists), longest], left-padded for HF ``generate``:
    every prompt ends at the last column, so generated tokens start at the same column in every row."""
    width = max(len(ids) for ids in id_lists)
    input_ids = torch.full((len(id_lists), width), pad, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for r, ids in enumerate(id_lists):
        input_ids[r, width - len(ids) :] = torch.tensor(ids)
        attention[r, width - len(ids) :] = 1
    return input_ids, attention


def up_to_stop(response: list[int], eos: int) -> list[int]:
    """`response` cut after its first `eos` (kept), or whole when it has none."""
    return response[: response.index(eos) + 1] if eos in response else response


def answer_row(prompt: Any, sample: int | None, prompt_ids: list[int], response: list[int],
               feats: torch.Tensor | None = None) -> dict[str, Any]:
    """One row of an answer file; `sample` j (a sampled answer) makes the id ``<prompt id>#s<j>``."""
    row = {"id": prompt.id if sample is None else f"{prompt.id}#s{sample}", "category": prompt.category,
           "prompt_len": len(prompt_ids), "ids": prompt_ids + response}
    if feats is not None:
        row["feats"] = feats
    return row


def _description(s: AnswerSettings) -> str:
    return f"sampling {s.samples} answers per prompt" if s.sampled else "generating answers"


@torch.inference_mode()
def _answers_on_runtime(model: Any, encoded: list[tuple[Any, list[int]]], s: AnswerSettings, eos: int,
                        on_batch: OnBatch | None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from dflash_trt.runtime.batched.runtime import RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.cpu.packing import pack_cpu_linears
    from dflash_trt.runtime.opener import open_runtime
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    pack_cpu_linears(model)  # float32 on CPU only; transparent for anything else (frozen target)
    params = SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, stop_token_ids=(eos,))
    if s.sampled:
        torch.manual_seed(s.seed)  # every row draws from the global generators (CPU and every GPU)
    # sampled answers run every step eagerly: no CUDA graphs to capture for them
    options = RuntimeOptions(max_batch=s.batch_size, max_seq_len=max(len(ids) for _, ids in encoded) + s.max_new_tokens,
                             cuda_graphs=False if s.sampled else None)
    runtime = open_runtime(model, None, options, extras=RuntimeExtras(capture_layer_ids=s.capture_layer_ids or None),
                           choice="batched")
    queue = deque((p, j if s.sampled else None, ids) for p, ids in encoded for j in range(s.samples))
    total, pending, out, t0 = len(queue), {}, [], time.time()

    def admit() -> None:  # about one batch waiting beyond the rows in use: free rows never idle
        while queue and len(pending) < 2 * s.batch_size:
            if s.time_limit_s is not None and time.time() - t0 > s.time_limit_s:
                queue.clear()
                return
            job = queue.popleft()
            pending[id(runtime.add(SequenceRequest(job[2], params)))] = job

    admit()
    with tqdm(total=total, desc=_description(s), unit="answer", disable=not s.progress) as bar:
        while runtime.has_work():
            for seq in runtime.step():
                p, j, ids = pending.pop(id(seq))
                # rows keep their features on the host: ~25 MB an answer at hidden 4096
                feats = seq.features.cpu() if seq.features is not None else None
                out.append(answer_row(p, j, ids, up_to_stop(seq.result.output_ids, eos), feats))
                seq.features = None
                bar.update(1)
                if on_batch is not None and len(out) % s.batch_size == 0:
                    on_batch(out)
            admit()
    if on_batch is not None and len(out) % s.batch_size:
        on_batch(out)
    return out


@torch.inference_mode()
def _answers_with_hf_generate(model: Any, encoded: list[tuple[Any, list[int]]], s: AnswerSettings, eos: int,
                              on_batch: OnBatch | None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from dflash_trt.checkpoints.placement import home_device

    device = home_device(model)
    if s.sampled:
        torch.manual_seed(s.seed)
    sampling = (dict(do_sample=True, temperature=s.temperature, top_p=1.0, top_k=0) if s.sampled
                else dict(do_sample=False))
    per_batch = max(1, s.batch_size // s.samples)  # prompts per generate call
    capture = _LayerCapture(model, s.capture_layer_ids)
    out: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        for i in tqdm(range(0, len(encoded), per_batch), desc=_description(s), unit="batch", disable=not s.progress):
            if s.time_limit_s is not None and time.time() - t0 > s.time_limit_s:
                break
            chunk = encoded[i : i + per_batch]
            input_ids, attention = left_padded([ids for _, ids in chunk], eos)
            width = input_ids.shape[1]
            capture.clear()
            gen = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 max_new_tokens=s.max_new_tokens, num_return_sequences=s.samples, eos_token_id=eos,
                                 pad_token_id=eos, **sampling).cpu()  # [len(chunk) * samples, width + new]
            feats = capture.features()  # [len(chunk) * samples, width + fed steps, n*H], left-padded
            for r, (p, ids) in enumerate(chunk):
                for j in range(s.samples):
                    row = r * s.samples + j
                    resp = up_to_stop(gen[row, width:].tolist(), eos)
                    start, n_fed = width - len(ids), len(ids) + len(resp) - 1
                    out.append(answer_row(p, j if s.sampled else None, ids, resp,
                                          None if feats is None else feats[row, start : start + n_fed].clone()))
            if on_batch is not None:
                on_batch(out)
    finally:
        capture.remove()
    return out


class _LayerCapture:
    """Forward hooks collecting the outputs of `layer_ids` over every forward HF ``generate``
    runs (the prefill, then one per new token); no hooks when `layer_ids` is empty."""

    def __init__(self, model: Any, layer_ids: tuple[int, ...] | None) -> None:
        from dflash_trt.runtime.targets.adapter import find_decoder_layers

        self.layer_ids = tuple(layer_ids or ())
        self.forwards: list[dict[int, torch.Tensor]] = []
        layers = find_decoder_layers(model) if self.layer_ids else []
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, idx: int):
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            h = output[0] if isinstance(output, (tuple, list)) else output
            if idx == min(self.layer_ids):  # the first of them to run opens a new forward
                self.forwards.append({})
            self.forwards[-1][idx] = h.to(device="cpu", dtype=torch.bfloat16)  # [b, new positions, H], on the host
        return record

    def clear(self) -> None:
        self.forwards.clear()

    def features(self) -> torch.Tensor | None:
        if not self.layer_ids:
            return None
        return torch.cat([torch.cat([f[i] for i in self.layer_ids], dim=-1) for f in self.forwards], dim=1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
