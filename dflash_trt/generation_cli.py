"""`dflash-trt generate`: resolve the pair, encode the prompt, decode, print text and statistics."""

from __future__ import annotations

from typing import Any

import click

from dflash_trt.errors import DFlashError


def encode_prompt(tokenizer: Any, prompt: str, raw: bool, vocab_size: int) -> list[int]:
    """Token ids the target sees: the chat template applied unless `raw` (or no template)."""
    if tokenizer is None:  # tiny random pair: bytes folded into the vocabulary
        return [b % vocab_size for b in prompt.encode("utf-8")] or [0]
    if not raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        )
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def stop_ids_of(tokenizer: Any, model_config: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    gen_cfg = getattr(model_config, "_generation_eos", None)
    if gen_cfg:
        ids.update(gen_cfg)
    return sorted(ids)


def decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=True)


def resolve_pair(target_dir: str | None, draft_dir: str | None, tiny: bool, dtype: str, allow_pickle: bool,
                 engine_dir: str | None = None, device: str = "cpu"):
    """The pair to run: an engine directory, explicit directories, a tiny random pair, or the embedded default.

    Loaded straight onto `device`: CPU-packed linear layers (runtime/cpu_packing.py) cannot be
    moved to a GPU afterwards, so a pair must never be loaded on CPU and then moved."""
    from dflash_trt.runtime.loading import LoadedPair, load_pair

    if engine_dir is not None:
        if target_dir or draft_dir or tiny:
            raise DFlashError("--engine already holds the target and drafter; drop --target/--draft/--tiny")
        from dflash_trt.engine.loader import load_engine

        return load_engine(engine_dir, dtype=dtype, device=device)
    if tiny:
        from dflash_trt.runtime.tiny import random_draft, tiny_target

        target = tiny_target("llama")
        return LoadedPair(target.to(device), random_draft(target.config, num_layers=1, block_size=8).to(device), None)
    if bool(target_dir) != bool(draft_dir):
        raise DFlashError("pass both --target and --draft, or neither (to use the embedded default pair)")
    if target_dir is None:
        from dflash_trt.embedded import default_pair_dirs

        target_dir, draft_dir = default_pair_dirs()
    return load_pair(target_dir, draft_dir, dtype=dtype, device=device, allow_pickle=allow_pickle)


def run_generate(*, prompt: str, target_dir: str | None, draft_dir: str | None, engine_dir: str | None, tiny: bool,
                 max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, raw: bool, as_json: bool, compare: bool,
                 dtype: str, allow_pickle: bool) -> None:
    from dflash_trt.cli import emit_json
    from dflash_trt.runtime.generate import autoregressive_generate, dflash_generate

    pair = resolve_pair(target_dir, draft_dir, tiny, dtype, allow_pickle, engine_dir)
    ids = encode_prompt(pair.tokenizer, prompt, raw, int(pair.target.config.vocab_size))
    stop = stop_ids_of(pair.tokenizer, pair.target.config)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_token_ids=stop, seed=seed)
    result = dflash_generate(pair.draft, pair.target, ids, **kw)
    text = decode(pair.tokenizer, result.output_ids)
    report: dict[str, Any] = {"prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "text": text}
    report.update(result.stats.to_dict())
    if compare:
        plain = autoregressive_generate(pair.target, ids, **kw)
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
        f"tokens/s={s.tokens_per_s:.1f} finish={s.finish_reason}", err=True,
    )
    if compare:
        click.echo(
            f"[plain ] tpot={report['plain_tpot_s'] * 1e3:.1f}ms -> speedup {report['speedup']:.2f}x "
            f"(identical output: {report['identical_to_plain']})", err=True,
        )
