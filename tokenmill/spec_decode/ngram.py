"""Prompt-lookup (n-gram) drafts: find the longest suffix of the sequence, between `min_n` and `max_n`
tokens long, that occurred earlier, and propose the tokens that followed its latest earlier occurrence
(the latest one that k tokens follow, when there is one).

    tokens   ... the cat sat on the mat . the cat sat  <- suffix "the cat sat" (n = 3)
                 ^^^^^^^^^^^ earlier match  -> propose "on the mat ..." (up to k tokens)
"""
from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """`tokens` int64 [L] (prompt + output). Up to k draft tokens; [] when no suffix repeats.

    One pass over the sequence finds where the last token occurred earlier (each such place followed by
    at least one token); only those candidates are extended backwards, one token at a time up to max_n, so
    a step costs one comparison over L plus a few over the candidates, not one window scan per n."""
    L = len(tokens)
    max_n = min(max_n, L - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # where a matching window would end
    if not len(ends):
        return []
    match = np.ones(len(ends), dtype=np.int64)  # how many tokens of the suffix match, backwards from each end
    alive = np.ones(len(ends), dtype=bool)
    for i in range(1, max_n):
        back = ends - i
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[L - 1 - i]
        match += alive
    for n in range(max_n, min_n - 1, -1):
        hits = ends[match >= n] - (n - 1)  # window starts, ascending
        if len(hits):
            # the latest occurrence that k whole tokens follow (a repeated token's latest match is
            # followed by one token only), else the earliest, which the most tokens follow
            whole = hits[hits + n + k <= L]
            start = int(whole[-1] if len(whole) else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Keeps a growing numpy copy of each request's tokens, so a step converts only what is new."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._arrays: dict[str, np.ndarray] = {}
        self._lens: dict[str, int] = {}

    def propose(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        arr = self._tokens(request_id, prompt, output)
        return ngram_propose(arr, k, self.min_n, self.max_n)

    def propose_batch(self, runner, items) -> dict[str, list[int]]:
        out = {}
        for s, st in items:
            drafts = self.propose(s.request_id, st.prompt_token_ids, st.output_token_ids, s.propose_k)
            if drafts:
                out[s.request_id] = drafts
        return out

    def _tokens(self, rid: str, prompt: list[int], output: list[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        arr, have = self._arrays.get(rid), self._lens.get(rid, 0)
        if arr is None or have > total or len(arr) < total:
            arr = np.empty(max(2 * total, 64), dtype=np.int64)
            arr[:len(prompt)] = prompt
            have = len(prompt)
            self._arrays[rid] = arr
        if have < total:
            arr[have:total] = output[have - len(prompt):]
        self._lens[rid] = total
        return arr[:total]

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._arrays.pop(rid, None)
            self._lens.pop(rid, None)
