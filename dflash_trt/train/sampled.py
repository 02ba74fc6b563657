"""More self-distilled data: the target's SAMPLED answers to the train prompts (a GPU job).

The greedy answers (:mod:`dflash_trt.train.data`) give one sequence per prompt, and the project's
prompts are few thousand. Sampling K answers per prompt at a moderate temperature gives K
different contexts per prompt, every one of them written by the target itself, and the DFlash
objective then teaches the drafter the target's most likely continuation of each (at
temperature <= 1 most sampled tokens are the greedy one). Eval prompts are never used.

    python -m dflash_trt.train.sampled TARGET_DIR OUT.pt --samples 8 --temperature 0.7 --device cuda

Output: the same file format as :mod:`dflash_trt.train.data` (ids only, no features), with ids
``<prompt id>#s<j>``; pass it to ``dflash-trt train-draft --extra-data OUT.pt``. Resumable: the
prompts already answered in OUT.pt are skipped. Runs on the continuous-batching runtime (a
finished answer's row takes the next at once), all rows drawn in one sampling call per step from
the job's seed: the same seed and --batch-prompts give the same answers. (Seeding every answer on
its own made them independent of the batch too, but cost one sampling call per row per step: with
1024 rows on an H100 that took longer than the target's forward.)
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch


def generate_sampled(model: Any, tokenizer: Any, prompts: list[Any], samples: int, temperature: float,
                     max_new_tokens: int = 256, batch_prompts: int = 64, seed: int = 0,
                     time_limit_s: float | None = None, on_batch=None) -> list[dict[str, Any]]:
    """`samples` sampled answers per prompt (objects with .id/.category/.prompt), rows as in data.py.

    Runs on the continuous-batching runtime with ``batch_prompts * samples`` rows (a finished
    answer frees its row for the next at once); targets it does not run use HF ``generate``."""
    from dflash_trt.runtime.batched import unsupported_reason
    from dflash_trt.runtime.tokens import TextCodec
    from dflash_trt.train.data import first_eos

    eos = first_eos(model.config)
    codec = TextCodec(tokenizer, int(model.config.vocab_size))
    jobs = [(p, j, codec.encode(p.prompt)) for p in prompts for j in range(samples)]
    if not jobs:
        return []
    gen = _sample_hf if unsupported_reason(model) else _sample_continuous
    return gen(model, jobs, samples, temperature, max_new_tokens, batch_prompts, seed, eos, time_limit_s, on_batch)


def _row_of(p: Any, j: int, ids: list[int], resp: list[int], eos: int) -> dict[str, Any]:
    from dflash_trt.train.data import _row, up_to_stop

    row = _row(p, ids, up_to_stop(resp, eos), None)
    row["id"] = f"{p.id}#s{j}"
    return row


@torch.inference_mode()
def _sample_continuous(model: Any, jobs: list, samples: int, temperature: float, max_new_tokens: int,
                       batch_prompts: int, seed: int, eos: int, time_limit_s: float | None,
                       on_batch) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from dflash_trt.runtime.batched import BatchedRuntime, SequenceRequest
    from dflash_trt.runtime.cpu_packing import pack_cpu_linears
    from dflash_trt.sampling_params import SamplingParams

    pack_cpu_linears(model)  # float32 on CPU only; transparent elsewhere (frozen target)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(eos,))
    torch.manual_seed(seed)  # unseeded rows draw from the global generators (CPU and every GPU)
    runtime = BatchedRuntime(model, None, max_batch=batch_prompts * samples,
                             max_seq_len=max(len(ids) for *_, ids in jobs) + max_new_tokens)
    queue = list(enumerate(jobs))[::-1]  # popped from the end: in order
    pending: dict[int, tuple[int, Any, int, list[int]]] = {}
    done: dict[int, dict[str, Any]] = {}
    t0 = time.time()

    def admit() -> None:  # keep about one batch waiting beyond the rows in use, not the whole queue
        while queue and len(pending) < 2 * runtime.max_batch:
            if time_limit_s is not None and time.time() - t0 > time_limit_s:
                queue.clear()
                return
            i, (p, j, ids) = queue.pop()
            req = SequenceRequest(ids, params)
            pending[id(runtime.add(req))] = (i, p, j, ids)

    admit()
    with tqdm(total=len(jobs), desc=f"sampling {samples} answers per prompt", unit="answer") as bar:
        while runtime.has_work():
            finished = runtime.step()
            for seq in finished:
                i, p, j, ids = pending.pop(id(seq))
                done[i] = _row_of(p, j, ids, seq.result.output_ids, eos)
                bar.update(1)
            admit()
            if finished and on_batch is not None:
                on_batch([done[i] for i in sorted(done)])
    return [done[i] for i in sorted(done)]


@torch.inference_mode()
def _sample_hf(model: Any, jobs: list, samples: int, temperature: float, max_new_tokens: int,
               batch_prompts: int, seed: int, eos: int, time_limit_s: float | None,
               on_batch) -> list[dict[str, Any]]:
    """HF ``generate`` over left-padded batches of prompts (samples drawn from one global seed)."""
    from tqdm import tqdm

    from dflash_trt.train.data import left_padded

    device = next(model.parameters()).device
    torch.manual_seed(seed)
    prompts = [(p, ids) for p, j, ids in jobs if j == 0]
    out: list[dict[str, Any]] = []
    t0 = time.time()
    for i in tqdm(range(0, len(prompts), batch_prompts), desc=f"sampling {samples} answers per prompt", unit="batch"):
        if time_limit_s is not None and time.time() - t0 > time_limit_s:
            break
        chunk = prompts[i : i + batch_prompts]
        input_ids, attention = left_padded([ids for _, ids in chunk], eos)
        width = input_ids.shape[1]
        gen = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                             top_p=1.0, top_k=0, num_return_sequences=samples, eos_token_id=eos,
                             pad_token_id=eos).cpu()  # [len(chunk) * samples, width + new]
        out.extend(_row_of(p, j, ids, gen[r * samples + j, width:].tolist(), eos)
                   for r, (p, ids) in enumerate(chunk) for j in range(samples))
        if on_batch is not None:
            on_batch(out)
    return out


def main(argv: list[str] | None = None) -> None:
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.runtime.loading import load_target, load_tokenizer
    from dflash_trt.train.data import load_data, save_data

    ap = argparse.ArgumentParser(description="The target's sampled answers to the train prompts (resumable).")
    ap.add_argument("target_dir", type=Path)
    ap.add_argument("out_file", type=Path)
    ap.add_argument("--samples", type=int, default=8, help="answers per prompt")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-prompts", type=int, default=64, help="rows decoded together = this x --samples")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, help="start no new answer after this many seconds")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.temperature <= 0 or args.batch_prompts < 1:
        ap.error("--samples and --batch-prompts must be >= 1 and --temperature > 0")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    model = load_target(args.target_dir, torch.float32, device=args.device)
    tok = load_tokenizer(args.target_dir)
    prompts = load_prompts("train")
    random.Random(args.seed).shuffle(prompts)
    meta = {"max_new_tokens": args.max_new_tokens, "capture_layer_ids": None, "sampled": True,
            "samples": args.samples, "temperature": args.temperature, "seed": args.seed}
    have: list[dict[str, Any]] = load_data(args.out_file)[0] if args.out_file.is_file() else []
    done = {s["id"].split("#")[0] for s in have}
    todo = [p for p in interleave(prompts) if p.id not in done]
    print(f"{len(have)} sequences kept from {args.out_file}, {len(todo)} prompts to sample", flush=True)
    last_save = [time.time()]

    def checkpoint(got: list[dict[str, Any]], force: bool = False) -> None:
        if force or time.time() - last_save[0] > 60:  # pickling the whole list is seconds: once a minute
            save_data(args.out_file, have + got, {**meta, "seconds": time.time() - t0})
            last_save[0] = time.time()

    seqs = generate_sampled(model, tok, todo, args.samples, args.temperature, args.max_new_tokens,
                            args.batch_prompts, args.seed, args.time_limit, on_batch=checkpoint)
    checkpoint(seqs, force=True)
    print(f"wrote {len(have) + len(seqs)} sequences to {args.out_file} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    from dflash_trt.errors import run_module_main

    run_module_main(main)
