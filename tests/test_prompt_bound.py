"""The bound on bytes per token that lets a prompt too long for the context be refused before it is
tokenized (issue 12, item 3): it must never refuse a prompt that fits, and it must not exist where the
tokenizer can drop text."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import build_tokenizer
from tokenmill.config import DEFAULT_MODEL
from tokenmill.engine.input_processor import InputProcessor, load_tokenizer
from tokenmill.engine.prompt_bound import max_bytes_per_token, utf8_length


@pytest.fixture(scope="module", params=["shipped", "test"])
def tokenizer(request, tmp_path_factory):
    if request.param == "shipped":
        return load_tokenizer(DEFAULT_MODEL)
    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path)
    return load_tokenizer(path)


def _pieces(tok) -> list[str]:
    """Text that tokenizes densely: the longest tokens' texts, special tokens, odd Unicode, runs of spaces."""
    ids = sorted(tok.get_vocab().values(), key=lambda i: -len(tok.convert_ids_to_tokens(i)))[:50]
    return ([tok.decode([i]) for i in ids] + list(tok.all_special_tokens)
            + [" " * 40, "\n\n\n", "\u00e9", "e\u0301", "\U0001f600", "\u212a", "\x00", "\ufffd", "你好"])


def test_bound_is_never_below_the_real_count(tokenizer):
    bound = max_bytes_per_token(tokenizer)
    assert bound is not None
    pieces = _pieces(tokenizer)

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(pieces) | st.text(max_size=8), min_size=1, max_size=40))
    def check(parts):
        text = "".join(parts)
        for special in (True, False):
            assert len(tokenizer.encode(text, add_special_tokens=special)) >= utf8_length(text) / bound, text

    check()


class _Backend:
    def __init__(self, spec: dict):
        self.spec = spec

    def to_str(self) -> str:
        return json.dumps(self.spec)


class _Fake:
    def __init__(self, normalizer=None, pre_tokenizer=None, model=None, added=()):
        model = model or {"type": "BPE", "vocab": {"a": 0, "abcd": 1}, "unk_token": None}
        self.backend_tokenizer = _Backend({"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "model": model,
                                           "added_tokens": [{"content": c} for c in added]})


@pytest.mark.parametrize("fake,want", [
    (_Fake(), 4),
    (_Fake(added=["<|a-long-special-token|>"]), 24),
    (_Fake(pre_tokenizer={"type": "ByteLevel"}, model={"type": "BPE", "vocab": {"Ġthe": 0}}), 4),  # 1 char, 1 byte
    (_Fake(normalizer={"type": "NFC"}), 12),
    (_Fake(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}), 96),
    (_Fake(normalizer={"type": "Replace", "pattern": {"String": "  "}, "content": " "}), 8),
    (_Fake(model={"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>", "fuse_unk": False}), 4),
    # no bound: steps that can drop text without limit
    (_Fake(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}), None),
    (_Fake(normalizer={"type": "BertNormalizer"}), None),
    (_Fake(normalizer={"type": "Replace", "pattern": {"String": "x"}, "content": ""}), None),
    (_Fake(normalizer={"type": "Replace", "pattern": {"Regex": "x+"}, "content": "x"}), None),
    (_Fake(pre_tokenizer={"type": "Whitespace"}), None),
    (_Fake(pre_tokenizer={"type": "Split", "behavior": "Removed"}), None),
    (_Fake(model={"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>", "fuse_unk": True}), None),
    (_Fake(model={"type": "WordPiece", "vocab": {"a": 0}}), None),
    (_Fake(model={"type": "Unigram", "vocab": [["a", 0.0]]}), None),
    (object(), None),  # not a fast tokenizer
])
def test_bound_follows_the_pipeline(fake, want):
    assert max_bytes_per_token(fake) == want


def test_text_that_cannot_fit_is_refused_without_tokenizing():
    tok = load_tokenizer(DEFAULT_MODEL)
    calls = []
    real = tok.encode
    tok.encode = lambda text, **kw: calls.append(len(text)) or real(text, **kw)
    ip = InputProcessor(tok, vocab_size=len(tok), max_model_len=64, eos_ids=(1,))
    with pytest.raises(ValueError, match="'prompt' is longer than max_model_len"):
        ip.encode("To be, or not to be " * 1000)
    with pytest.raises(ValueError, match="'messages' is longer than max_model_len"):
        ip.chat_prompt([{"role": "user", "content": "speak " * 1000}])
    assert calls == []
    assert len(ip.encode("To be, or not to be")) > 1 and calls  # what fits is tokenized
