"""The tokenizer contract (runtime/tokens.py) with a real byte-level BPE tokenizer and chat template,
and the import rule that keeps the CLI on top of the house."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trt.errors import InvalidRequest
from dflash_trt.runtime.tokens import TextCodec, stop_token_ids_of

try:
    from tests.engine_fixtures import EOS, VOCAB_SIZE, save_tiny_tokenizer
except ImportError:  # tests/ is not a package
    from engine_fixtures import EOS, VOCAB_SIZE, save_tiny_tokenizer

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_trt"


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(d)
    return TextCodec.for_model(tok, SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_id=2))


def test_one_user_turn_is_the_conversation_of_one_message(codec):
    ids = codec.encode("Hello world")
    assert ids == codec.encode_messages([{"role": "user", "content": "Hello world"}])
    assert codec.decode(ids).endswith("assistant\n")  # the template opened the assistant's turn
    raw = codec.encode("Hello world", raw=True)
    assert codec.decode(raw) == "Hello world" and len(raw) < len(ids)
    chat = codec.encode_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = codec.tokenizer.decode(chat)
    assert text.index("Be brief.") < text.index("Hi") and text.count("<|im_start|>") == 3


def test_stop_ids_come_from_the_config_and_the_tokenizer(codec):
    eos = codec.tokenizer.convert_tokens_to_ids(EOS)
    assert eos in codec.stop_token_ids
    cfg = SimpleNamespace(eos_token_id=[7, 9], _generation_eos=[11])
    assert stop_token_ids_of(None, cfg) == [7, 9, 11]
    assert stop_token_ids_of(SimpleNamespace(eos_token_id=3), SimpleNamespace(eos_token_id=None)) == [3]


@pytest.mark.parametrize("messages, fragment", [
    ("hi", "must be a list of chat messages"),
    ([], "messages is empty"),
    ([{"role": "user"}], "messages[0] needs string"),
    ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "messages[1] needs string"),
    ([{"role": "", "content": "a"}], "empty role"),
])
def test_malformed_messages_are_invalid_requests(codec, messages, fragment):
    with pytest.raises(InvalidRequest, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        codec.encode_messages(messages)


def test_no_tokenizer_folds_bytes_into_the_vocabulary():
    c = TextCodec(None, 100)
    assert c.encode("é") == [0xC3 % 100, 0xA9 % 100]
    assert c.encode_messages([{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]) == \
        [ord(x) % 100 for x in "ab\nc"]
    assert c.decode([1, 2]) == "1 2"


def test_threads_share_one_codec(codec):
    """HF fast tokenizers raise "Already borrowed" when two threads use one at once; the codec's
    lock serialises encode and decode (a server encodes while its runtime decodes)."""
    want = codec.encode("The capital of France is")
    errors, results = [], []

    def work() -> None:
        try:
            for _ in range(50):
                results.append(codec.encode("The capital of France is"))
                codec.decode(want)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(r == want for r in results)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_only_command_modules_import_the_cli():
    """The CLI sits on top: the areas never import dflash_trt.cli or generation_cli (the tokenizer
    contract, the pair resolver and the CLI helpers live below it)."""
    commands = {PACKAGE / "cli.py", PACKAGE / "generation_cli.py"} | set(PACKAGE.glob("*/cli.py"))
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path in commands:
            continue
        bad = _imports(path) & {"dflash_trt.cli", "dflash_trt.generation_cli"}
        if bad:
            offenders.append(f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}")
    assert not offenders
    # and the command modules take the shared helpers from cli_helpers, not from each other
    for path in commands - {PACKAGE / "cli.py"}:
        assert "dflash_trt.cli" not in _imports(path), path
