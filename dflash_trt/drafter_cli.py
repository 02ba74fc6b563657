"""Commands on drafter checkpoints: `convert-draft` (the formats: runtime/drafters/speculators_format.py)."""

from __future__ import annotations

import click

from dflash_trt.runtime.drafters.speculators_format import FORMATS
from dflash_trt.cli_helpers import emit_json, friendly_errors


@click.command("convert-draft")
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--to", "to", required=True, type=click.Choice(FORMATS),
              help="The format to write: zlab (z-lab, TensorRT-LLM, SGLang, vLLM) or speculators (vLLM).")
@click.option("--verifier", help="--to speculators: the target's name or path, recorded as the speculator's verifier "
                                 "(its architectures read from DIR/config.json when it is a directory).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as one JSON line.")
@friendly_errors
def convert_draft(src: str, out: str, to: str, verifier: str | None, force: bool, as_json: bool) -> None:
    """Write the DFlash / DFlash2 drafter in SRC (z-lab or speculators format) to OUT in format --to.

    Each engine gets the format it loads: TensorRT-LLM and z-lab read z-lab's, vLLM both. The
    weights are copied bit for bit and every config field keeps its meaning, so converting back
    gives the same drafter. What the other format cannot say is refused in one line (e.g. causal
    full-attention layers, or input_embedding_scale, for speculators). OUT is written to a
    temporary directory and renamed into place when complete.
    """
    from dflash_trt.runtime.drafters.convert import convert_drafter

    done = convert_drafter(src, out, to, verifier=verifier, overwrite=force)
    if as_json:
        emit_json(done)
    else:
        click.echo(f"wrote {done['out']}: {done['family']} drafter, {done['format']} format, {done['tensors']} tensors")


COMMANDS = (convert_draft,)
