"""`dflash-trt train-draft`: self-distilled data -> cached target features -> DFlash drafter.

Pipeline (each stage cached under ``data_dir`` so a re-run only does what is missing):
1. responses.pt: the target's own greedy answers to the project's TRAIN prompts
   (:mod:`dflash_trt.train.data`; eval prompts are never used);
2. features-<layers>.pt: the frozen target's features at ``target_layer_ids`` for every position
   of every sequence (the target runs ONCE per sequence, not once per step);
3. training: each step draws one sequence and up to ``anchors_per_seq`` random anchors in its
   response, all trained in one drafter forward (:mod:`dflash_trt.train.objective`);
4. the drafter is saved in z-lab format (bf16 by default) with MANIFEST.json, atomically.

The target is frozen; its embedding and lm_head are shared with the drafter (which has none).

Why not ModelOpt's DFlash trainer (``modelopt.torch.speculative``, mode "dflash")? It runs on
this CPU and exports the same z-lab format (checked: its export loads in our runtime), but its
online mode runs the full target in every training step, its offline mode expects its own
dumped-hidden-state format and sequence padding to a multiple of the block size, and it trains
its own draft class rather than the :class:`DFlashDraftModel` our runtime decodes with. On a
shared 2-core CPU the precomputed-feature loop below, on the very class used at inference, is
the cheaper and more direct choice.
"""

from __future__ import annotations

import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.errors import DFlashError


class TrainConfig(BaseModel):
    """Every knob of a drafter training run (recorded in MANIFEST.json)."""

    model_config = ConfigDict(extra="forbid")

    target: str
    out: str
    data_dir: str | None = None  # default: <out>.data (cached responses and features)
    max_new_tokens: int = Field(256, ge=1)
    max_prompts: int | None = Field(None, ge=1)  # use at most this many train prompts
    gen_batch_size: int = Field(64, ge=1)
    block_size: int = Field(16, ge=2)
    num_layers: int = Field(1, ge=1)
    intermediate_size: int = Field(768, ge=1)
    target_layer_ids: list[int] | None = None  # default: build_target_layer_ids(L, 3)
    num_target_features: int = Field(3, ge=1)
    mask_token_id: int | None = None  # default: chosen from the tokenizer (see choose_mask_token)
    steps: int = Field(1000, ge=1)
    time_limit_s: float | None = Field(None, gt=0)  # stop early (and still save) after this long
    # While a separate `python -m dflash_trt.train.data` job is still appending to
    # <data_dir>/responses.pt, pick up its new sequences every this many seconds.
    data_reload_s: float | None = Field(None, gt=0)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    anchors_per_seq: int = Field(32, ge=1)
    gamma: float | None = Field(None, gt=0)  # loss decay; default 7 for B=16, 4 for B=8
    seed: int = 0
    threads: int | None = Field(None, ge=1)
    save_dtype: str = "bfloat16"
    log_every: int = Field(25, ge=1)
    # Start from a trained drafter (same target, mask token, layer ids and hidden size): tensors
    # whose names and shapes match are copied; extra layers start as identity (see init_from).
    init_from: str | None = None
    # Sampled softmax: score the loss over the tokens that occur in the data plus this many
    # random other ids, redrawn every step, instead of the whole vocabulary. The frozen head is
    # most of a step's cost and an instruct model's answers use few distinct ids (SmolLM2: ~3.7k
    # of 49k), so this is ~2x faster; the random others keep every row pushed down. None: full.
    sampled_vocab: int | None = Field(None, ge=0)
    # Write draft_vocab.json beside the drafter: the N tokens the target's answers use most (the
    # batched runtime drafts over them only; runtime/draft_vocab.py). 0: do not write one.
    draft_vocab_size: int = Field(8192, ge=0)
    # Where training runs ("cpu", "cuda", "cuda:1"). On a GPU the target computes each step's
    # features itself (online), so no feature cache is written and any amount of data fits.
    device: str = "cpu"
    # Sequences per optimizer step, trained in one padded drafter forward (1 on a 2-core CPU;
    # 16-64 fill a GPU).
    batch_sequences: int = Field(1, ge=1)
    # Features: "cached" (the target runs once per sequence, before training) or "online" (the
    # target runs on every step's batch). Default: cached on CPU, online elsewhere.
    features: Literal["cached", "online"] | None = None
    # More sequences (responses.pt files as written by dflash_trt.train.data/.sampled), e.g. the
    # target's sampled answers to the same train prompts; trained on alongside the greedy ones.
    extra_data: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Mask token
# ---------------------------------------------------------------------------------------------

MASK_TOKEN_NOTE = (
    "The target has no spare embedding row, so the DFlash mask is a reserved special token of its tokenizer "
    "that the instruct model never emits (the first added special token that is not bos/eos/pad/unk or a chat "
    "token, and never occurs in the target's own responses; SmolLM2: a StarCoder-style code-metadata token). "
    "It is an ordinary row of the target's embedding, so TensorRT-LLM, vLLM and SGLang load it as-is."
)


def choose_mask_token(tokenizer: Any | None, vocab_size: int, never_seen: set[int] | None = None) -> int:
    """A token id the target never emits, usable by every runtime (an existing embedding row).

    SmolLM2 (like most targets) has no spare embedding row, so the mask is a RESERVED special
    token: the first added special token that is not a chat/control token (bos/eos/pad/unk,
    <|im_start|>, <|im_end|>) and never occurs in the training data. For SmolLM2 this is id 3,
    ``<repo_name>``, one of the StarCoder-style code-metadata tokens (ids 3..16) an instruct
    model never writes. Without a tokenizer (tiny random pairs) the last vocabulary id is used.
    """
    never_seen = never_seen or set()
    if tokenizer is None:
        return vocab_size - 1
    control = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    control |= {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid in sorted(decoder):
        tok = decoder[tid]
        if getattr(tok, "special", False) and tid not in control and tid not in never_seen and tid < vocab_size:
            return int(tid)
    raise DFlashError("the tokenizer has no reserved special token to use as the DFlash mask; pass --mask-token-id")


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[train-draft] {msg}", file=sys.stderr, flush=True)


def load_or_generate_data(cfg: TrainConfig, model: Any, tokenizer: Any, data_dir: Path,
                          layer_ids: list[int]) -> list[dict[str, Any]]:
    """Sequences (and, when captured during generation, their features) for the train prompts."""
    from dflash_trt.prompts import interleave, load_prompts
    from dflash_trt.train.data import generate_responses, load_data, save_data

    path = data_dir / "responses.pt"
    prompts = load_prompts("train")
    random.Random(0).shuffle(prompts)  # interleaved categories: any prefix covers all three
    prompts = interleave(prompts)[: cfg.max_prompts]
    want = {p.id for p in prompts}
    if path.is_file():
        stored, meta = load_data(path)
        seqs = [s for s in stored if s["id"] in want]
        if meta.get("capture_layer_ids") != layer_ids:
            for s in seqs:
                s.pop("feats", None)
        _log(f"reusing {len(seqs)} generated responses from {path}")
        return seqs
    _log(f"generating the target's greedy answers to {len(prompts)} train prompts (batch {cfg.gen_batch_size})")
    t0 = time.time()
    meta = {"max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.gen_batch_size, "capture_layer_ids": layer_ids}
    seqs = generate_responses(model, tokenizer, prompts, cfg.max_new_tokens, cfg.gen_batch_size,
                              capture_layer_ids=layer_ids)
    save_data(path, seqs, {**meta, "seconds": time.time() - t0})
    return seqs


def features_of(model: Any, seqs: list[dict[str, Any]], layer_ids: list[int]) -> list[Any]:
    """Per-sequence target features [>= T-1, n*H]: captured during generation, else computed now."""
    from dflash_trt.train.data import compute_features

    todo = [s for s in seqs if "feats" not in s]
    if todo:
        _log(f"computing target features at layers {layer_ids} for {len(todo)} sequences")
        for s, f in zip(todo, compute_features(model, todo, layer_ids)):
            s["feats"] = f
    return [s.pop("feats") for s in seqs]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def train_draft(cfg: TrainConfig) -> dict[str, Any]:
    """Run the whole pipeline; returns the manifest written beside the drafter."""
    import torch

    from dflash_trt.fsutil import atomic_directory, write_json_atomic
    from dflash_trt.runtime.draft_model import DFlashDraftModel, build_target_layer_ids, make_draft_config
    from dflash_trt.runtime.loading import load_target, load_tokenizer, parse_dtype
    from dflash_trt.runtime.target import TargetAdapter
    from dflash_trt.runtime.validate import validate_pair
    from dflash_trt.train.data import load_data
    from dflash_trt.train.objective import default_gamma, dflash_loss_batch

    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    save_dtype = parse_dtype(cfg.save_dtype)
    out = Path(cfg.out)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out.with_name(out.name + ".data")
    device = _training_device(cfg.device)
    online = (cfg.features or ("cached" if device.type == "cpu" else "online")) == "online"
    if device.type == "cuda":  # tf32 matmuls: the features and the drafter tolerate them (bf16 is stored)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(cfg.target, device=str(device))
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(cfg.target)
    tcfg = target.config
    n_layers = int(tcfg.num_hidden_layers)
    # z-lab's spread over the depth (30 layers, 3 features -> [1, 14, 27]); shallow targets dedupe
    layer_ids = cfg.target_layer_ids or sorted(set(build_target_layer_ids(n_layers, cfg.num_target_features)))

    shape = dict(num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=layer_ids,
                 intermediate_size=cfg.intermediate_size)
    # fail on a bad layer id / mask id BEFORE the long data generation, with the loader's own checks
    validate_pair(make_draft_config(tcfg, mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None
                                    else int(tcfg.vocab_size) - 1, **shape), tcfg, where="train-draft")

    extra_seqs = [s for s in load_extra_data(cfg.extra_data) if len(s["ids"]) - s["prompt_len"] >= 2]
    seqs = [s for s in load_or_generate_data(cfg, target, tokenizer, data_dir, layer_ids)
            if len(s["ids"]) - s["prompt_len"] >= 2] + extra_seqs
    if not seqs:
        raise DFlashError(f"no usable training sequences in {data_dir} (every response is shorter than 2 tokens)")
    seen = {t for s in seqs for t in s["ids"][s["prompt_len"]:]}
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token(
        tokenizer, int(tcfg.vocab_size), seen)
    if mask_id in seen:
        _log(f"warning: mask token {mask_id} occurs in the target's responses; acceptance may suffer")

    dcfg = make_draft_config(tcfg, mask_token_id=mask_id, **shape)
    validate_pair(dcfg, tcfg, where="train-draft")
    torch.manual_seed(cfg.seed)
    draft = DFlashDraftModel(dcfg)
    draft.reset_parameters(seed=cfg.seed)
    if cfg.init_from:
        init_from(draft, Path(cfg.init_from))
    draft.to(device).train()

    # cached: per-sequence [>= T-1, n*H] tensors made now; online: the target runs in every step
    if online:
        for s in seqs:
            s.pop("feats", None)  # stored features are not used (nor kept in memory)
    feats = [None] * len(seqs) if online else features_of(target, seqs, layer_ids)
    adapter = TargetAdapter(target)
    n_start = len(seqs)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    embed = target.get_input_embeddings()
    # The frozen 49152-row head dominates a step's cost (its matmul runs forward, and backward
    # into the hidden states). bf16 makes it ~2.5x faster on AVX512-BF16 CPUs; the loss itself
    # is still computed in float32 from those logits.
    head_w = target.get_output_embeddings().weight.detach().to(torch.bfloat16)  # [V, H]

    vocab = int(tcfg.vocab_size)
    head_rows = {"w": head_w, "map": None}  # the rows scored this step (all, or a sampled subset)

    def lm_head(h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V or subset]
        return torch.nn.functional.linear(h.to(torch.bfloat16), head_rows["w"])

    def draw_vocab(seen: torch.Tensor) -> None:
        """Rows for this step: every seen id plus `sampled_vocab` random others."""
        others = torch.ones(vocab, dtype=torch.bool)
        others[seen] = False
        pool = others.nonzero()[:, 0]
        extra = pool[torch.randperm(pool.numel(), generator=gen)[: cfg.sampled_vocab]]
        rows = torch.cat([seen, extra])
        label_map = torch.full((vocab,), -1, dtype=torch.long)
        label_map[rows] = torch.arange(rows.numel())
        head_rows["w"], head_rows["map"] = head_w[rows.to(device)], label_map.to(device)

    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int, elapsed: float) -> float:  # linear warmup, cosine decay to 10%
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.time_limit_s:  # a time-limited run decays on the clock, so it ends at a low lr too
            frac = max(frac, elapsed / cfg.time_limit_s)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []  # this epoch's remaining sequence indices
    known = {s["id"] for s in seqs}
    data_path, data_mtime, last_check = data_dir / "responses.pt", 0.0, time.time()
    if data_path.is_file():
        data_mtime = data_path.stat().st_mtime

    def pick_up_new_data() -> None:
        nonlocal data_mtime
        if not data_path.is_file() or data_path.stat().st_mtime == data_mtime:
            return
        data_mtime = data_path.stat().st_mtime
        stored, meta = load_data(data_path)
        if not online and meta.get("capture_layer_ids") != layer_ids:
            return
        new = [s for s in stored if s["id"] not in known and (online or "feats" in s)
               and len(s["ids"]) - s["prompt_len"] >= 2]
        for s in new:
            known.add(s["id"])
            order.append(len(seqs))  # seen in the current epoch already
            feats.append(s.pop("feats", None))
            seqs.append(s)
        if new:
            _log(f"picked up {len(new)} new sequences ({len(seqs)} in all)")

    # ids that occur anywhere in the data (new sequences picked up later may add a few: those
    # labels are simply left out of the sampled loss until they are drawn as "others")
    seen_ids = torch.tensor(sorted({t for s in seqs for t in s["ids"]}), dtype=torch.long)
    history: list[dict[str, float]] = []
    window: list[tuple[float, float, float]] = []
    t_train = time.time()
    done = 0
    bar = tqdm(total=cfg.steps, desc="training drafter", unit="step", file=sys.stderr)
    for step in range(cfg.steps):
        if cfg.time_limit_s and time.time() - t_train > cfg.time_limit_s:
            _log(f"time limit {cfg.time_limit_s:.0f} s reached after {done} steps")
            break
        if cfg.data_reload_s and time.time() - last_check > cfg.data_reload_s:
            last_check = time.time()
            pick_up_new_data()
        picked = []
        for _ in range(cfg.batch_sequences):
            if not order:
                order = torch.randperm(len(seqs), generator=gen).tolist()
            picked.append(order.pop())
        batch = make_batch([seqs[i] for i in picked], None if online else [feats[i] for i in picked],
                           cfg.anchors_per_seq, gen, device)
        if online:
            batch["feats"] = online_features(adapter, batch["ids"], layer_ids)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, time.time() - t_train)
        if cfg.sampled_vocab is not None:
            draw_vocab(seen_ids)
        loss, st = dflash_loss_batch(draft, embed, lm_head, batch["ids"], batch["lens"], batch["feats"],
                                     batch["anchors"], batch["anchor_ok"], gamma, head_rows["map"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        window.append((loss.item(), st["acc1"], st["tau_est"]))
        done += 1
        bar.update(1)
        if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1:
            l, a, t = (sum(x[j] for x in window if not math.isnan(x[j])) / max(1, sum(not math.isnan(x[j]) for x in window))
                       for j in range(3))
            history.append({"step": step + 1, "loss": round(l, 4), "acc1": round(a, 4), "tau_est": round(t, 3),
                            "elapsed_s": round(time.time() - t_train, 1)})
            bar.set_postfix(loss=f"{l:.3f}", acc1=f"{a:.2f}", tau_est=f"{t:.2f}")
            window = []
    bar.close()
    if window:
        l = sum(x[0] for x in window) / len(window)
        history.append({"step": done, "loss": round(l, 4), "elapsed_s": round(time.time() - t_train, 1)})

    draft.to("cpu").eval()
    manifest = {
        "what": "DFlash drafter (z-lab format) trained by dflash-trt train-draft",
        "target": {"path": str(cfg.target), "architectures": list(getattr(tcfg, "architectures", None) or []),
                   "num_hidden_layers": n_layers, "hidden_size": int(tcfg.hidden_size),
                   "vocab_size": int(tcfg.vocab_size)},
        "mask_token": {"id": mask_id,
                       "token": tokenizer.convert_ids_to_tokens(mask_id) if tokenizer is not None else None,
                       "why": MASK_TOKEN_NOTE if tokenizer is not None else "last vocabulary id (no tokenizer)"},
        "block_size": cfg.block_size,
        "target_layer_ids": layer_ids,
        "command": "dflash-trt " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("dflash-trt", "dflash_trt/cli.py")) else " ".join(sys.argv),
        "config": cfg.model_dump(),
        "data": {"sequences": len(seqs), "sequences_at_start": n_start, "response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in seqs),
                 "prompts": "dflash_trt/prompts/*.jsonl split=train",
                 "responses": f"target greedy, chat template, max_new_tokens={cfg.max_new_tokens}",
                 "extra_sequences": len(extra_seqs), "extra_data": list(cfg.extra_data)},
        "steps": done,
        "final_loss": history[-1]["loss"] if history else None,
        "history": history,
        "num_parameters": draft.num_parameters(),
        "save_dtype": cfg.save_dtype,
        "train_time_s": round(time.time() - t_train, 1),
        "total_time_s": round(time.time() - t_start, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
                    "device": str(device), "features": "online" if online else "cached",
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "seed": cfg.seed,
    }
    with atomic_directory(out, overwrite=True) as tmp:
        draft.save_pretrained(tmp, dtype=save_dtype)
        if cfg.draft_vocab_size:
            from dflash_trt.runtime.draft_vocab import draft_vocab_from_data, save_draft_vocab
            from dflash_trt.runtime.tokens import stop_token_ids_of

            ids, coverage = draft_vocab_from_data(seqs, int(tcfg.vocab_size), cfg.draft_vocab_size,
                                                  always=stop_token_ids_of(tokenizer, tcfg))
            save_draft_vocab(tmp, ids, coverage)
            manifest["draft_vocab"] = {"size": int(ids.numel()), "coverage": round(coverage, 5),
                                       "from": "response tokens of the training data, most frequent first"}
        write_json_atomic(tmp / "MANIFEST.json", manifest)
        tmp.chmod(0o755)  # mkdtemp makes it private; this is a shareable artifact
        for f in tmp.iterdir():
            f.chmod(0o644)
    _log(f"wrote {out} ({draft.num_parameters() / 1e6:.2f}M params, final loss {manifest['final_loss']})")
    return manifest


def _training_device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DFlashError(f"--device {name!r}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DFlashError(f"--device {name}: this torch build or machine has no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise DFlashError(f"--device {name}: training runs on cpu or cuda")
    return device


def load_extra_data(paths: list[str]) -> list[dict[str, Any]]:
    """Sequences of `--extra-data` files (features dropped: made the same way as the main data's)."""
    from dflash_trt.train.data import load_data

    out: list[dict[str, Any]] = []
    for p in paths:
        if not Path(p).is_file():
            raise DFlashError(f"--extra-data {p}: no such file (a responses.pt from dflash_trt.train.data or .sampled)")
        stored, _ = load_data(Path(p))
        for s in stored:
            s.pop("feats", None)
        _log(f"{len(stored)} extra sequences from {p}")
        out.extend(stored)
    return out


def make_batch(seqs: list[dict[str, Any]], feats: list[Any] | None, anchors_per_seq: int, gen: Any,
               device: Any) -> dict[str, Any]:
    """Right-padded tensors for :func:`dflash_loss_batch` on `device`: ids [S, T], lens [S],
    anchors and anchor_ok [S, A] (a row with fewer anchors repeats its first, marked not ok),
    and, with cached `feats`, feats [S, C, n*H] (zeros past each row's own features)."""
    import torch

    from dflash_trt.train.objective import sample_anchors

    S, T = len(seqs), max(len(s["ids"]) for s in seqs)
    ids = torch.zeros((S, T), dtype=torch.long)
    picks = [sample_anchors(s["prompt_len"], len(s["ids"]), anchors_per_seq, gen) for s in seqs]
    A = max(p.numel() for p in picks)
    anchors = torch.zeros((S, A), dtype=torch.long)
    ok = torch.zeros((S, A), dtype=torch.bool)
    for r, (s, p) in enumerate(zip(seqs, picks)):
        ids[r, : len(s["ids"])] = torch.tensor(s["ids"])
        anchors[r] = p[0]
        anchors[r, : p.numel()] = p
        ok[r, : p.numel()] = True
    batch = {"ids": ids, "lens": torch.tensor([len(s["ids"]) for s in seqs]), "anchors": anchors, "anchor_ok": ok}
    if feats is not None:
        C = max(f.shape[0] for f in feats)
        padded = torch.zeros((S, C, feats[0].shape[1]), dtype=feats[0].dtype)
        for r, f in enumerate(feats):
            padded[r, : f.shape[0]] = f
        batch["feats"] = padded
    return {k: v.to(device) for k, v in batch.items()}


def online_features(adapter: Any, ids: Any, layer_ids: list[int]) -> Any:
    """The frozen target's features [S, T, n*H] of a right-padded batch (causal: padding after a
    row never changes that row's positions)."""
    import torch

    with torch.no_grad():
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        _, f = adapter.forward(ids, pos, adapter.new_cache(), layer_ids, logits_to_keep=1)
    return f


def init_from(draft: Any, source: Path) -> None:
    """Copy a trained drafter's weights into `draft` (e.g. grow 1 layer into 2 and keep training).

    Every tensor of `source` must exist in `draft` with the same shape, and both must agree on
    mask token, target layer ids and block size (otherwise the copied weights would mean
    something else). Layers `source` lacks keep their random init except their two output
    projections (attention o_proj, MLP down_proj), which are zeroed: a residual block with zero
    output is the identity, so training starts exactly from the source drafter's predictions.
    """
    import torch

    from dflash_trt.runtime.draft_model import DFlashDraftModel

    src = DFlashDraftModel.from_pretrained(source)
    for what in ("mask_token_id", "target_layer_ids", "block_size"):
        if getattr(src, what) != getattr(draft, what):
            raise DFlashError(f"--init-from {source}: {what} is {getattr(src, what)} there but "
                              f"{getattr(draft, what)} in this run; pass the same value or drop --init-from")
    mine = draft.state_dict()
    theirs = {k: v for k, v in src.state_dict().items() if not k.startswith("rotary_emb.")}
    for k, v in theirs.items():
        if k not in mine or mine[k].shape != v.shape:
            raise DFlashError(f"--init-from {source}: tensor {k} {tuple(v.shape)} has no match in this drafter "
                              f"({tuple(mine[k].shape) if k in mine else 'absent'}); use the same sizes or more layers")
    with torch.no_grad():
        for k, v in theirs.items():
            mine[k].copy_(v.to(mine[k].dtype))
        for i in range(len(src.layers), len(draft.layers)):
            draft.layers[i].self_attn.o_proj.weight.zero_()
            draft.layers[i].mlp.down_proj.weight.zero_()
    _log(f"initialised from {source}: {len(theirs)} tensors copied, "
         f"{len(draft.layers) - len(src.layers)} new layer(s) start as identity")


def read_manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "MANIFEST.json").read_text(encoding="utf-8"))
