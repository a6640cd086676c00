"""Incremental detokenization and stop strings.

Fast tokenizers stream through `tokenizers`' DecodeStream, which holds back bytes until they form
whole UTF-8 characters and handles merges across token boundaries. The stream is primed with the
prompt's last tokens so the first generated token decodes in context (leading spaces). It is primed by
stepping through them, not by DecodeStream(ids=...): that one reads a tail ending inside a character (a
token-id prompt cut mid-character, e.g. an earlier output cut by max_tokens) as if the half character were
whole, and then gave prompt text as output once the character was completed. Stepping holds the half
character back, so only the completed character comes out."""
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
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.min_tokens = min_tokens  # stop strings count only from the text after the first min_tokens tokens
        self.num_tokens = 0
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prompt_tail = list(prompt_token_ids[-_PRIME_TOKENS:])
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in self._prompt_tail:
                self._stream.step(self._backend, t)
        else:  # the tail's text, less a half character it ends with (the output completes it, as above)
            self._base_len = len(tokenizer.decode(self._prompt_tail, skip_special_tokens=skip_special_tokens)
                                 .rstrip("\ufffd"))

    def _decode_next(self, token_id: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        # slow tokenizers: decode the whole tail and take what is new
        self._ids.append(token_id)
        full = self.tokenizer.decode(self._prompt_tail + self._ids, skip_special_tokens=self._skip)
        new = full[self._base_len:][len(self.output_text):]
        return "" if new.endswith("\ufffd") else new

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens' text. Returns the stop string if one matched (text is then truncated, and
        `num_used` says how many of the new tokens it took: tokens after the match are not output,
        which matters when a step brings several, as speculative decoding does).
        `stop_terminated`: the last token ended the request (EOS, a stop token id); its text is left out
        unless include_stop_str_in_output (as vLLM and OpenAI: "\nI have been" stopped on " been" reads
        "\nI have")."""
        self.num_used = 0
        last = len(new_token_ids) - 1
        for i, t in enumerate(new_token_ids):
            self.num_used += 1
            self.num_tokens += 1
            if i == last and stop_terminated and not self.include_stop:
                return None
            before = len(self.output_text)
            append_text(self, "output_text", self._decode_next(t))
            if self.stop and self.num_tokens > self.min_tokens:
                # a match may begin in the first min_tokens tokens' text, but must end after it
                hit = self._find_stop(before)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_from: int) -> str | None:
        """The earliest stop string that ends in the text from `new_from` on."""
        best = None
        for s in self.stop:
            i = self.output_text.find(s, max(0, new_from - len(s) + 1))
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
