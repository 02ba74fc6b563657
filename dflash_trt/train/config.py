"""`TrainConfig`: every knob of a drafter training run, typed and strict.

`dflash-trt train-draft` loads it with the one config loader (dflash_trt/config.py: ``--config``
YAML/JSON, then the flags) and prints it; the drafter's MANIFEST.json records it whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.runtime_options import DtypeName

# speculators 0.9.0's DFlash2SpeculatorConfig defaults, the recipe a DFlash2 run starts from
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


class TrainConfig(BaseModel):
    """Every knob of a drafter training run (recorded in MANIFEST.json)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct (resolved by `train-draft`)
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
    save_dtype: DtypeName = "bfloat16"
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
    # batched runtime drafts over them only; runtime/drafters/draft_vocab.py). 0: do not write one.
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
    # The drafter family: "dflash" (v1) or "dflash2" (convolutions + candidate selector,
    # runtime/drafters/dflash2.py). None: the family of the `init_from` drafter, else "dflash".
    family: Literal["dflash", "dflash2"] | None = None
    # DFlash2's recipe (dflash_config keys). None: the `init_from` drafter's own when it is a
    # DFlash2 drafter, else speculators 0.9.0's defaults (DFLASH2_DEFAULTS).
    conv_kernel_size: int | None = Field(None, ge=1)
    conv_group_size: int | None = Field(None, ge=1)
    selector_rank: int | None = Field(None, ge=1)
    selector_top_k: int | None = Field(None, ge=2)  # one candidate leaves the walk no choice
    # DFlash2: loss = block loss + this x the selector's loss (speculators' selector_loss_alpha)
    selector_loss_weight: float = Field(1.0, ge=0)

    def recipe_flags(self) -> dict[str, int]:
        """The DFlash2 recipe fields this run sets (the others come from --init-from or the defaults)."""
        return {k: getattr(self, k) for k in DFLASH2_DEFAULTS if getattr(self, k) is not None}

    @property
    def data_dir_path(self) -> Path:
        """Where responses.pt and feature caches live: `data_dir`, else ``<out>.data``."""
        out = Path(self.out)
        return Path(self.data_dir) if self.data_dir else out.with_name(out.name + ".data")
