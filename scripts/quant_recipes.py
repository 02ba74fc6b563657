"""What each quantization recipe costs in acceptance (tau), and which layers are sensitive.

Two studies on a target + drafter pair (default: the embedded SmolLM2-135M pair):

  --recipe (repeated): for every (quant, recipe, keep_layers) given, the same steps `dflash-trt build`
  takes -- ModelOpt calibration on the train prompts, export, the exported weights dequantized
  in the engine dtype -- and the acceptance gate's statistics (dflash_trt.engine.gate): tau on
  held-out prompts before/after with 95% intervals, the paired drop and its interval. tau before
  is measured once and shared by every row (it is deterministic: greedy decoding).

  --sensitivity: a selection of linear layers quantized (weights only, as the exported checkpoint
  has them: --recipe full | mlp-only | attention | mlp-gate-up [= mlp-only with down_proj kept],
  --projections one projection in every layer, --per-layer one layer's), teacher-forced over the
  unquantized target's own greedy answers: how often the target's next-token choice changes
  (argmax flips), the mean KL to the unquantized logits, and the teacher-forced tau drop: the
  drafter drafts at every answer position and the target verifies, so every configuration is
  scored on the same anchors (no divergence noise), split into what the drafter's changed inputs
  cost and what the target's changed choices cost. Cheap (one target and one drafter pass per
  prompt per row); it picks the layers to keep in 16 bits, the recipes study / the gate then
  measure tau free-running. --prompt-offset 24 skips the gate's former 24 prompts (it now decodes all 39).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/quant_recipes.py --gpu h100 --quant fp8 \\
        --recipe full --recipe mlp-only --out fp8.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/quant_recipes.py --sensitivity --quant nvfp4 \\
        --recipe mlp-only --recipe full --recipe attention --projections --compute-dtype float32 \\
        --gate-prompts 12 --gate-tokens 96 --prompt-offset 24
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import torch


COMPUTE = {"dtype": None}  # --compute-dtype: weights rounded to --dtype, arithmetic in this one


def _load(tdir: Path, ddir: Path, dtype: torch.dtype):
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.runtime.drafters.loading import load_drafter
    from dflash_trt.runtime.targets.loading import load_tokenizer

    target, draft = load_checkpoint(tdir, dtype), load_drafter(ddir, dtype=dtype)
    return _compute(target), _compute(draft), load_tokenizer(tdir)


def _compute(model):
    return model.to(COMPUTE["dtype"]) if COMPUTE["dtype"] is not None else model


def _ids(tokenizer, vocab: int, split: str, n: int, max_len: int, offset: int = 0) -> list[list[int]]:
    from dflash_trt.engine.calibration import encode_prompts, load_calibration_prompts

    prompts = load_calibration_prompts(None, offset + n, split=split)[offset:]
    return encode_prompts(tokenizer, prompts, vocab, max_len)


def recipes_study(args: SimpleNamespace) -> list[dict]:
    from dflash_trt.engine import gate
    from dflash_trt.checkpoints.streaming import load_checkpoint
    from dflash_trt.engine.quantize import quantize_and_export
    from dflash_trt.engine.recipes import resolve_recipe

    dtype = getattr(torch, args.dtype)
    target, draft, tok = _load(args.target, args.draft, dtype)
    vocab, layers = target.config.vocab_size, target.config.num_hidden_layers
    gate_ids = _ids(tok, vocab, "eval", args.gate_prompts, 256, args.prompt_offset)
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


# Selections of decoder-layer linear modules (names inside a layer) a sensitivity row quantizes.
SELECTIONS = {"full": ("self_attn.", "mlp."), "mlp-only": ("mlp.",), "attention": ("self_attn.",),
              "mlp-gate-up": ("mlp.gate_proj", "mlp.up_proj")}  # the last: mlp-only with down_proj kept
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def _fake_quant_weight(w: torch.Tensor, quant: str) -> torch.Tensor:
    """The weight as the exported checkpoint holds it (max calibration of weights is data-free)."""
    from dflash_trt.checkpoints.dequant import dequant_fp8, dequant_nvfp4

    w32 = w.float()
    if quant == "fp8":
        scale = w32.abs().max() / 448.0
        return dequant_fp8((w32 / scale).to(torch.float8_e4m3fn), scale).to(w.dtype)
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt, s, s2 = NVFP4QTensor.quantize(w32.clone(), 16)
    return dequant_nvfp4(qt._quantized_data, s, s2, tuple(w.shape)).to(w.dtype)


@dataclass
class Forced:
    """One target's teacher-forced view of the fixed answers: its greedy choice after every
    position, its log-probabilities over the answer, and what the drafter proposes from its
    features at every anchor (slots 1..K)."""

    choice: list[torch.Tensor]  # per prompt [T]: argmax after position t
    logprobs: list[torch.Tensor]  # per prompt [answer positions, V] float32
    drafts: list[torch.Tensor]  # per prompt [A, K]: drafter argmax at anchors start..start+A-1


@torch.no_grad()
def _teacher_forced(target, draft, seqs: list[torch.Tensor], prompt_lens: list[int], K: int,
                    with_drafts: bool = True) -> Forced:
    """Target and drafter on fixed sequences (prompt + the unquantized target's greedy answer).

    An anchor at p is a step that starts with token p pending and context < p (the first step
    after prefill has p = prompt length); slot k of its block proposes position p + k, and the
    target's greedy token there is the argmax after position p + k - 1. Every answer position is
    an anchor that still has K labels, so a configuration is scored on the same ~(answer - K)
    steps per prompt, whatever text it would itself have produced (no divergence noise)."""
    from transformers import DynamicCache

    from dflash_trt.runtime.targets.adapter import TargetAdapter
    from dflash_trt.train.objective import batch_attention_mask

    adapter = TargetAdapter(target)
    B = draft.block_size
    out = Forced([], [], [])
    for seq, plen in zip(seqs, prompt_lens):
        T = seq.shape[1]
        logits, feats = adapter.forward(seq, torch.arange(T)[None], DynamicCache(), draft.target_layer_ids)
        out.choice.append(logits[0].argmax(-1))
        out.logprobs.append(torch.log_softmax(logits[0, plen - 1 : -1].float(), -1))
        if not with_drafts:
            continue
        anchors = torch.arange(plen, T - K)  # [A]: anchors with K labels inside the answer
        block = torch.full((len(anchors), B), draft.mask_token_id)
        block[:, 0] = seq[0, anchors]
        pos = torch.cat([torch.arange(T), (anchors[:, None] + torch.arange(B)).flatten()])[None]
        mask = batch_attention_mask(T, anchors[None], B)
        hidden = draft(feats, adapter.embed(block.flatten()[None]), pos, None, mask)  # [1, A*B, H]
        hidden = hidden.view(len(anchors), B, -1)[:, 1 : K + 1]
        out.drafts.append(adapter.lm_head(hidden).argmax(-1))  # [A, K]
    return out


def _forced_tau(drafts: Forced, verifier: Forced, prompt_lens: list[int]):
    """TauSample of teacher-forced steps: drafts from one target's features, verified against
    (another) target's greedy choices; committed = 1 + accepted (the bonus), one step per anchor."""
    from dflash_trt.engine.gate import TauSample

    sample = TauSample()
    for d, choice, plen in zip(drafts.drafts, verifier.choice, prompt_lens):
        A, K = d.shape
        idx = torch.arange(plen, plen + A)[:, None] + torch.arange(K)  # choice after p + k - 1
        accepted = (d == choice[idx]).int().cumprod(1).sum(1)
        sample.add(int(accepted.sum()) + A, A, A * K, int(accepted.sum()))
    return sample


def _layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


@torch.no_grad()
def sensitivity_study(args: SimpleNamespace) -> list[dict]:
    from dflash_trt.engine import gate
    from dflash_trt.runtime.reference.generate import autoregressive_generate
    from dflash_trt.sampling_params import SamplingParams

    dtype = getattr(torch, args.dtype)
    target, draft, tok = _load(args.target, args.draft, dtype)
    layers = target.config.num_hidden_layers
    ids = _ids(tok, target.config.vocab_size, "eval", args.gate_prompts, 256, args.prompt_offset)
    K = draft.block_size - 1
    seqs = [torch.tensor([p + autoregressive_generate(target, p, SamplingParams(max_tokens=args.gate_tokens)).output_ids])
            for p in ids]
    plens = [len(p) for p in ids]
    ref = _teacher_forced(target, draft, seqs, plens, K, args.forced_tau)
    print(f"unquantized ({args.dtype}): {len(ids)} prompts x {args.gate_tokens} tokens (eval prompts "
          f"{args.prompt_offset}..{args.prompt_offset + len(ids) - 1}), K = {K}", flush=True)
    if args.forced_tau:
        tau0 = _forced_tau(ref, ref, plens)
        lo, hi = tau0.interval()
        print(f"teacher-forced tau {tau0.tau:.3f} [{lo:.3f}, {hi:.3f}] over {sum(tau0.steps)} anchors", flush=True)
    linears = {n: m for n, m in target.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}

    def selected(parts: tuple[str, ...], keep: tuple[int, ...] = (), only: int | None = None) -> list[str]:
        return [n for n in linears if any(p in n for p in parts) and _layer_of(n) not in keep
                and (only is None or _layer_of(n) == only)]

    def score(quant: str, label: str, names: list[str]) -> dict:
        saved = {n: linears[n].weight.data.clone() for n in names}
        try:
            for n in names:
                linears[n].weight.data = _fake_quant_weight(saved[n], quant)
            q = _teacher_forced(target, draft, seqs, plens, K, args.forced_tau)
        finally:
            for n in names:
                linears[n].weight.data = saved[n]
        flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(q.logprobs, ref.logprobs))
        kl = sum(float((b.exp() * (b - a)).sum()) for a, b in zip(q.logprobs, ref.logprobs))
        n = sum(b.shape[0] for b in ref.logprobs)
        row = {"quant": quant, "quantized": label, "modules": len(names), "argmax_flip_rate": flips / n,
               "mean_kl": kl / n, "positions": n}
        # both: the quantized pair; drafter: drafts from quantized features, the unquantized target
        # verifies (what the drafter's inputs cost); verifier: drafts from unquantized features,
        # the quantized target verifies (what the target's changed choices cost)
        line = f"{label:34s} flips {row['argmax_flip_rate']:6.2%}  KL {row['mean_kl']:.4f}"
        if args.forced_tau:
            for key, d, v in (("both", q, q), ("drafter", q, ref), ("verifier", ref, q)):
                drop, dlo, dhi = gate.drop_interval(tau0, _forced_tau(d, v, plens))
                row[f"tf_drop_{key}"], row[f"tf_drop_{key}_low"], row[f"tf_drop_{key}_high"] = drop, dlo, dhi
            line += (f"  tf-tau drop {row['tf_drop_both']:+6.2%} [{row['tf_drop_both_low']:+.2%}, "
                     f"{row['tf_drop_both_high']:+.2%}]  drafter-side {row['tf_drop_drafter']:+6.2%}  "
                     f"verifier-side {row['tf_drop_verifier']:+6.2%}")
        print(line, flush=True)
        return row

    rows: list[dict] = []
    per_layer = args.recipes[0].partition(":")[0] if args.recipes else "full"
    for quant in args.quant:
        for spec in args.recipes or ["full", "mlp-only"]:  # whole recipes, optionally minus kept layers
            name, _, keep = spec.partition(":")
            kept = tuple(i % layers for i in (int(x) for x in keep.split(","))) if keep else ()
            rows.append(score(quant, f"{quant} {spec}", selected(SELECTIONS[name], kept)))
        if args.projections:
            for proj in PROJECTIONS:
                rows.append(score(quant, f"{quant} {proj} (every layer)", selected((f".{proj}",))))
        if args.per_layer:
            for i in range(layers):
                rows.append({"layer": i, **score(quant, f"{quant} {per_layer} layer {i}",
                                                  selected(SELECTIONS[per_layer], only=i))})
    return rows


@click.command(help=__doc__)
@click.option("--target", type=click.Path(path_type=Path), help="default: the embedded SmolLM2-135M-Instruct")
@click.option("--draft", type=click.Path(path_type=Path), help="default: the embedded drafter")
@click.option("--quant", "quant", multiple=True, type=click.Choice(["fp8", "nvfp4"]), default=("fp8", "nvfp4"),
              show_default=True, help="repeat for several")
@click.option("--recipe", "recipes", multiple=True, metavar="RECIPE[:I,J]",
              help="repeat: e.g. --recipe full --recipe mlp-only:0,29 (layers after ':' kept in 16 bits); "
              "--sensitivity also takes attention and mlp-gate-up (mlp-only with down_proj kept)")
@click.option("--sensitivity", is_flag=True, help="teacher-forced argmax flips, KL and tau drop of each --recipe "
              "(weights only; default: full and mlp-only)")
@click.option("--per-layer", is_flag=True, help="--sensitivity: also each layer alone (the first --recipe's modules)")
@click.option("--projections", is_flag=True, help="--sensitivity: also each projection (q/k/v/o/gate/up/down) alone")
@click.option("--forced-tau/--no-forced-tau", default=True, show_default=True,
              help="--sensitivity: also the teacher-forced tau drop (drafter passes at every answer position)")
@click.option("--prompt-offset", type=click.IntRange(min=0), default=0, show_default=True,
              help="skip this many held-out prompts (24: apart from the gate's former default of 24; it now decodes all 39)")
@click.option("--dtype", default="bfloat16", show_default=True, help="engine dtype of a GPU build")
@click.option("--compute-dtype", default="auto", show_default=True,
              help="run the models in this dtype (auto: --dtype where this CPU multiplies it natively, else float32; "
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
    if args.compute_dtype == "auto":
        from dflash_trt.runtime_options import compute_dtype

        COMPUTE["dtype"] = compute_dtype(getattr(torch, args.dtype), "cpu")
    else:
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
