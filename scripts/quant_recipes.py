"""What each quantization recipe costs in acceptance (tau), and which layers are sensitive.

Two studies on a target + drafter pair (default: the embedded SmolLM2-135M pair):

  --recipe (repeated): for every (quant, recipe, keep_layers) given, the same steps `dflash-trt build`
  takes -- ModelOpt calibration on the train prompts, export, the exported weights dequantized
  in the engine dtype -- and the acceptance gate's statistics (dflash_trt.engine.gate): tau on
  held-out prompts before/after with 95% intervals, the paired drop and its interval. tau before
  is measured once and shared by every row (it is deterministic: greedy decoding).

  --sensitivity: one decoder layer at a time quantized (weights only, as the exported checkpoint
  has them), teacher-forced over the unquantized target's own greedy answers: how often the
  target's next-token choice changes (argmax flips) and the mean KL to the unquantized logits.
  Cheap (one forward per prompt per layer) and it points at the layers to keep in 16 bits; the
  recipes study then measures tau for real.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/quant_recipes.py --gpu h100 --quant fp8 \\
        --recipe full --recipe mlp-only --out fp8.json
    OMP_NUM_THREADS=2 .venv/bin/python scripts/quant_recipes.py --sensitivity --quant nvfp4
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import torch


COMPUTE = {"dtype": None}  # --compute-dtype: weights rounded to --dtype, arithmetic in this one


def _load(tdir: Path, ddir: Path, dtype: torch.dtype):
    from dflash_trt.engine.checkpoint_io import load_checkpoint
    from dflash_trt.runtime.draft_model import DFlashDraftModel
    from dflash_trt.runtime.loading import load_tokenizer

    target, draft = load_checkpoint(tdir, dtype), DFlashDraftModel.from_pretrained(ddir, dtype=dtype)
    return _compute(target), _compute(draft), load_tokenizer(tdir)


def _compute(model):
    return model.to(COMPUTE["dtype"]) if COMPUTE["dtype"] is not None else model


def _ids(tokenizer, vocab: int, split: str, n: int, max_len: int) -> list[list[int]]:
    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts

    return encode_prompts(tokenizer, load_calibration_prompts(None, n, split=split), vocab, max_len)


def recipes_study(args: SimpleNamespace) -> list[dict]:
    from dflash_trt.engine import gate
    from dflash_trt.engine.checkpoint_io import load_checkpoint
    from dflash_trt.engine.quantize import quantize_and_export
    from dflash_trt.engine.recipes import resolve_recipe

    dtype = getattr(torch, args.dtype)
    target, draft, tok = _load(args.target, args.draft, dtype)
    vocab, layers = target.config.vocab_size, target.config.num_hidden_layers
    gate_ids = _ids(tok, vocab, "eval", args.gate_prompts, 256)
    calib_ids = _ids(tok, vocab, "train", args.calib_size, args.calib_max_length)
    t0 = time.perf_counter()
    before = gate.measure_tau(target, draft, gate_ids, args.gate_tokens, "tau (unquantized)", not args.no_progress)
    lo, hi = before.interval()
    print(f"unquantized ({args.dtype}): tau {before.tau:.3f} [{lo:.3f}, {hi:.3f}], {before.n} prompts x "
          f"{args.gate_tokens} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [{"quant": "none", **before.summary()}]
    for spec in args.recipes:
        name, _, keep = spec.partition(":")
        keep_layers = [int(x) for x in keep.split(",")] if keep else None
        for quant in args.quant:
            recipe = resolve_recipe(quant, name, keep_layers, is_moe=False, native_experts=None, num_layers=layers)
            model, _, _ = _load(args.target, args.draft, dtype)
            fake: dict = {}

            def measure_fake_quant(m) -> None:  # W8A8 as ModelOpt simulates it (FP8 only: NVFP4 needs CUDA)
                if args.fake_quant and quant == "fp8":
                    fake["after"] = gate.measure_tau(m, draft, gate_ids, args.gate_tokens, f"tau ({quant} W+A {spec})",
                                                     not args.no_progress)

            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                quantize_and_export(model, quant, "none", recipe, calib_ids, Path(tmp) / "t", dtype,
                                    not args.no_progress, before_export=measure_fake_quant)
                del model
                qtarget = _compute(load_checkpoint(Path(tmp) / "t", dtype))
            after = gate.measure_tau(qtarget, draft, gate_ids, args.gate_tokens, f"tau ({quant} {spec})",
                                     not args.no_progress)
            rec = gate.decide(before, after, quant, args.max_tau_drop, True, 1.0)
            row = {"quant": quant, "recipe": recipe.describe(), **after.summary(),
                   "drop": rec["relative_drop"], "drop_low": rec["relative_drop_low"],
                   "drop_high": rec["relative_drop_high"], "decision": rec["decision"],
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            if "after" in fake:
                frec = gate.decide(before, fake["after"], quant, args.max_tau_drop, True, 1.0)
                row["weights_and_activations"] = {**fake["after"].summary(), "drop": frec["relative_drop"],
                                                  "drop_low": frec["relative_drop_low"],
                                                  "drop_high": frec["relative_drop_high"]}
                print(f"{quant:5s} {recipe.describe() + ' W+A fake quant':40s} tau {fake['after'].tau:.3f}  drop "
                      f"{frec['relative_drop']:+.1%} [{frec['relative_drop_low']:+.1%}, {frec['relative_drop_high']:+.1%}]",
                      flush=True)
            print(f"{quant:5s} {recipe.describe():40s} tau {after.tau:.3f} [{row['tau_low']:.3f}, {row['tau_high']:.3f}]"
                  f"  drop {row['drop']:+.1%} [{row['drop_low']:+.1%}, {row['drop_high']:+.1%}]  {row['decision']}",
                  flush=True)
    return rows


@torch.no_grad()
def _fake_quant_weight(w: torch.Tensor, quant: str) -> torch.Tensor:
    """The weight as the exported checkpoint holds it (max calibration of weights is data-free)."""
    from dflash_trt.engine.dequant import dequant_fp8, dequant_nvfp4

    w32 = w.float()
    if quant == "fp8":
        scale = w32.abs().max() / 448.0
        return dequant_fp8((w32 / scale).to(torch.float8_e4m3fn), scale).to(w.dtype)
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt, s, s2 = NVFP4QTensor.quantize(w32.clone(), 16)
    return dequant_nvfp4(qt._quantized_data, s, s2, tuple(w.shape)).to(w.dtype)


@torch.no_grad()
def sensitivity_study(args: SimpleNamespace) -> list[dict]:
    from dflash_trt.runtime.generate import autoregressive_generate
    from dflash_trt.sampling_params import SamplingParams

    dtype = getattr(torch, args.dtype)
    target, _, tok = _load(args.target, args.draft, dtype)
    ids = _ids(tok, target.config.vocab_size, "eval", args.gate_prompts, 256)
    seqs = [torch.tensor([p + autoregressive_generate(target, p, SamplingParams(max_tokens=args.gate_tokens)).output_ids])
            for p in ids]
    starts = [len(p) - 1 for p in ids]  # positions whose next token is an answer token
    ref = [torch.log_softmax(target(s).logits[0, st:-1].float(), -1) for s, st in zip(seqs, starts)]

    def score(label: str) -> dict:
        flips = kl = n = 0
        for s, st, r in zip(seqs, starts, ref):
            lp = torch.log_softmax(target(s).logits[0, st:-1].float(), -1)
            flips += int((lp.argmax(-1) != r.argmax(-1)).sum())
            kl += float((r.exp() * (r - lp)).sum())
            n += r.shape[0]
        row = {"quantized": label, "argmax_flip_rate": flips / n, "mean_kl": kl / n, "positions": n}
        print(f"{label:28s} flips {row['argmax_flip_rate']:.3%}  KL {row['mean_kl']:.4f}", flush=True)
        return row

    groups = {"attention": ("self_attn.",), "mlp": ("mlp.",), "all": ("self_attn.", "mlp.")}
    rows = []
    for quant in args.quant:
        linears = [(n, m) for n, m in target.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n]
        for gname, parts in groups.items():  # whole-model groups first
            saved = {n: m.weight.data.clone() for n, m in linears if any(p in n for p in parts)}
            for n, m in linears:
                if n in saved:
                    m.weight.data = _fake_quant_weight(saved[n], quant)
            rows.append({"quant": quant, **score(f"{quant} {gname} (every layer)")})
            for n, m in linears:
                if n in saved:
                    m.weight.data = saved[n]
        for i in range(target.config.num_hidden_layers):
            mine = [(n, m) for n, m in linears if n.split(".")[2] == str(i)]
            saved = {n: m.weight.data.clone() for n, m in mine}
            for n, m in mine:
                m.weight.data = _fake_quant_weight(saved[n], quant)
            rows.append({"quant": quant, "layer": i, **score(f"{quant} layer {i} (attn+mlp)")})
            for n, m in mine:
                m.weight.data = saved[n]
    return rows


@click.command(help=__doc__)
@click.option("--target", type=click.Path(path_type=Path), help="default: the embedded SmolLM2-135M-Instruct")
@click.option("--draft", type=click.Path(path_type=Path), help="default: the embedded drafter")
@click.option("--quant", "quant", multiple=True, type=click.Choice(["fp8", "nvfp4"]), default=("fp8", "nvfp4"),
              show_default=True, help="repeat for several")
@click.option("--recipe", "recipes", multiple=True, metavar="RECIPE[:I,J]",
              help="repeat: e.g. --recipe full --recipe mlp-only:0,29 (layers after ':' kept in 16 bits)")
@click.option("--sensitivity", is_flag=True, help="per-layer argmax flips and KL (weights only)")
@click.option("--dtype", default="bfloat16", show_default=True, help="engine dtype of a GPU build")
@click.option("--compute-dtype", help="run the models in this dtype (e.g. float32 on a CPU without native bf16: "
              "weights stay exactly the --dtype ones, 3x faster there)")
@click.option("--gate-prompts", type=click.IntRange(min=2), default=24, show_default=True)
@click.option("--gate-tokens", type=click.IntRange(min=2), default=96, show_default=True)
@click.option("--calib-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--calib-max-length", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--max-tau-drop", type=click.FloatRange(0, 1), default=0.10, show_default=True)
@click.option("--fake-quant", is_flag=True,
              help="fp8: also measure ModelOpt's calibrated fake-quant model (weights AND activations)")
@click.option("--threads", type=click.IntRange(min=1))
@click.option("--out", type=click.Path(path_type=Path), help="write the rows as JSON")
@click.option("--no-progress", is_flag=True)
def main(**options: Any) -> None:
    args = SimpleNamespace(**options)
    args.quant, args.recipes = list(args.quant), list(args.recipes)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compute_dtype:
        COMPUTE["dtype"] = getattr(torch, args.compute_dtype)
    if args.target is None or args.draft is None:
        from dflash_trt.embedded import default_pair_dirs

        t, d = default_pair_dirs()
        args.target, args.draft = args.target or t, args.draft or d
    rows = sensitivity_study(args) if args.sensitivity else recipes_study(args)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
