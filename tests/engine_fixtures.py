"""A tiny but complete engine directory for the serving tests, written without `dflash-trt build`.

It has everything a real engine directory has (see dflash_trt/engine/manifest.py): a tiny random
Llama target saved as a HF checkpoint WITH a real byte-level BPE tokenizer and chat template
(trained in-process on a few sentences, so the full text path runs), a random DFlash drafter in
z-lab format, an llm_api_options.yaml, and a validated dflash_trt.json with sha256 of every file.
When the real builder lands this helper can be swapped for it without touching the tests.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from dflash_trt.sampling_params import SamplingParams

from tests.conftest import save_rigged_pair, save_tiny_pair

VOCAB_SIZE = 320  # 256 byte symbols + 3 specials + a few merges
EOS = "<|im_end|>"  # id 2 == LlamaConfig's default eos_token_id
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN_TEXT = [
    "The capital of France is Paris.",
    "Hello world, how are you today?",
    "Speculative decoding drafts a block of tokens and the target verifies them.",
]


def save_tiny_tokenizer(directory: Path) -> None:
    """A real byte-level BPE tokenizer (the SmolLM2 kind), small enough for a 320-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT * 3, trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(directory)


def make_tiny_engine(root: Path, max_seq_len: int = 256, block_size: int = 8, seed: int = 0,
                     max_draft_len: int | None = None, arch: str = "llama", rigged: bool = False) -> Path:
    """Write `root/engine` (target + tokenizer, draft, llm_api_options.yaml, dflash_trt.json).
    `max_draft_len`: K recorded in the manifest and the YAML (default block_size - 1); `rigged`:
    the pair of tests/conftest.save_rigged_pair, whose drafts are accepted (a random drafter's
    almost never are, so counts of accepted drafts would all read 0)."""
    import json

    import yaml

    from dflash_trt.engine.llm_api import check_llm_api_options
    from dflash_trt.engine.manifest import MANIFEST_NAME, EngineManifest
    from dflash_trt.engine.verify import hash_tree
    from dflash_trt.checkpoints.files import read_json

    engine = root / "engine"
    engine.mkdir(parents=True)
    K = block_size - 1 if max_draft_len is None else max_draft_len
    if rigged:
        tdir, ddir = save_rigged_pair(engine, arch=arch, block_size=block_size, vocab_size=VOCAB_SIZE)
    else:
        tdir, ddir = save_tiny_pair(engine, arch=arch, block_size=block_size, seed=seed, vocab_size=VOCAB_SIZE)
    save_tiny_tokenizer(tdir)
    tcfg = read_json(tdir / "config.json", what="target config")
    dcfg = read_json(ddir / "config.json", what="drafter config")
    dflash = dcfg.get("dflash_config", {})
    options = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "max_batch_size": 8,
        "max_seq_len": max_seq_len,
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": K,
            "speculative_model": "./draft",
            "mask_token_id": dflash["mask_token_id"],
            "target_layer_ids": list(dflash["target_layer_ids"]),
        },
    }
    check_llm_api_options(options)
    (engine / "llm_api_options.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
    files = hash_tree(engine)
    manifest = EngineManifest(
        name=f"tiny-{arch}-dflash",
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        gpu="cpu",
        mapping={"tp": 1, "pp": 1, "ep": 1, "gpus_per_node": 1},
        quantization={"weights": "none", "kv_cache": "none"},
        limits={"max_batch_size": 8, "max_seq_len": max_seq_len, "max_draft_len": K},
        target={"architecture": tcfg["architectures"][0], "num_layers": tcfg["num_hidden_layers"],
                "hidden_size": tcfg["hidden_size"], "vocab_size": tcfg["vocab_size"]},
        draft={"block_size": dcfg.get("block_size", block_size),
               "mask_token_id": dflash["mask_token_id"], "target_layer_ids": dflash["target_layer_ids"]},
        min_tensorrt_llm_version="1.3.0",
        versions={},
        spec={"fixture": "tests/engine_fixtures.py"},
        files=files,
    )
    (engine / MANIFEST_NAME).write_text(json.dumps(manifest.model_dump(), indent=2))
    return engine


_ENGINES: dict[str, Path] = {}


def shared_tiny_engine(tmp_path_factory) -> Path:
    """One tiny engine per test session, whichever test module asks first (it takes seconds)."""
    if "tiny" not in _ENGINES:
        _ENGINES["tiny"] = make_tiny_engine(tmp_path_factory.mktemp("tiny_engine"))
    return _ENGINES["tiny"]


def shared_rigged_engine(tmp_path_factory) -> Path:
    """One tiny engine whose drafts are accepted (make_tiny_engine rigged) per test session."""
    if "rigged" not in _ENGINES:
        _ENGINES["rigged"] = make_tiny_engine(tmp_path_factory.mktemp("rigged_engine"), rigged=True)
    return _ENGINES["rigged"]


def shared_gpu_tiny_engine(tmp_path_factory, gpu: str = "h100", dtype: str = "bfloat16") -> Path:
    """The tiny engine as a GPU build would record it (manifest gpu and dtype), for the paths that
    hand an engine to TensorRT-LLM (never a CPU engine: engine/llm_api.tensorrt_llm_refusal). The
    weights stay the tiny float32 ones: nothing here runs them on TensorRT-LLM."""
    try:
        from tests.deploy_engines import gpu_copy
    except ImportError:  # tests/ is not a package
        from deploy_engines import gpu_copy

    key = f"gpu-{gpu}-{dtype}"
    if key not in _ENGINES:
        _ENGINES[key] = gpu_copy(shared_tiny_engine(tmp_path_factory), tmp_path_factory.mktemp(key) / "engine",
                                 gpu, dtype)
    return _ENGINES[key]


def reference_answer(engine: Path, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                     raw: bool = False, draft_method: str | None = None) -> str:
    """The text the reference runtime gives for `prompt` (one user turn through the chat template;
    `raw`: the bare text, as OpenAI's /v1/completions sends it), computed without the serving code;
    `draft_method`: the draft method (None: the default)."""
    from dflash_trt.pairs import PairSource, load_pair
    from dflash_trt.runtime.reference.generate import dflash_generate
    from dflash_trt.runtime.targets.adapter import TargetAdapter
    from dflash_trt.runtime.decoding.tokens import TextCodec
    from dflash_trt.speculation import SpeculationSettings

    if "pair" not in _ENGINES or _ENGINES.get("pair_of") != engine:
        pair = load_pair(PairSource(engine=engine))
        _ENGINES["pair"], _ENGINES["pair_of"] = (pair, TargetAdapter(pair.target)), engine  # type: ignore[assignment]
    pair, target = _ENGINES["pair"]  # type: ignore[misc]
    codec = TextCodec.of_pair(pair)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop_token_ids=codec.stop_token_ids)
    # dflash_generate's own settings (K = B-1, fixed), with `draft_method` when one is given
    speculation = SpeculationSettings.for_block(pair.draft.block_size, draft_method=draft_method)
    result = dflash_generate(pair.draft, target, codec.encode(prompt, raw=raw), params, speculation)
    return codec.decode(result.output_ids)
