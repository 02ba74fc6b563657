"""Commands of the training area: `setup-default`, `train-draft`, `train-data`, `draft-vocab`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from dflash_trt.cli_helpers import friendly_errors, int_list, no_progress_option
from dflash_trt.errors import DFlashError
from dflash_trt.runtime_options import DTYPE_NAMES


@click.command("setup-default")
@click.option("--rebuild", is_flag=True, help="Convert again even if a valid cache exists.")
@friendly_errors
def setup_default(rebuild: bool) -> None:
    """Convert the embedded SmolLM2-135M-Instruct target (GGUF from PyPI) into the local cache.

    Writes ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/smollm2-135m-instruct once; later runs only
    validate it. Prints the target and drafter directories.
    """
    from dflash_trt.embedded import DRAFT_DIR, ensure_default_target

    target = ensure_default_target(rebuild=rebuild)
    click.echo(f"target: {target}")
    click.echo(f"draft:  {DRAFT_DIR}" + ("" if (DRAFT_DIR / "config.json").is_file() else " (missing)"))


@click.command("train-draft")
@click.option("--target", "target", type=click.Path(file_okay=False),
              help="Target HF checkpoint directory. Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Where to write the drafter (z-lab format).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="YAML/JSON file with TrainConfig fields; flags given on the command line override it.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Cache for responses and target features [<out>.data].")
@click.option("--max-prompts", type=click.IntRange(min=1), help="Use at most N train prompts (all by default).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="Response length cap when generating data [256].")
@click.option("--gen-batch-size", type=click.IntRange(min=1), help="Answers decoded together (continuous batching: a finished answer frees its row for the next prompt) [64].")
@click.option("--block-size", type=click.IntRange(min=2), help="Drafter block size B [16].")
@click.option("--num-layers", type=click.IntRange(min=1), help="Drafter decoder layers [1].")
@click.option("--intermediate-size", type=click.IntRange(min=1), help="Drafter MLP width [768].")
@click.option("--target-layer-ids", callback=int_list("1,14,27"),
              help="Comma-separated target layers feeding the drafter [z-lab default for 3].")
@click.option("--mask-token-id", type=int, help="Mask token id [a reserved special token of the tokenizer].")
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (one sequence, many blocks each) [1000].")
@click.option("--time-limit", "time_limit_s", type=click.FloatRange(min=1), help="Stop training after this many seconds (still saves).")
@click.option("--data-reload", "data_reload_s", type=click.FloatRange(min=1),
              help="Every N seconds, pick up sequences a separate data job appended to <data-dir>/responses.pt.")
@click.option("--warmup-steps", type=click.IntRange(min=0), help="Linear lr warmup steps [50].")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), help="Peak learning rate [1e-3].")
@click.option("--anchors-per-seq", type=click.IntRange(min=1), help="Blocks trained per sequence per step [32].")
@click.option("--seed", type=int, help="Random seed [0].")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: torch's choice).")
@click.option("--init-from", type=click.Path(file_okay=False, exists=True),
              help="Start from this trained drafter (same mask/layer ids; extra layers start as identity).")
@click.option("--sampled-vocab", type=click.IntRange(min=0),
              help="Sampled softmax: loss over the ids seen in the data plus N random others per step (~2x faster).")
@click.option("--draft-vocab-size", type=click.IntRange(min=0),
              help="Write draft_vocab.json: the N tokens the answers use most, drafted over by the batched runtime (0: none) [8192].")
@click.option("--device", help="Train on cpu, cuda or cuda:N [cpu]. On a GPU the target computes each step's features itself.")
@click.option("--batch-sequences", type=click.IntRange(min=1), help="Sequences per optimizer step, in one padded forward [1; 16-64 on a GPU].")
@click.option("--features", type=click.Choice(["cached", "online"]),
              help="Target features computed once before training (cached) or in every step (online) [cached on cpu, else online].")
@click.option("--extra-data", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="More sequences to train on (an answer file from `dflash-trt train-data`); repeatable.")
@click.option("--save-dtype", type=click.Choice(DTYPE_NAMES), help="Weights dtype on disk [bfloat16].")
@click.option("--family", type=click.Choice(["dflash", "dflash2"]),
              help="Drafter family: dflash (v1) or dflash2 (convolutions + candidate selector) [--init-from's, else dflash].")
@click.option("--conv-kernel-size", type=click.IntRange(min=1), help="DFlash2: convolution taps [--init-from's, else 2].")
@click.option("--conv-group-size", type=click.IntRange(min=1),
              help="DFlash2: channels sharing a dynamic coefficient; divides the hidden size [--init-from's, else 16].")
@click.option("--selector-rank", type=click.IntRange(min=1), help="DFlash2: rank of the selector's codebooks [--init-from's, else 256].")
@click.option("--selector-top-k", type=click.IntRange(min=2), help="DFlash2: candidates the selector walks per slot [--init-from's, else 16].")
@click.option("--selector-loss-weight", type=click.FloatRange(min=0),
              help="DFlash2: weight of the selector's loss beside the block loss [1.0].")
@no_progress_option()
@friendly_errors
def train_draft(target: str | None, out: str, config_file: str | None, no_progress: bool, **flags) -> None:
    """Train a DFlash or DFlash2 drafter for TARGET on its own greedy answers to the project's train prompts."""
    from dflash_trt.config import config_line
    from dflash_trt.train.trainer import train_draft as run

    cfg = _resolve_config(target, out, config_file, flags)
    click.echo(config_line("train-draft", cfg), err=True)
    manifest = run(cfg, progress=not no_progress)
    click.echo(f"drafter: {cfg.out}  steps={manifest['steps']}  final_loss={manifest['final_loss']}  "
               f"params={manifest['num_parameters']}  time={manifest['total_time_s']}s")


def _resolve_config(target: str | None, out: str, config_file: str | None, flags: dict[str, Any]):
    """TrainConfig from --config, then the flags; no target anywhere: the embedded one."""
    from dflash_trt.config import load_config
    from dflash_trt.train.config import TrainConfig

    flags = {**flags, "target": target, "out": out, "extra_data": list(flags["extra_data"]) or None,
             "target_layer_ids": flags["target_layer_ids"]}
    cfg = load_config(TrainConfig, config_file, flags, what="train-draft config")
    if cfg.target is None:
        from dflash_trt.embedded import ensure_default_target

        cfg = cfg.model_copy(update={"target": str(ensure_default_target())})
    return cfg


@click.command("train-data")
@click.argument("target", type=click.Path(file_okay=False))
@click.argument("out_file", type=click.Path(dir_okay=False))
@click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Answers per prompt (more than 1 needs --temperature > 0).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0: greedy answers (train-draft's data); > 0: sampled ones.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Answer length cap.")
@click.option("--batch-prompts", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompts decoded together; rows = this x --samples.")
@click.option("--capture-layers", callback=int_list("1,14,27"),
              help="Also store the target's features at these comma-separated layers.")
@click.option("--max-prompts", type=click.IntRange(min=1), help="Answer only the first N train prompts (all by default).")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompt order and the samples' draws.")
@click.option("--time-limit", "time_limit_s", type=click.FloatRange(min=0, min_open=True),
              help="Start no new answer after this many seconds.")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="float32",
              show_default=True, help="Target weights dtype.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: torch's choice).")
@no_progress_option()
@friendly_errors
def train_data(target: str, out_file: str, samples: int, temperature: float, max_new_tokens: int,
               batch_prompts: int, capture_layers: list[int] | None, max_prompts: int | None, seed: int,
               time_limit_s: float | None, dtype: str, device: str, threads: int | None, no_progress: bool) -> None:
    """Write the target's answers to the project's train prompts into OUT_FILE (resumable).

    Greedy by default (the data `train-draft` makes itself); with --samples N --temperature T,
    N sampled answers per prompt for `train-draft --extra-data` (`python -m dflash_trt.train.sampled`
    is this command with --samples 8 --temperature 0.7 --device cuda as defaults).
    """
    from dflash_trt.train.answers import AnswerSettings
    from dflash_trt.train.data import extend_answer_file

    if threads:
        import torch

        torch.set_num_threads(threads)
    settings = AnswerSettings(max_new_tokens=max_new_tokens, batch_size=batch_prompts * samples, samples=samples,
                              temperature=temperature, seed=seed,
                              capture_layer_ids=tuple(capture_layers) if capture_layers else None,
                              time_limit_s=time_limit_s, progress=not no_progress)
    t0 = time.time()
    kept, added = extend_answer_file(target, out_file, settings, max_prompts, dtype=dtype, device=device)
    click.echo(f"wrote {kept + added} sequences to {out_file} ({added} new) in {time.time() - t0:.0f} s")


@click.command("draft-vocab")
@click.argument("draft_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--data", "data_file", required=True, type=click.Path(dir_okay=False, exists=True),
              help="responses.pt of the drafter's self-distilled data (train-draft's <out>.data/responses.pt).")
@click.option("--size", default=8192, show_default=True, type=click.IntRange(min=1),
              help="At most this many token ids (all tokens the answers use, if fewer).")
@friendly_errors
def draft_vocab(draft_dir: str, data_file: str, size: int) -> None:
    """Write DRAFT_DIR/draft_vocab.json for an existing drafter from its training answers.

    The batched runtime then drafts over these tokens only (verification keeps the full
    vocabulary, so output is unchanged); other loaders ignore the file."""
    from types import SimpleNamespace

    from dflash_trt.checkpoints.files import read_json
    from dflash_trt.runtime.drafters.draft_vocab import draft_vocab_from_data, save_draft_vocab
    from dflash_trt.runtime.decoding.tokens import stop_token_ids_of
    from dflash_trt.train.data import load_data

    cfg = read_json(Path(draft_dir) / "config.json", what="drafter config")
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int):
        raise DFlashError(f"{draft_dir}/config.json has no vocab_size; is this a DFlash drafter directory?")
    seqs, _ = load_data(Path(data_file))
    stops = stop_token_ids_of(None, SimpleNamespace(eos_token_id=cfg.get("eos_token_id")))  # the drafter config's, if any
    ids, coverage = draft_vocab_from_data(seqs, vocab, size, always=stops)
    path = save_draft_vocab(draft_dir, ids, coverage)
    click.echo(f"{path}: {ids.numel()} token ids covering {coverage:.2%} of {len(seqs)} answers' tokens")


COMMANDS = [setup_default, train_draft, train_data, draft_vocab]
