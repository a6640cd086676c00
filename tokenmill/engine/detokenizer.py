"""Incremental detokenization and stop strings.

Fast tokenizers stream through `tokenizers`' DecodeStream, which holds back bytes until they form
whole UTF-8 characters and handles merges across token boundaries. The stream is primed with the
prompt's last tokens so the first generated token decodes in context (leading spaces)."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6


def append_text(obj, name: str, piece: str) -> None:
    """obj.<name> += piece, growing the string in place: while it grows, `text` holds its only reference, which
    lets CPython extend it. A plain `obj.name += piece` copies the whole text each time (the attribute keeps a
    second reference): per token, that made detokenizing a 40K-token output cost 3.6x at its end."""
    text = getattr(obj, name)
    setattr(obj, name, "")
    try:
        text += piece
    finally:  # (a MemoryError must not leave the text empty)
        setattr(obj, name, text)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prompt_tail = list(prompt_token_ids[-_PRIME_TOKENS:])
        if self._backend is not None:
            self._stream = DecodeStream(ids=self._prompt_tail, skip_special_tokens=skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        # slow tokenizers: decode the whole tail and take what is new
        self._ids.append(token_id)
        full = self.tokenizer.decode(self._prompt_tail + self._ids, skip_special_tokens=self._skip)
        base = self.tokenizer.decode(self._prompt_tail, skip_special_tokens=self._skip)
        new = full[len(base):][len(self.output_text):]
        return "" if new.endswith("\ufffd") else new

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens' text. Returns the stop string if one matched (text is then truncated, and
        `num_used` says how many of the new tokens it took: tokens after the match are not output,
        which matters when a step brings several, as speculative decoding does)."""
        self.num_used = 0
        for t in new_token_ids:
            before = len(self.output_text)
            append_text(self, "output_text", self._decode_next(t))
            self.num_used += 1
            if self.stop:
                hit = self._find_stop(before)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_from: int) -> str | None:
        start = max(0, new_from - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s)] if self.include_stop else self.output_text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show while streaming: hold back a tail that could still begin a stop string."""
        if finished or not self.max_stop_len:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.max_stop_len + 1)]
