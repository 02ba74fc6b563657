"""The tokenizer contract (runtime/decoding/tokens.py) with a real byte-level BPE tokenizer and chat
template. (The import rule that keeps the CLI on top of the house: tests/test_import_graph.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dflash_trt.errors import InvalidRequest
from dflash_trt.runtime.decoding.tokens import TextCodec, stop_token_ids_of

try:
    from tests.engine_fixtures import EOS, VOCAB_SIZE, save_tiny_tokenizer
except ImportError:  # tests/ is not a package
    from engine_fixtures import EOS, VOCAB_SIZE, save_tiny_tokenizer

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


class _Exclusive:
    """The codec's tokenizer, seen from inside: while one call is in it, another thread's call to the
    same codec is started, and given `wait` seconds to get in. A lock makes it wait outside, so
    each check costs `wait`; without one the other call gets in (microseconds) and is recorded."""

    def __init__(self, codec: TextCodec, wait: float = 0.5) -> None:
        self.tokenizer, self.codec, self.wait = codec.tokenizer, codec, wait
        self.inside = 0
        self.overlaps: list[str] = []
        self.other: tuple[str, tuple] | None = None  # the call another thread makes from inside
        self.thread: threading.Thread | None = None

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)  # chat_template, convert_tokens_to_ids, ...

    def _enter(self, name: str, fn, *args, **kwargs):
        self.inside += 1
        try:
            if self.inside > 1:
                self.overlaps.append(name)
            elif self.other is not None:
                method, margs = self.other
                self.other = None
                self.thread = threading.Thread(target=getattr(self.codec, method), args=margs)
                self.thread.start()
                self.thread.join(timeout=self.wait)  # returns early only if it got in and out
            return fn(*args, **kwargs)
        finally:
            self.inside -= 1

    def __call__(self, *args, **kwargs):
        return self._enter("encode", self.tokenizer, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._enter("apply_chat_template", self.tokenizer.apply_chat_template, *args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._enter("decode", self.tokenizer.decode, *args, **kwargs)


def test_threads_share_one_codec(codec):
    """HF fast tokenizers raise "Already borrowed" when two threads use one at once; the codec
    serialises encode and decode (a server encodes while its runtime decodes). Checked as that
    invariant: while each of the codec's three calls into the tokenizer is inside it, another
    thread's call to the codec is made, and must wait outside. With the lock it waits every time
    (the check cannot fail on a sound codec); without it the other call gets in within its 0.5 s
    window (the old test, 4 threads hoping to collide, passed without the lock 3 times in 3)."""
    ids = codec.encode("The capital of France is")
    shared = TextCodec(codec.tokenizer, codec.vocab_size, codec.stop_token_ids)
    probe = _Exclusive(shared)
    shared.tokenizer = probe
    calls = [("encode", ("Hi there", True)), ("encode_messages", ([{"role": "user", "content": "Hi"}],)),
             ("decode", (ids,))]
    for (method, args), (other, other_args) in zip(calls, calls[1:] + calls[:1]):
        probe.other = (other, other_args)
        getattr(shared, method)(*args)
        assert probe.other is None and probe.thread is not None  # the other call was made from inside
        probe.thread.join(timeout=30)  # it ran once the first call was out
        assert not probe.thread.is_alive()
    assert probe.overlaps == []
    assert shared.encode("The capital of France is") == ids  # and the probe changed nothing
