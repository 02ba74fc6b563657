"""Target architectures as data: the facts the planner and the validator need, read from a HF
config.json (a checkpoint on disk) or from a known public config shipped under build/archs/.

`dflash-trt plan --target gpt-oss-120b` works with no checkpoint: build/archs/gpt-oss-120b.json
holds the public config.json facts of that model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError


@dataclass(frozen=True)
class ArchSpec:
    name: str
    architecture: str  # e.g. GptOssForCausalLM
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (per expert for MoE models whose config says so)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)  # "full_attention" | "sliding_attention"
    native_expert_format: str | None = None  # e.g. "mxfp4" for gpt-oss's released experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sliding_layers(self) -> int:
        if not self.sliding_window:
            return 0
        return sum(1 for t in self.layer_types if t == "sliding_attention")

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def arch_from_config(cfg: dict[str, Any], name: str = "target") -> ArchSpec:
    """ArchSpec from a HF config.json dict (Llama, Qwen3, Qwen3-MoE, GptOss, Mixtral shapes)."""
    try:
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise DFlashError(f"{name}: config.json lacks {e} (need hidden_size, num_hidden_layers, "
                          "num_attention_heads, vocab_size); pass a HF causal-LM checkpoint")
    kv = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    inter = int(_first(cfg, "intermediate_size", default=4 * hidden))
    expert_inter = int(_first(cfg, "moe_intermediate_size", default=inter)) if experts else 0
    window = _first(cfg, "sliding_window")
    layer_types = tuple(cfg.get("layer_types") or ())
    if window and not layer_types and cfg.get("use_sliding_window", True) and cfg.get("model_type") in ("mistral",):
        layer_types = ("sliding_attention",) * layers
    qcfg = cfg.get("quantization_config") or {}
    native = qcfg.get("quant_method") if qcfg.get("quant_method") in ("mxfp4",) else None
    archs = cfg.get("architectures") or [""]
    return ArchSpec(
        name=name, architecture=str(archs[0]), model_type=str(cfg.get("model_type", "")),
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab,
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        num_experts=experts, experts_per_token=int(_first(cfg, "num_experts_per_tok", "experts_per_token", default=0)),
        expert_intermediate_size=expert_inter,
        sliding_window=int(window) if window else None, layer_types=layer_types,
        native_expert_format=native,
    )


def known_archs_dir() -> Path:
    from dflash_trt.resources import resource_dir

    return resource_dir("build") / "archs"


def known_arch_names() -> list[str]:
    try:
        return sorted(p.stem for p in known_archs_dir().glob("*.json"))
    except FileNotFoundError:
        return []


def resolve_arch(target: str | Path) -> tuple[ArchSpec, dict[str, Any], Path | None]:
    """(ArchSpec, raw config, checkpoint dir or None) for a checkpoint directory or a known name."""
    from dflash_trt.checkpoints.files import read_json

    p = Path(target)
    if p.is_dir():
        cfg = read_json(p / "config.json", what="target config")
        # "target"/"model" say nothing; name the checkpoint by its parent folder then.
        name = p.resolve().parent.name if p.name in ("target", "model", "checkpoint") else p.name
        return arch_from_config(cfg, name=name or p.name), cfg, p
    known = known_arch_names()
    if str(target) in known:
        cfg = read_json(known_archs_dir() / f"{target}.json", what="known architecture")
        return arch_from_config(cfg, name=str(target)), cfg, None
    raise DFlashError(
        f"target {target!r} is neither a checkpoint directory nor a known architecture "
        f"({', '.join(known) or 'none shipped'}); pass --target DIR with config.json and *.safetensors"
    )
