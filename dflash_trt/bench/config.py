"""The resolved bench configuration: typed, unknown keys rejected; a --config YAML under CLI flags."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # what runs: in process (engine | target+draft | embedded default) or a Triton gRPC endpoint
    engine: str | None = None
    target: str | None = None
    draft: str | None = None
    url: str | None = None
    plain_url: str | None = None  # endpoint mode: a server of the same target without speculation
    model: str = "dflash"
    # prompts
    category: list[str] = Field(default_factory=lambda: ["code", "math", "chat"])
    prompts: str | None = None
    split: str = "eval"
    num_prompts: int | None = Field(None, ge=1)
    # decoding
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    seed: int = 0
    # in process: K (drafts verified per step, default the engine's or block_size - 1) and the
    # policy (fixed: the reference loop; adaptive: the batched runtime choosing k <= K per step)
    max_draft_len: int | None = Field(None, ge=1)
    policy: Literal["fixed", "adaptive"] | None = None
    concurrency: list[int] = Field(default_factory=lambda: [1])
    # where
    device: str = "cpu"
    dtype: str = "float32"
    gpu: str | None = None  # hardware-table key for the ceiling; in process on CUDA it is detected
    threads: int | None = Field(None, ge=1)  # torch CPU threads (in process)
    timeout_s: float = Field(600.0, gt=0)  # per endpoint request
    out: str | None = None
    plots: bool = True

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency levels must be integers >= 1, e.g. 1,2,4,8")
        return sorted(set(v))

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        from dflash_trt.engine.hardware import GPUS

        if v is not None and v not in GPUS:
            raise ValueError(f"unknown gpu {v!r}; use one of {', '.join(GPUS)}")
        return v

    @model_validator(mode="after")
    def _sources(self) -> BenchConfig:
        if self.url and (self.engine or self.target or self.draft):
            raise ValueError("--url measures a server; drop --engine/--target/--draft (or drop --url to run in process)")
        if self.engine and (self.target or self.draft):
            raise ValueError("--engine already holds the target and drafter; drop --target/--draft")
        if bool(self.target) != bool(self.draft):
            raise ValueError("pass both --target and --draft, or neither (to use the embedded default pair)")
        if self.url and (self.max_draft_len or self.policy):
            raise ValueError("--max-draft-len and --policy apply in process only; a server has its own (set them "
                             "on `dflash-trt serve` / `deploy triton`)")
        if self.plain_url and not self.url:
            raise ValueError("--plain-url is for endpoint mode; add --url (in process runs plain decoding itself)")
        return self

    @property
    def in_process(self) -> bool:
        return self.url is None


def resolve_config(config_file: str | None, flags: dict[str, Any]) -> BenchConfig:
    """File values, then every flag the user actually gave (None = not given) on top."""
    from dflash_trt.config import load_config

    return load_config(BenchConfig, config_file, flags, what="bench config")
