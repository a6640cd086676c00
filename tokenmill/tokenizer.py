"""Loading a model's tokenizer (from its local directory only), for the front end and for workers that need one
(structured outputs' grammars). Free of engine imports: workers import it too."""
from __future__ import annotations


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """A ValueError naming the directory where there is none, or its files do not load."""
    import os

    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory not found: {path!r} (tokenizers load from local directories only)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers' own kinds: a missing backend, a corrupt tokenizer.json, ...
        raise ValueError(f"cannot load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e


class TokenBytes:
    """Each token's own bytes, as OpenAI's logprobs carry them (`bytes`). A token holding part of a character
    decodes alone to U+FFFD; its bytes let a client rebuild the character from consecutive tokens. Byte-level
    BPE pieces (GPT-2, Llama 3, Qwen) map back through their byte alphabet, and SentencePiece's byte pieces
    (<0xE4>) are that byte; any other token (an added one, a SentencePiece word) is its text's UTF-8."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, list[int]] = {}  # at most one entry per vocabulary token

    def __call__(self, token_id: int, text: str) -> list[int]:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = list(self._bytes(token_id, text))
        return got

    def _bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if token_id not in self._added else None
        if isinstance(piece, str):
            if self._byte_level:
                alphabet = _byte_alphabet()
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return text.encode("utf-8", "backslashreplace")


_ALPHABET: dict[str, int] = {}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table), inverted."""
    if not _ALPHABET:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        _ALPHABET.update({c: b for b, c in bytes_to_unicode().items()})
    return _ALPHABET
