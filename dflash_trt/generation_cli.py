"""`dflash-trt generate`: resolve the pair, encode the prompt, decode, print text and statistics.

``--policy fixed`` (default) runs the reference loop (runtime/reference/generate.py): K drafts verified every
step. ``--policy adaptive`` runs the batched runtime at one sequence with the adaptive policy,
which picks k <= K per step as `serve` does; ``--policy schedule`` the batched runtime drafting the
draft-length schedule's k at one row (``--draft-len-schedule``, or the engine's). ``--compare`` decodes plainly on the same runtime: the
reference loop's plain decoding, or the batched runtime without a drafter.
"""

from __future__ import annotations

from typing import Any

import click

from dflash_trt.cli_helpers import (draft_len_schedule_option, draft_method_option, emit_json, friendly_errors,
                                    max_draft_len_option, policy_option)
from dflash_trt.runtime_options import DTYPE_CHOICES


@click.command("generate")
@click.argument("prompt")
@click.option("--target", "target_dir", type=click.Path(file_okay=False), help="Target HF checkpoint directory.")
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False), help="DFlash drafter directory (z-lab format).")
@click.option("--engine", "engine_dir", type=click.Path(file_okay=False),
              help="Engine directory from `dflash-trt build` (none/fp8/nvfp4; dequantized to run on CPU).")
@click.option("--tiny", is_flag=True, help="Use a tiny randomly initialised pair (no checkpoint; smoke tests).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus mass in (0, 1].")
@click.option("--seed", default=0, show_default=True, type=int)
@max_draft_len_option()
@policy_option("fixed", "fixed: the reference loop, K drafts every step; adaptive: the batched runtime "
                        "chooses k <= K per step from measured costs (as `serve` does); schedule: the batched "
                        "runtime drafts --draft-len-schedule's k at one row (as a TensorRT-LLM node does).")
@draft_method_option()
@draft_len_schedule_option()
@click.option("--raw", is_flag=True, help="Do not apply the tokenizer's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ids, text, statistics).")
@click.option("--compare/--no-compare", default=False, show_default=True,
              help="Also run plain decoding on the same prompt and report the speedup.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="Weights dtype (auto: bfloat16 where the device multiplies it natively, else float32).")
@click.option("--allow-pickle", is_flag=True, help="Allow pickle weight files (they can run code).")
@friendly_errors
def generate(prompt: str, target_dir: str | None, draft_dir: str | None, engine_dir: str | None, tiny: bool,
             max_new_tokens: int, temperature: float, top_p: float, seed: int, max_draft_len: int | None,
             policy: str, draft_method: str | None, draft_len_schedule: str | None, raw: bool, as_json: bool,
             compare: bool, dtype: str, allow_pickle: bool) -> None:
    """Generate text for PROMPT with DFlash and print it with acceptance statistics."""
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.batched.runtime import batched_generate
    from dflash_trt.runtime.reference.generate import autoregressive_generate, dflash_generate
    from dflash_trt.runtime.decoding.tokens import check_text
    from dflash_trt.sampling_params import SamplingParams

    # the prompt and the sampling parameters are checked before anything is loaded
    check_text(prompt)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    from dflash_trt.runtime_options import RuntimeOptions

    source = PairSource(target_dir, draft_dir, engine=engine_dir, tiny=tiny, allow_pickle=allow_pickle)
    pair = load_pair(source, RuntimeOptions(dtype=dtype), max_draft_len=max_draft_len, policy=policy,
                     draft_method=draft_method, draft_len_schedule=draft_len_schedule)
    ids = pair.codec.encode(prompt, raw=raw)
    pair.codec.check_room(ids, max_new_tokens)  # an engine's max_seq_len bounds prompt + output
    params = params.with_stop_token_ids(pair.codec.stop_token_ids)
    batched = pair.speculation.policy != "fixed"  # adaptive and schedule choose k per step: the batched runtime
    if batched:
        result = batched_generate(pair.draft, pair.target, [ids], params, speculation=pair.speculation)[0]
    else:
        result = dflash_generate(pair.draft, pair.target, ids, params, pair.speculation)
    text = pair.codec.decode(result.output_ids)
    report: dict[str, Any] = {"prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "text": text,
                              "speculation": pair.speculation.to_dict()}
    report.update(result.stats.to_dict())
    if compare:  # plain decoding on the same runtime: the batched one's own plain mode beside the adaptive policy
        plain = (batched_generate(None, pair.target, [ids], params)[0] if batched
                 else autoregressive_generate(pair.target, ids, params))
        report["plain_tpot_s"] = plain.stats.tpot_s
        report["speedup"] = plain.stats.tpot_s / result.stats.tpot_s if result.stats.tpot_s else 0.0
        report["identical_to_plain"] = plain.output_ids == result.output_ids
    if as_json:
        emit_json(report)
        return
    s = result.stats
    click.echo(text)
    click.echo(
        f"\n[dflash] tokens={s.num_output_tokens} steps={s.num_steps} tau={s.tau:.2f} "
        f"acceptance_rate={s.acceptance_rate:.2f} ttft={s.ttft_s * 1e3:.0f}ms tpot={s.tpot_s * 1e3:.1f}ms "
        f"tokens/s={s.tokens_per_s:.1f} finish={s.finish_reason} "
        f"K={pair.speculation.max_draft_len} policy={pair.speculation.policy} "
        f"draft_method={pair.speculation.draft_method}", err=True,
    )
    if compare:
        click.echo(
            f"[plain ] tpot={report['plain_tpot_s'] * 1e3:.1f}ms -> speedup {report['speedup']:.2f}x "
            f"(identical output: {report['identical_to_plain']})", err=True,
        )


COMMANDS = [generate]
