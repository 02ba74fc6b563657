"""The multi-turn workload: conversations that resend a long shared prefix, prefix cache on against off.

What chat and agent loops send: a shared system prompt of ~1,000 tokens (``system_prompt``: notes
made of the project's train prompts, whole ones, until the chat template's ids reach the length),
then turns; turn t's prompt is the system prompt, every earlier user message and answer, and the
next user message (the held-out prompts, round-robin over the categories). C users, each driving
one conversation at a time in a closed loop: a turn is sent when the previous one's answer came
back, a user takes the next conversation when its own ended.

One run measures both sides on the batched runtime, over one loaded pair: the prefix cache on and
off (everything else equal), each level of C in alternating order. Per side: TTFT, TPOT, output
tokens/s of the whole run, tau, the prompt tokens served from the cache (hit rate), the cache's
memory against its budget, and whether every answer equals the other side's (greedy: the cache is
lossless). The TTFT probe times one prompt whose first ``probe_cached`` tokens are cached against
the same prompt uncached, alternately (a ratio taken side by side on a shared machine).

scripts/context_recompute_tail.py runs the same conversations with the drafter blind to the cached
prefix (TensorRT-LLM's context_recompute_tail).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_trt.metrics import summarize

SYSTEM_HEAD = ("You are a careful, friendly assistant. Answer the user's questions clearly and briefly. "
               "The notes below are questions other users asked this week; use them only as context.\n\n")


def system_prompt(codec: Any, tokens: int, split: str = "train") -> str:
    """A system prompt whose chat-templated ids (alone, as a system message) reach `tokens`: the head,
    then numbered notes made of the project's `split` prompts, whole ones."""
    from dflash_trt.prompts import interleave, load_prompts

    text = SYSTEM_HEAD
    notes = iter(interleave(load_prompts(split)))
    n = 0
    while len(codec.encode_messages([{"role": "system", "content": text}])) < tokens:
        n += 1
        text += f"Note {n}: {next(notes).prompt}\n"
    return text


def conversations(count: int, turns: int, split: str = "eval") -> list[list[str]]:
    """`count` conversations of `turns` user messages: the held-out prompts, round-robin over the
    categories, each used once while there are enough."""
    from dflash_trt.prompts import interleave, load_prompts

    prompts = [p.prompt for p in interleave(load_prompts(split))]
    return [[prompts[(c * turns + t) % len(prompts)] for t in range(turns)] for c in range(count)]


@dataclass
class TurnRecord:
    """One turn's figures (times in seconds on the run's clock)."""

    conversation: int
    turn: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_reused_blocks: int
    num_missed_blocks: int
    num_output_tokens: int
    ttft_s: float
    tpot_s: float
    t_submit: float
    t_end: float
    acceptance_lengths: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def run_conversations(rt: Any, codec: Any, system: str, convs: Sequence[Sequence[str]], concurrency: int,
                      params: Callable[[int, int], Any]) -> tuple[list[TurnRecord], float]:
    """Drive `convs` through the runtime with `concurrency` users (see the module doc). `params(c, t)`:
    conversation c's turn t's SamplingParams. Returns the turns' records (in conversation, turn order)
    and the run's wall time."""
    from dflash_trt.runtime.batched.runtime import SequenceRequest

    t0 = time.perf_counter()
    todo = deque(range(len(convs)))
    history: dict[int, list[dict[str, str]]] = {}
    live: dict[int, tuple[int, int, float]] = {}  # id(seq) -> (conversation, turn, t_submit)
    records: list[TurnRecord] = []

    def send(c: int, t: int) -> None:
        msgs = history.setdefault(c, [{"role": "system", "content": system}])
        msgs.append({"role": "user", "content": convs[c][t]})
        seq = rt.add(SequenceRequest(codec.encode_messages(msgs), params(c, t)))
        live[id(seq)] = (c, t, time.perf_counter() - t0)

    while todo and len(live) < concurrency:
        send(todo.popleft(), 0)
    while live:
        for seq in rt.step():
            c, t, t_submit = live.pop(id(seq))
            if seq.error is not None:
                raise RuntimeError(f"conversation {c} turn {t} failed: {seq.error}")
            res = seq.result
            s = res.stats
            records.append(TurnRecord(c, t, s.num_prompt_tokens, s.num_cached_tokens, s.num_reused_blocks,
                                      s.num_missed_blocks, len(res.output_ids), s.ttft_s, s.tpot_s, t_submit,
                                      time.perf_counter() - t0, list(s.acceptance_lengths), list(res.output_ids)))
            answer = [i for i in res.output_ids if i not in codec.stop_token_ids]
            history[c].append({"role": "assistant", "content": codec.decode(answer)})
            if t + 1 < len(convs[c]):
                send(c, t + 1)
            elif todo:
                send(todo.popleft(), 0)
    return sorted(records, key=lambda r: (r.conversation, r.turn)), time.perf_counter() - t0


def pooled_tau(steps_by_conversation: Sequence[Sequence[int]]) -> float:
    """Tau pooled over every step of the conversations given (tokens committed / steps)."""
    steps = [a for conv in steps_by_conversation for a in conv]
    return sum(steps) / len(steps) if steps else 0.0


def tau_halfwidth(steps_by_conversation: Sequence[Sequence[int]], resamples: int = 2000, seed: int = 0) -> float:
    """Half the width of the 95% percentile bootstrap interval of the pooled tau, conversations
    resampled whole (their turns and steps with them: turns of one conversation are not independent)."""
    import random

    rng = random.Random(seed)
    n = len(steps_by_conversation)
    if n == 0:
        return 0.0
    taus = sorted(pooled_tau([steps_by_conversation[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return (taus[int(0.975 * (resamples - 1))] - taus[int(0.025 * (resamples - 1))]) / 2


def steps_by_conversation(records: Sequence[TurnRecord]) -> list[list[int]]:
    convs = sorted({r.conversation for r in records})
    return [[a for r in records if r.conversation == c for a in r.acceptance_lengths] for c in convs]


def summary(records: Sequence[TurnRecord], wall_s: float) -> dict[str, Any]:
    """One side's figures over its turns (tau pooled over every step, as metrics.merge_stats)."""
    steps = [a for r in records for a in r.acceptance_lengths]
    prompt = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.num_cached_tokens for r in records)
    out = sum(r.num_output_tokens for r in records)
    return {"turns": len(records), "wall_s": round(wall_s, 3), "output_tokens": out,
            "tokens_per_s": out / wall_s if wall_s > 0 else 0.0,
            "ttft_s": summarize([r.ttft_s for r in records]),
            "tpot_s": summarize([r.tpot_s for r in records if r.num_output_tokens > 1]),
            "tau": sum(steps) / len(steps) if steps else 0.0, "steps": len(steps),
            "tau_interval_halfwidth": tau_halfwidth(steps_by_conversation(records)),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "reused_blocks": sum(r.num_reused_blocks for r in records),
            "missed_blocks": sum(r.num_missed_blocks for r in records)}


def ttft_probe(rt_on: Any, rt_off: Any, prompt: Sequence[int], cached: int, reps: int, params: Any
               ) -> dict[str, Any]:
    """TTFT of `prompt` with its first `cached` tokens in the cache (`rt_on`, warmed each time by a
    request sharing exactly those tokens) against the same prompt on `rt_off`, in alternating order."""
    from dflash_trt.runtime.batched.runtime import SequenceRequest

    def ttft(rt: Any, warm: bool) -> tuple[float, int]:
        rt.reset_prefix_cache()
        if warm:  # the shared part, and one token the probe does not have: blocks 0..cached/32-1 cached
            rt.add(SequenceRequest(list(prompt[:cached]) + [int(prompt[cached]) ^ 1], params))
            rt.run()
        seq = rt.add(SequenceRequest(list(prompt), params))
        rt.run()
        return seq.result.stats.ttft_s, seq.result.stats.num_cached_tokens

    on, off, hits = [], [], set()
    for i in range(reps):
        for side in ((True, False) if i % 2 == 0 else (False, True)):
            s, hit = ttft(rt_on if side else rt_off, side)
            (on if side else off).append(s)
            if side:
                hits.add(hit)
    rt_on.reset_prefix_cache()
    rt_off.reset_prefix_cache()
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {"prompt_tokens": len(prompt), "cached_tokens": sorted(hits), "reps": reps,
            "ttft_on_s": on, "ttft_off_s": off, "median_on_s": med_on, "median_off_s": med_off,
            "ratio": med_on / med_off if med_off > 0 else 0.0}


def as_dicts(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


# ------------------------------------------------------------------------------------------------
# `dflash-trt bench --workload multi-turn`
# ------------------------------------------------------------------------------------------------
def _need_positions(codec: Any, system: str, convs: Sequence[Sequence[str]], max_new_tokens: int) -> int:
    """Positions the longest conversation's last turn can reach (its answers at their budget, and the
    chat template's few tokens per message)."""
    base = len(codec.encode_messages([{"role": "system", "content": system}]))
    turns = [sum(len(codec.encode(m, raw=True)) + max_new_tokens + 16 for m in conv) for conv in convs]
    return base + max(turns)


def run_multiturn(cfg: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of one multi-turn run (the bench.json object of ``--workload multi-turn``)."""
    import resource

    import torch

    from dflash_trt.bench.run import environment, load_average
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.batched.runtime import RuntimeExtras, SequenceRequest
    from dflash_trt.runtime.opener import open_runtime
    from dflash_trt.runtime.batched.policy import FixedPolicy, make_policy
    from dflash_trt.runtime_options import RuntimeOptions
    from dflash_trt.sampling_params import SamplingParams

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    kind, _, k = (cfg.policy or "adaptive").partition(":")
    pair = load_pair(PairSource(cfg.target, cfg.draft, engine=cfg.engine), RuntimeOptions.of(cfg),
                     max_draft_len=cfg.max_draft_len, policy=kind, draft_method=cfg.draft_method,
                     draft_len_schedule=cfg.draft_len_schedule)
    spec = pair.speculation.replace(policy=kind)
    codec = pair.codec
    system = system_prompt(codec, cfg.system_prompt_tokens)
    convs = conversations(cfg.conversations or 2 * max(cfg.concurrency), cfg.turns, cfg.split)
    probe_system = system_prompt(codec, cfg.probe_cached_tokens + 64)
    probe = codec.encode_messages([{"role": "system", "content": probe_system},
                                   {"role": "user", "content": convs[0][0]}])
    limit = max(_need_positions(codec, system, convs, cfg.max_new_tokens), len(probe) + 8)
    options = RuntimeOptions.of(cfg, max_batch=max(cfg.concurrency), max_seq_len=limit)

    def params(c: int, t: int) -> Any:
        seed = cfg.seed + 1000 * c + t if cfg.temperature > 0 else None
        return SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
                              stop_token_ids=codec.stop_token_ids)

    def runtime(on: bool) -> Any:
        policy = FixedPolicy(int(k) if k else spec.max_draft_len) if kind == "fixed" else make_policy(spec)
        rt = open_runtime(pair.target, pair.draft, options.replace(prefix_cache=on), spec,
                          RuntimeExtras(policy=policy), choice="batched")
        rt.add(SequenceRequest(codec.encode("Hello"), SamplingParams(max_tokens=8, stop_token_ids=codec.stop_token_ids)))
        rt.run()  # lazy initialisation out of the figures
        if hasattr(rt.policy, "reset_acceptance"):
            rt.policy.reset_acceptance()
            if cfg.calibrate:  # adaptive: each candidate k's step cost at every level, as bench's batched side
                from dflash_trt.runtime.batched.policy_calibration import calibrate

                calibrate(rt, sorted(set(cfg.concurrency)))
        rt.reset_prefix_cache()
        return rt

    say(f"multi-turn: {len(convs)} conversations x {cfg.turns} turns, system prompt "
        f"{len(codec.encode_messages([{'role': 'system', 'content': system}]))} tokens, policy {cfg.policy or kind}, "
        f"max_seq_len {limit}")
    sides = {"on": runtime(True), "off": runtime(False)}
    levels: list[dict[str, Any]] = []
    cache_stats: dict[str, Any] | None = None
    records: dict[str, dict[str, list[dict[str, Any]]]] = {}
    rounds = 0
    for c in cfg.concurrency:
        got: dict[str, tuple[list[TurnRecord], float]] = {}
        for name in (("on", "off") if rounds % 2 == 0 else ("off", "on")):
            rt = sides[name]
            rt.reset_prefix_cache()
            load = load_average()
            got[name] = run_conversations(rt, codec, system, convs, c, params)
            say(f"prefix cache {name} C={c}: {summary(*got[name])['tokens_per_s']:.2f} tok/s "
                f"(load {load[0] if load else '?'})")
            records.setdefault(name, {})[str(c)] = as_dicts(got[name][0])
            if name == "on" and rt.prefix_cache is not None:
                cache_stats = rt.prefix_cache.stats()
        rounds += 1
        on, off = summary(*got["on"]), summary(*got["off"])
        on["prefix_cache"] = cache_stats
        levels.append({"concurrency": c, "on": on, "off": off,
                       "identical": [r.output_ids for r in got["on"][0]] == [r.output_ids for r in got["off"][0]],
                       "steps_identical": ([r.acceptance_lengths for r in got["on"][0]]
                                           == [r.acceptance_lengths for r in got["off"][0]]),
                       # tau unchanged: on's within off's 95% interval (bootstrap over conversations)
                       "tau_within_interval": abs(on["tau"] - off["tau"]) <= off["tau_interval_halfwidth"],
                       "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else 0.0,
                       "ttft_ratio": on["ttft_s"]["mean"] / off["ttft_s"]["mean"] if off["ttft_s"]["mean"] else 0.0})
    say(f"TTFT probe: {len(probe)} tokens, the first {cfg.probe_cached_tokens} cached, {cfg.probe_reps} times each way")
    probe_out = ttft_probe(sides["on"], sides["off"], probe, cfg.probe_cached_tokens, cfg.probe_reps,
                           SamplingParams(max_tokens=1))
    budget = int(cfg.prefix_cache_mib * 2**20)
    peak = max((lv["on"]["prefix_cache"] or {}).get("peak_blocks", 0) for lv in levels)
    return {"workload": "multi-turn", "config": cfg.model_dump(), "environment": environment(cfg),
            "source": {"target": cfg.target, "draft": cfg.draft, "engine": cfg.engine,
                       "speculation": spec.to_dict()},
            "system_prompt_tokens": len(codec.encode_messages([{"role": "system", "content": system}])),
            "conversations": len(convs), "turns": cfg.turns, "levels": levels, "ttft_probe": probe_out,
            "memory": {"budget_bytes": budget, "allocated_bytes": sides["on"].prefix_cache.allocated_bytes,
                       "block_bytes": sides["on"].prefix_cache.block_bytes, "peak_blocks": peak,
                       "evicted_blocks": sum((lv["on"]["prefix_cache"] or {}).get("evicted_blocks", 0) for lv in levels),
                       "within_budget": sides["on"].prefix_cache.allocated_bytes <= budget,
                       "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
            "records": records}


def print_multiturn(result: dict[str, Any], echo: Callable[[str], None]) -> None:
    """The run's table: each level, the cache on and off side by side, then the TTFT probe and memory."""
    echo(f"multi-turn: {result['conversations']} conversations x {result['turns']} turns, system prompt "
         f"{result['system_prompt_tokens']} tokens")
    echo(f"{'C':>3} {'cache':>5} {'tok/s':>8} {'TTFT mean':>10} {'TTFT p50':>9} {'TPOT mean':>10} {'tau':>6} "
         f"{'hit rate':>8}  identical")
    for lv in result["levels"]:
        for name in ("on", "off"):
            s = lv[name]
            echo(f"{lv['concurrency']:>3} {name:>5} {s['tokens_per_s']:>8.2f} {s['ttft_s']['mean']:>9.3f}s "
                 f"{s['ttft_s']['p50']:>8.3f}s {s['tpot_s']['mean'] * 1e3:>8.1f}ms {s['tau']:>6.3f} "
                 f"{s['hit_rate']:>8.1%}  {lv['identical'] if name == 'on' else ''}")
        echo(f"    on/off: throughput {lv['throughput_ratio']:.2f}x, TTFT {lv['ttft_ratio']:.3f}x, tau {lv['on']['tau']:.3f} "
             f"vs {lv['off']['tau']:.3f} +- {lv['off']['tau_interval_halfwidth']:.3f} (within: "
             f"{lv['tau_within_interval']}), per-step acceptance identical: {lv['steps_identical']}")
    p = result["ttft_probe"]
    echo(f"TTFT probe ({p['prompt_tokens']} tokens, {p['cached_tokens']} cached): median {p['median_on_s'] * 1e3:.0f} ms "
         f"cached vs {p['median_off_s'] * 1e3:.0f} ms uncached = {p['ratio']:.3f}x")
    m = result["memory"]
    echo(f"prefix cache memory: {m['allocated_bytes'] / 2**20:.0f} MiB allocated (peak {m['peak_blocks']} blocks = "
         f"{m['peak_blocks'] * m['block_bytes'] / 2**20:.0f} MiB used, {m['evicted_blocks']} evicted) of a "
         f"{m['budget_bytes'] / 2**20:.0f} MiB budget: within budget {m['within_budget']}; process peak RSS "
         f"{m['max_rss_bytes'] / 2**30:.2f} GiB")
