"""Incremental detokenization (multi-byte UTF-8, BPE merges) and stop strings."""
import pytest

from tokenmill import SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from conftest import make_llm


@pytest.fixture(scope="module")
def tok(llama_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("text", ["你好，世界。 こんにちは", "🙂🎉 naïve café", "To be, or not to be — “quotes” …"])
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("Héllo ")
    d = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for t in ids:
        before = d.output_text
        d.update([t])
        pieces.append(d.output_text[len(before):])
        assert "\ufffd" not in d.output_text  # never a half character
    assert d.output_text == text == tok.decode(ids)


class _SlowTokenizer:
    """Only `decode`, as a tokenizer without a Rust backend (no `_tokenizer`): the detokenizer's slow path."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("stop", [None, ["not to"]])
def test_slow_tokenizers_decode_incrementally_too(tok, stop):
    """Decoding the whole tail each token and taking what is new: the text so far must be read before it
    grows (the in-place append detaches it while appending)."""
    text = "To be, or not to be — “quotes” 你好"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(_SlowTokenizer(tok), tok.encode("Héllo "), stop=stop)
    for t in ids:
        if d.update([t]) is not None:
            break
    assert d.output_text == (text if stop is None else "To be, or ")


@pytest.mark.parametrize("slow", [False, True])
def test_a_prompt_cut_inside_a_character_gives_only_the_output_s_text(slow):
    """A token-id prompt that ends inside a character (an earlier output cut by max_tokens, sent back as the
    prompt): the output is the completed character and what follows, never prompt text (the fast path gave
    ' 你好' for '好') and never less (the slow path lost '好')."""
    from transformers import AutoTokenizer
    from tokenmill.config import DEFAULT_MODEL

    shipped = AutoTokenizer.from_pretrained(DEFAULT_MODEL)  # byte-level BPE: CJK characters are split
    ids = shipped.encode("ROMEO: 你好 and 🙂 ok", add_special_tokens=False)
    text, cuts = shipped.decode(ids), 0
    for cut in range(1, len(ids)):
        prompt_text = shipped.decode(ids[:cut])
        if not prompt_text.endswith("\ufffd"):
            continue
        cuts += 1
        d = IncrementalDetokenizer(_SlowTokenizer(shipped) if slow else shipped, ids[:cut])
        for t in ids[cut:]:
            d.update([t])
        assert d.output_text == text[len(prompt_text.rstrip("\ufffd")):], cut
    assert cuts >= 3


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, byte-fallback pieces <0xNN>), trained without CJK text."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from conftest import CORPUS

    t = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    t.train_from_iterator([CORPUS.replace("你好，世界。", "").replace("こんにちは", "")],
                          trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"] + bytes_,
                                              show_progress=False))
    spec = json.loads(t.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if not a["content"].startswith("<0x")]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_token_bytes_rebuild_characters_split_across_tokens(kind):
    """OpenAI's logprobs `bytes`: a token holding part of a character decodes alone to U+FFFD, whose bytes (EF BF
    BD) were what the server sent; the token's own bytes rebuild the character."""
    from transformers import AutoTokenizer
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.tokenizer import TokenBytes

    t = AutoTokenizer.from_pretrained(DEFAULT_MODEL) if kind == "byte-level" else _byte_fallback_tokenizer()
    token_bytes, split = TokenBytes(t), 0
    for text in ("café — naïve", "日本 😀 end", "你好"):
        ids = t.encode(text, add_special_tokens=False)
        pieces = [t.decode([i]) for i in ids]
        split += sum("\ufffd" in p for p in pieces)  # tokens holding part of a character
        got = b"".join(bytes(token_bytes(i, p)) for i, p in zip(ids, pieces))
        if kind == "byte-level":
            assert got == text.encode()
        else:  # (a SentencePiece word's bytes are its text alone: the space its piece opens with is not there)
            assert got.decode().replace(" ", "") == text.replace(" ", "")
    assert split >= 4
    special = t.convert_tokens_to_ids("</s>")
    assert token_bytes(special, "</s>") == list(b"</s>")


def test_split_multibyte_characters_are_held_back(tok):
    text = "龍🐉"  # not in the tokenizer's corpus: each character is several byte-level tokens
    ids = tok.encode(text)
    assert len(ids) > len(text)
    d = IncrementalDetokenizer(tok, [])
    pieces = []
    for t in ids:
        before = d.output_text
        d.update([t])
        pieces.append(d.output_text[len(before):])
    assert "" in pieces and "".join(pieces) == text


def test_stop_string_across_tokens_is_trimmed(tok):
    text = "To be, or not to be, that is the question"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["not to"])
    hit = None
    for t in ids:
        hit = d.update([t])
        if hit:
            break
    assert hit == "not to" and d.output_text == "To be, or "
    d2 = IncrementalDetokenizer(tok, [], stop=["not to"], include_stop_str_in_output=True)
    for t in ids:
        if d2.update([t]):
            break
    assert d2.output_text == "To be, or not to"


def test_streaming_holds_back_possible_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], stop=["question"])
    d.update(tok.encode("the ques"))
    assert not d.visible_text(False).endswith("ques")
    assert d.visible_text(True) == "the ques"


def test_engine_applies_stop_strings(llama_dir):
    llm = make_llm(llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = llm.generate("To be", sp, use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    if stop in text[:3 + len(stop) - 1]:
        stop = text[3:7]
    out = llm.generate("To be", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)
    llm.llm_engine.check_invariants()


@pytest.mark.parametrize("min_tokens", [0, 2, 5])
def test_stop_strings_wait_for_min_tokens(tok, min_tokens):
    """As vLLM: a stop string counts only where it ends in the text after the first min_tokens tokens (the
    server ignored min_tokens for stop strings: `stop: ["\\n"], min_tokens: 5` gave an empty completion)."""
    text = "To be, or not to be, that is the question: whether 'tis nobler"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["e", "that is"], min_tokens=min_tokens)
    for t in ids:
        if d.update([t]) is not None:
            break
    floor = len(tok.decode(ids[:min_tokens]))  # the first min_tokens tokens' text
    cut = min(i for s in ("e", "that is") for i in [text.find(s, max(0, floor - len(s) + 1))] if i >= 0)
    assert d.output_text == text[:cut]
    if min_tokens == 5:  # the "e" of the first "be" is passed over; the second is not
        assert d.output_text == "To be, or not to b"


def test_a_stop_token_s_text_is_left_out(tok):
    """A request ended by a stop token id or EOS: its token is in token_ids, its text only with
    include_stop_str_in_output (as vLLM)."""
    ids = tok.encode("To be, or not to be")
    d = IncrementalDetokenizer(tok, [])
    d.update(ids[:-2])
    assert d.update(ids[-2:], stop_terminated=True) is None and d.num_used == 2
    assert d.output_text == tok.decode(ids[:-1])
    keep = IncrementalDetokenizer(tok, [], include_stop_str_in_output=True)
    keep.update(ids, stop_terminated=True)
    assert keep.output_text == tok.decode(ids)


def test_engine_leaves_the_stop_token_s_text_out(llama_dir, tok):
    llm = make_llm(llama_dir)
    # a stop token after the first whose text and the text before it are whole characters (a random model writes
    # lone UTF-8 bytes, which the engine holds back and tok.decode writes as U+FFFD)
    for text in ("To be, or not", "Hello world", "ROMEO:"):
        prompt = {"prompt_token_ids": tok.encode(text)}
        free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        whole = [i for i in range(1, 8) if free.token_ids.index(free.token_ids[i]) == i
                 and "\ufffd" not in tok.decode(free.token_ids[:i]) + tok.decode(free.token_ids[:i + 1])]
        if whole:
            break
    stop_tok = free.token_ids[whole[-1]]
    first = free.token_ids.index(stop_tok)
    for include in (False, True):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok],
                                                  include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[:first + 1] and out.stop_reason == stop_tok
        assert out.text == tok.decode(free.token_ids[:first + 1 if include else first])
