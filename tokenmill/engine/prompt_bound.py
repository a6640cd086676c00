"""A safe lower bound on how many tokens a text becomes, known without tokenizing it.

A text of B UTF-8 bytes is at least B / L tokens when no token can stand for more than L bytes of input.
So a prompt with B > max_model_len * L cannot fit, and is refused before the tokenizer spends seconds
and hundreds of MiB on it. L must never be too small, or a prompt that fits would be refused; it is
derived from the tokenizer's own pipeline (tokenizer.json), and where a step of that pipeline can drop
text without bound (whitespace pre-tokenizers, strip, control-character cleaning, fused unknown tokens,
whole-word models) there is no bound at all and the text is simply tokenized.

  L = shrink factor of the normalizer  x  the most input bytes one token covers
      (the longest vocabulary entry or added token, in input bytes; at least one character for
      unknown-token fallback)

Normalizer shrink factors (normalized bytes >= input bytes / factor):
  Prepend, ByteLevel            1 (they only add)
  Replace(string a -> string b) len(a) / len(b) when b is shorter; b empty or a regex: no bound
  NFC, NFD                      3 (canonical composition: three 3-byte Hangul jamo -> one 3-byte syllable)
  NFKC, NFKD                    8 (compatibility mappings as well: a 4-byte mathematical letter -> 1 ASCII
                                   byte, composed with its marks; 8 is a wide margin over the worst case)
  Lowercase                     3 (KELVIN SIGN, 3 bytes -> 'k')
"""
from __future__ import annotations

import json

_FIXED_FACTORS = {"Prepend": 1.0, "ByteLevel": 1.0, "NFC": 3.0, "NFD": 3.0, "NFKC": 8.0, "NFKD": 8.0,
                  "Lowercase": 3.0}
# pre-tokenizers that keep every input byte (Split keeps them unless its behavior removes the matches)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
_MAX_CHAR_BYTES = 4


def _normalizer_factor(spec: dict | None) -> float | None:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for sub in spec.get("normalizers", []):
            f = _normalizer_factor(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None
        return max(1.0, len(pattern["String"].encode()) / len(content.encode()))
    return _FIXED_FACTORS.get(kind)


def _keeps_every_byte(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(sub) for sub in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _is_byte_level(spec: dict) -> bool:
    """Byte-level vocabularies spell each input byte as one character."""
    def has(part: dict | None) -> bool:
        if part is None:
            return False
        if part.get("type") == "ByteLevel":
            return True
        return any(has(p) for p in part.get("pretokenizers", []) + part.get("normalizers", []))
    return has(spec.get("pre_tokenizer")) or has(spec.get("normalizer"))


def _model_covers(model: dict, byte_level: bool) -> int | None:
    """The most input bytes one token of the model covers (None: unbounded)."""
    kind = model.get("type")
    if kind == "BPE":
        vocab = model.get("vocab", {})
        fallback = model.get("unk_token") is not None and not model.get("byte_fallback") and not byte_level
        if fallback and model.get("fuse_unk"):
            return None  # a run of unknown characters becomes one token
    elif kind == "Unigram":
        if not model.get("byte_fallback"):
            return None  # unknown characters fuse into one token
        vocab, fallback = {piece: 0 for piece, _ in model.get("vocab", [])}, False
    else:
        return None  # WordPiece, WordLevel: a whole (unbounded) word can become one unknown token
    longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    return max(longest, _MAX_CHAR_BYTES) if fallback else longest


def max_bytes_per_token(tokenizer) -> float | None:
    """The most UTF-8 bytes of input text that one token of `tokenizer` can stand for, or None when the
    tokenizer can shrink text without bound (or is not a `tokenizers` fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    covers = _model_covers(spec.get("model", {}), _is_byte_level(spec))
    if covers is None:
        return None
    added = max((len(t.get("content", "").encode("utf-8", "surrogatepass")) for t in spec.get("added_tokens", [])),
                default=0)
    return factor * max(covers, added, 1)


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
