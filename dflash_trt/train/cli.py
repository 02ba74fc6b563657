"""Commands of the training area: `setup-default`, `train-draft`, `draft-vocab`."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_trt.cli_helpers import friendly_errors
from dflash_trt.errors import DFlashError


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
@click.option("--target-layer-ids", help="Comma-separated target layers feeding the drafter [z-lab default for 3].")
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
              help="More sequences to train on (responses.pt from `python -m dflash_trt.train.sampled`); repeatable.")
@click.option("--save-dtype", type=click.Choice(["bfloat16", "float16", "float32"]), help="Weights dtype on disk [bfloat16].")
@friendly_errors
def train_draft(target: str | None, out: str, config_file: str | None, **flags) -> None:
    """Train a DFlash drafter for TARGET on its own greedy answers to the project's train prompts."""
    from dflash_trt.train.trainer import TrainConfig, train_draft as run

    cfg = _resolve_config(target, out, config_file, flags)
    click.echo("resolved config: " + cfg.model_dump_json(), err=True)
    manifest = run(cfg)
    click.echo(f"drafter: {cfg.out}  steps={manifest['steps']}  final_loss={manifest['final_loss']}  "
               f"params={manifest['num_parameters']}  time={manifest['total_time_s']}s")
    del TrainConfig


def _resolve_config(target: str | None, out: str, config_file: str | None, flags: dict):
    from pydantic import ValidationError

    from dflash_trt.errors import DFlashError
    from dflash_trt.train.trainer import TrainConfig

    base: dict = {}
    if config_file:
        import yaml

        try:
            base = yaml.safe_load(Path(config_file).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise DFlashError(f"{config_file}: not valid YAML/JSON ({str(e).splitlines()[0]})")
        if not isinstance(base, dict):
            raise DFlashError(f"{config_file}: must hold a mapping of TrainConfig fields")
    ids = flags.pop("target_layer_ids", None)
    if ids:
        try:
            flags["target_layer_ids"] = [int(x) for x in ids.split(",")]
        except ValueError:
            raise DFlashError(f"--target-layer-ids {ids!r}: give comma-separated integers, e.g. 1,14,27")
    if not flags.get("extra_data"):
        flags.pop("extra_data", None)  # an empty tuple from click: keep the file's list, if any
    else:
        flags["extra_data"] = list(flags["extra_data"])
    base.update({k: v for k, v in flags.items() if v is not None})
    if target is None and "target" not in base:
        from dflash_trt.embedded import ensure_default_target

        target = str(ensure_default_target())
    if target is not None:
        base["target"] = target
    base["out"] = out
    try:
        return TrainConfig(**base)
    except ValidationError as e:
        err = e.errors()[0]
        raise DFlashError(f"train-draft config: {'.'.join(map(str, err['loc']))}: {err['msg']}")


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

    from dflash_trt.runtime.checkpoint import read_json
    from dflash_trt.runtime.draft_vocab import draft_vocab_from_data, save_draft_vocab
    from dflash_trt.runtime.tokens import stop_token_ids_of
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


COMMANDS = [setup_default, train_draft, draft_vocab]
