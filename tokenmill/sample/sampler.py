"""Logits -> next tokens: logit bias, penalties, min_tokens, grammar masks (structured outputs), then greedy
or temperature / top-k / top-p / min-p sampling, and logprobs. Seeded requests draw from their own
generator, so a seed reproduces the same tokens whatever else shares the batch.

Everything runs on the logits' device: generators live there (CUDA's Philox generators on a GPU), the
per-row parameters go over in one small copy each, and the only device-to-host transfer is the chosen
token ids (plus logprobs for the requests that ask), once per step."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from tokenmill.device_copy import device_tensor, take_rows, to_device
from tokenmill.sample.grammar import apply_token_masks

from tokenmill.sampling_params import SamplingParams

# (token_id, logprob, rank) rows: the chosen token first, then the top-N.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # async scheduling: the last output token, sampled by the step in flight and not on the host yet ([1], on
    # the device; not in output_token_ids): penalties count it there, without waiting for it
    pending: torch.Tensor | None = None
    # structured outputs: the tokens its grammar allows next (sample/grammar.py's packed int32 bitmask, host)
    token_bitmask: torch.Tensor | None = None
    grammar_complete: bool = False  # its grammar allows only stop tokens: min_tokens does not ban them

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + (self.pending is not None)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# temperatures above this sample as this (already uniform over the unmasked tokens to a fraction of a percent);
# past float32's (or bfloat16's) range it would be inf, and a masked -inf logit over inf is NaN
MAX_TEMPERATURE = 1e4
# a repetition penalty acts at most as this (or its inverse): a logit divided by 1e-40 would be inf, and the row NaN
MAX_REPETITION_PENALTY = 1e3
PENALTY_ROWS = 32  # rows penalized at once: bounds the [rows, vocab] temporaries (~15 bytes a logit)


def flat_token_positions(lists: list[list[int]], vocab: int) -> torch.Tensor:
    """Ragged token lists as positions row * vocab + id in a flattened [rows, vocab] table (host, int64):

        rows [[5, 9, 5], [7]]  -->  [5, 9, 5, vocab + 7]

    Ids past the logits (none today: prompts are checked, outputs sampled) are left out: they can never be
    sampled."""
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(x) for x in lists]))
    flat = rows * vocab + ids
    return flat if not len(ids) or int(ids.max()) < vocab else flat[ids < vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place. Repetition penalty covers prompt and output (as HF and vLLM); presence and
    frequency penalties cover the output only (as OpenAI).

    The penalized rows go PENALTY_ROWS at a time, with no device reads: their token ids go over as flat
    positions (flat_token_positions), scattered into per-row counts and a seen mask on the device."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    for c in range(0, len(idx), PENALTY_ROWS):
        chunk = idx[c:c + PENALTY_ROWS]
        _penalize(logits, chunk, [rows[i] for i in chunk])


def _penalize(logits: torch.Tensor, idx: list[int], sub: list[SampleRow]) -> None:
    n, vocab, dev = len(sub), logits.shape[-1], logits.device
    floats = device_tensor([[min(max(r.params.repetition_penalty, 1 / MAX_REPETITION_PENALTY), MAX_REPETITION_PENALTY),
                             r.params.frequency_penalty, r.params.presence_penalty] for r in sub], torch.float32, dev)
    rep, freq, pres = floats.unsqueeze(2).unbind(1)  # [n, 1] each
    out = to_device(flat_token_positions([r.output_token_ids for r in sub], vocab), dev)
    counts = torch.zeros(n * vocab, dtype=torch.float32, device=dev)
    counts = counts.scatter_add_(0, out, torch.ones(out.shape, dtype=torch.float32, device=dev))
    waiting = [j for j, r in enumerate(sub) if r.pending is not None]
    if waiting:  # last tokens still on the device: their positions computed there
        at = device_tensor(waiting, torch.int64, dev) * vocab + torch.cat([sub[j].pending for j in waiting])
        counts.scatter_add_(0, at, torch.ones(at.shape, dtype=torch.float32, device=dev))
    counts = counts.view(n, vocab)
    rows_at = device_tensor(idx, torch.int64, dev)
    picked = logits.index_select(0, rows_at).float()  # a copy: the arithmetic below is in place
    if any(r.params.repetition_penalty != 1.0 for r in sub):
        prompts = to_device(flat_token_positions([r.prompt_token_ids for r in sub], vocab), dev)
        seen = torch.zeros(n * vocab, dtype=torch.bool, device=dev).index_fill_(0, prompts, True).view(n, vocab)
        seen |= counts > 0
        positive = picked > 0
        # x / rep where seen and positive, x * rep where seen otherwise (x / 1 and x * 1 are exact)
        picked.div_(torch.where(seen & positive, rep, 1.0))
        picked.mul_(torch.where(seen & ~positive, rep, 1.0))
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in sub):
        present = counts > 0
        picked.sub_(counts.mul_(freq).add_(present * pres))
    logits.index_copy_(0, rows_at, picked.to(logits.dtype))


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place: each row's logit_bias added to its logits, for all rows in one write, from tensors each request
    made once (SamplingParams.logit_bias_tensors). Ids past the logits (the engine refuses them; a row of a
    smaller draft vocabulary) are left out: indexing them would fail the step."""
    biased = [(i, r.params.logit_bias_tensors) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    ids = torch.cat([t[0] for _, t in biased])
    at = torch.repeat_interleave(torch.tensor([i for i, _ in biased]), torch.tensor([len(t[0]) for _, t in biased]))
    values = torch.cat([t[1] for _, t in biased])
    keep = ids < logits.shape[-1]
    if not bool(keep.all()):  # host tensors: no device read
        at, ids, values = at[keep], ids[keep], values[keep]
    dev = logits.device
    index = to_device(torch.stack([at, ids]), dev)
    logits.index_put_((index[0], index[1]), to_device(values, dev).to(logits.dtype), accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, idx: list[int], rows: list[SampleRow]) -> None:
    """In place: rows idx keep only their allowed_token_ids' logits (the rest -inf), for all of them in one write,
    from tensors each request made once. Ids past the logits (a smaller draft vocabulary) are left out."""
    vocab, dev = logits.shape[-1], logits.device
    ids = [rows[i].params.allowed_token_tensor for i in idx]
    flat = torch.cat([t[t < vocab] + j * vocab for j, t in enumerate(ids)])  # positions in [len(idx), vocab]
    keep = torch.zeros(len(idx) * vocab, dtype=torch.bool, device=dev).index_fill_(0, to_device(flat, dev), True)
    at = device_tensor(idx, torch.int64, dev)
    logits.index_copy_(0, at, logits.index_select(0, at).masked_fill(~keep.view(len(idx), vocab), float("-inf")))


def bad_word_bans(words: tuple[tuple[int, ...], ...], tokens: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end `tokens` (a one-token word: always)."""
    out = []
    for w in words:
        n = len(w) - 1
        if n == 0 or (len(tokens) >= n and tuple(tokens[-n:]) == w[:-1]):
            out.append(w[-1])
    return out


def apply_bad_words(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place: the tokens that would complete one of a row's bad words get -inf, for all rows in one write.
    Under async scheduling a row's last token may still be on the device (`SampleRow.pending`): a row with a
    word of several tokens reads it there (a wait, as a grammar's), the only way to know what it completes."""
    at_rows, at_ids = [], []
    for i, r in enumerate(rows):
        words = r.params.bad_words_token_ids
        if not words:
            continue
        tokens = r.output_token_ids
        if r.pending is not None and r.params.reads_output:
            tokens = tokens + [int(r.pending[0])]
        banned = [t for t in bad_word_bans(words, tokens) if t < logits.shape[-1]]
        at_rows += [i] * len(banned)
        at_ids += banned
    if at_rows:
        at = device_tensor([at_rows, at_ids], torch.int64, logits.device)
        logits.index_put_((at[0], at[1]), logits.new_full((), float("-inf")))


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Stop ids get -inf until a row has its min_tokens, for all rows in one masked write."""
    at_rows, at_ids = [], []
    for i, r in enumerate(rows):
        sp = r.params
        if r.num_output_tokens < sp.min_tokens and not r.grammar_complete:
            # ids past the logits (a tokenizer's added tokens, a client's typo) can never be sampled: masking them
            # would fail the step (on a GPU, a device-side assert that ends the CUDA context)
            banned = [t for t in sp.stop_ids if t < logits.shape[-1]]
            at_rows += [i] * len(banned)
            at_ids += banned
    if at_rows:
        at = device_tensor([at_rows, at_ids], torch.int64, logits.device)
        logits.index_put_((at[0], at[1]), logits.new_full((), float("-inf")))  # made on the device: no copy


def stop_where_nothing_is_left(logits: torch.Tensor, rows: list[SampleRow], constrained: list[int]) -> None:
    """In place: a row whose constraints leave no token (a grammar, allowed_token_ids or bad words that, with
    min_tokens, ban every token) gets its stop tokens back, so the request ends there instead of sampling from an
    all -inf row (token 0 for greedy, NaN for sampling). Only the `constrained` rows can be so, and only they are
    read, on the device, without a host read: the rows are picked by a mask the host never sees. A row with no
    stop token (ignore_eos) is left as it is."""
    at_rows, at_ids = [], []  # (j: the row's place among the constrained ones)
    for j, i in enumerate(constrained):
        stops = [t for t in rows[i].params.stop_ids if t < logits.shape[-1]]
        at_rows += [j] * len(stops)
        at_ids += stops
    if not at_rows:
        return
    dev = logits.device
    where = device_tensor(constrained, torch.int64, dev)
    at = device_tensor([at_rows, at_ids], torch.int64, dev)
    dead = torch.isneginf(logits.index_select(0, where)).all(dim=-1)
    rows_at = where[at[0]]
    current = logits[rows_at, at[1]]
    logits.index_put_((rows_at, at[1]), torch.where(dead[at[0]], torch.zeros_like(current), current))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  use_k: bool, use_p: bool, use_min_p: bool, ks: list[int] | None = None,
                  ps: list[float] | None = None) -> torch.Tensor:
    """Mask excluded tokens with -inf. top_k 0 = off, top_p 1 = off, min_p 0 = off (per row).

    With the rows' settings on the host (`ks`, `ps`), top-k / top-p read the W largest logits of each row
    (`topk`) instead of sorting the whole vocabulary (a sort of 150K logits per row costs milliseconds on a
    CPU): exact where every kept token is among them, i.e. every row has a top-k (W = the largest), or on a
    CPU where the W = CANDIDATES most likely tokens of each row without one hold its top-p mass (checked; if
    not, the sort runs). Rows with neither filter are left as they are. `_sort_filter` is the oracle.
    min_p goes first, as in vLLM v1 (top-k and top-p then see what it left: with both, top-p's mass is that of
    the tokens min_p kept; min_p's own cut, relative to the most likely token, is the same in either order)."""
    if use_min_p:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if (use_k or use_p) and ks is not None:
        narrowed = _top_w_filter(logits, top_k, top_p, ks, ps, use_k, use_p)
        if narrowed is not None:
            logits, use_k, use_p = narrowed, False, False
    if use_k or use_p:
        logits = _sort_filter(logits, top_k, top_p, use_k, use_p)
    return logits


CANDIDATES = 1024  # top-p without top-k looks among this many tokens first (CPU)


def _sort_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool,
                 use_p: bool) -> torch.Tensor:
    """top-k / top-p over the whole vocabulary, sorted."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    mask = _sorted_mask(sorted_logits, top_k, top_p, use_k, use_p)
    return logits.scatter(1, idx, sorted_logits.masked_fill(mask, float("-inf")))


def _sorted_mask(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool,
                 whole_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Which of each row's logits, sorted in descending order, top-k / top-p exclude. `whole_probs`: where
    `sorted_logits` is only the head of each row, the head's probabilities under the whole row, which rows
    without a top-k take their top-p mass from (rows with one renormalize over their k, as over the row)."""
    width = sorted_logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k, width)
        mask |= torch.arange(width, device=sorted_logits.device).unsqueeze(0) >= k.unsqueeze(1)
    if use_p:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        if whole_probs is not None:
            probs = torch.where((top_k > 0).unsqueeze(1), probs, whole_probs)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        # (the first token stays: a top_p that rounds to 0 in float32, 1e-300, would mask every token; and a
        # row with top_p 1 keeps all: a cumsum that rounds up to 1 would mask its least likely tokens)
        mask[:, 1:] |= (mass_before[:, 1:] >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    return mask


def _top_w_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, ks: list[int], ps: list[float],
                  use_k: bool, use_p: bool) -> torch.Tensor | None:
    """filter_logits' top-k / top-p from each filtered row's W largest logits; None where that cannot be exact
    (or would cost as much as the sort)."""
    vocab = logits.shape[-1]
    rows = [i for i, (k, p) in enumerate(zip(ks, ps)) if k > 0 or p < 1]
    every_k = all(ks[i] > 0 for i in rows)
    if every_k:
        width = max(ks[i] for i in rows)
    elif logits.device.type == "cpu":  # (checking the candidates' mass reads it back: not on a GPU's hot path)
        width = max([CANDIDATES] + [ks[i] for i in rows])  # (a row's top-k may reach past the candidates)
    else:
        return None
    if width * 2 > vocab:
        return None
    whole = len(rows) == len(ks)
    at = None if whole else device_tensor(rows, torch.int64, logits.device)
    sub, sub_k, sub_p = (logits, top_k, top_p) if whole else (t.index_select(0, at) for t in (logits, top_k, top_p))
    vals, idx = sub.topk(width, dim=-1)
    whole_probs = None
    if use_p and not every_k:
        whole_probs = sub.softmax(dim=-1).gather(1, idx)
        # a row without top-k whose candidates hold less than its top-p mass keeps tokens past them: sort (the
        # mass as the mask sums it, with a margin: a top_p within rounding of it is left to the sort too)
        held = whole_probs.cumsum(dim=-1)[:, -1]
        if not bool(((held >= sub_p + 1e-5) | (sub_k > 0)).all()):
            return None
    mask = _sorted_mask(vals, sub_k, sub_p, use_k, use_p, whole_probs)
    filtered = torch.full_like(sub, float("-inf")).scatter_(1, idx, vals.masked_fill(mask, float("-inf")))
    return filtered if whole else logits.index_copy(0, at, filtered)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, as argmax): `max` is 2-3x faster than `argmax` on CPU
    over a 150K vocabulary, 3 ms a step at batch 32."""
    return x.max(dim=-1).indices


def exponential_sample(probs: torch.Tensor, generators: list[torch.Generator | None],
                       default: torch.Generator) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws a token with probability p (the Gumbel-max trick);
    each row's noise comes from its own generator when it has one, the others' from `default` in one call.
    On a CPU (where a row's noise over a 152K vocabulary costs ~2.5 ms), the same law drawn cheaper: a seeded row
    draws for its own tokens of nonzero probability only; unseeded rows, where filters left few, for those."""
    if probs.device.type != "cpu":
        return _whole_row_sample(probs, generators, default)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        return _shared_sample(probs, default)
    own = [i for i, g in enumerate(generators) if g is not None]
    if not shared:
        return _own_rows_sample(probs, generators)
    tokens, mine = torch.empty(len(generators), dtype=torch.int64), torch.tensor(own)
    tokens.index_copy_(0, mine, _own_rows_sample(probs.index_select(0, mine), [generators[i] for i in own]))
    at = torch.tensor(shared)
    return tokens.index_copy_(0, at, _shared_sample(probs.index_select(0, at), default))


def _own_rows_sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """exponential_sample for rows with generators of their own (CPU): each row's noise is drawn for its tokens
    of nonzero probability in vocabulary order, so what a row draws depends on the row alone (a seeded request
    gives the same tokens whatever the batch)."""
    rows, cols = (probs > 0).nonzero(as_tuple=True)
    ratios = probs[rows, cols]
    counts = torch.bincount(rows, minlength=len(generators)).tolist()
    tokens = torch.empty(len(generators), dtype=torch.int64)
    start = 0
    for i, (seg, g) in enumerate(zip(ratios.split(counts), generators)):
        if counts[i]:
            seg.div_(_exponential(torch.empty_like(seg), g))
            tokens[i] = cols[start + int(argmax_rows(seg))]
        else:  # nothing left (a nan row): as the whole row's argmax would
            tokens[i] = argmax_rows(probs[i])
        start += counts[i]
    return tokens


def _shared_sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """exponential_sample for rows that all draw from one generator (CPU)."""
    picked = _sample_among_support(probs, generator)
    return picked if picked is not None else _whole_row_sample(probs, [None] * len(probs), generator)


def _sample_among_support(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """exponential_sample over each row's tokens of nonzero probability only (the widest row's count of them,
    gathered with topk); None where that is no cheaper (a wide support)."""
    support = max(1, int((probs > 0).sum(dim=-1).max()))
    if support * 8 > probs.shape[-1]:
        return None
    vals, idx = probs.topk(support, dim=-1)  # (a narrower row's extra entries are zeros: p / E = 0 never wins)
    won = argmax_rows(vals / _exponential(torch.empty_like(vals), generator))
    return idx.gather(1, won.unsqueeze(1)).squeeze(1)


def _whole_row_sample(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator) -> torch.Tensor:
    """exponential_sample with noise for every token of every row."""
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        _exponential(noise, default)
    else:
        for i, g in enumerate(generators):
            if g is not None:
                _exponential(noise[i], g)
        if shared:
            at = device_tensor(shared, torch.int64, noise.device)
            noise.index_copy_(0, at, _exponential(torch.empty((len(shared), noise.shape[1]), dtype=noise.dtype,
                                                              device=noise.device), default))
    return argmax_rows(probs / noise)


_U_MIN = 2.0 ** -53  # float64's smallest uniform step above 0


def _exponential(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`t` filled with Exp(1) draws, in place. On a CPU as -log(U): torch's exponential_ costs 3x a float64
    uniform draw and a log there (23 ms against 7.3 for 8 rows of a 152K vocabulary), which made the noise
    most of a sampled step. U is float64: near 1, float32's 2^-24 grid would make the smallest E values (the
    winners' in a flat row) coarse enough to tie in ~1 % of draws. U is kept off 0 (E would be inf: a kept
    token could never win) and below 1 by construction (E = 0 would make p / E inf, or nan for an excluded
    token); E is cut at 36.7, which it passes with probability 1e-16."""
    if t.device.type != "cpu":
        return t.exponential_(generator=generator)
    if t.dim() > 1:  # row by row: one float64 buffer for a whole batch (39 MB at 32 x 152K) doubles the cost
        for row in t:
            _exponential(row, generator)
        return t
    u = torch.empty(t.shape, dtype=torch.float64).uniform_(generator=generator)
    return t.copy_(u.clamp_(min=_U_MIN).log_().neg_())


class Sampler:
    def __init__(self, seed: int = 0, device: str = "cpu"):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        tokens = self.sample(logits, rows)
        return SamplerOutput(tokens.tolist(), self.logprobs(logits, tokens, rows))

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The token ids, left on the logits' device (async scheduling reads them there first)."""
        adjusted = self.adjusted_logits(logits, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(rand) == len(rows):
            return exponential_sample(self.probs(adjusted, rows), [r.generator for r in rows], self.generator)
        tokens = argmax_rows(adjusted)
        if rand:
            sub = [rows[i] for i in rand]
            at = device_tensor(rand, torch.int64, tokens.device)
            sampled = exponential_sample(self.probs(adjusted.index_select(0, at), sub), [r.generator for r in sub],
                                         self.generator)
            tokens[at] = sampled
        return tokens

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Allowed tokens, bad words, logit bias, penalties, min_tokens and grammar masks applied (to a copy: the
        caller's logits stay raw, and logprobs are of them, as vLLM's default)."""
        penalties = any(r.params.needs_penalties for r in rows)
        bias = any(r.params.logit_bias for r in rows)
        min_tokens = any(r.num_output_tokens < r.params.min_tokens for r in rows)
        masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
        bad_words = any(r.params.bad_words_token_ids for r in rows)
        if penalties or bias or min_tokens or masked or allowed or bad_words:
            logits = logits.clone()
            if allowed:
                apply_allowed_tokens(logits, allowed, rows)
            if bad_words:
                apply_bad_words(logits, rows)
            if bias:  # before the penalties, as vLLM (a repetition penalty scales the biased logit)
                apply_logit_bias(logits, rows)
            apply_penalties(logits, rows)
            apply_min_tokens(logits, rows)
            if masked:
                apply_token_masks(logits, masked, [rows[i].token_bitmask for i in masked])
            if masked or allowed or bad_words:
                constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None
                               or r.params.allowed_token_ids or r.params.bad_words_token_ids]
                stop_where_nothing_is_left(logits, rows, constrained)
        return logits

    @staticmethod
    def probs(adjusted: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The distribution a non-greedy row samples from: temperature, then top-k / top-p / min-p."""
        dev = adjusted.device
        temp = device_tensor([min(r.params.temperature, MAX_TEMPERATURE) for r in rows], adjusted.dtype, dev)
        logits = adjusted / temp.unsqueeze(1)
        ks, ps, mps = ([r.params.top_k for r in rows], [r.params.top_p for r in rows],
                       [r.params.min_p for r in rows])
        top_k = device_tensor(ks, torch.int64, dev)
        top_p = device_tensor(ps, logits.dtype, dev)
        min_p = device_tensor(mps, logits.dtype, dev)
        # which filters run is decided from the host lists: no device reads
        logits = filter_logits(logits, top_k, top_p, min_p, any(k > 0 for k in ks), any(p < 1 for p in ps),
                               any(m > 0 for m in mps), ks=ks, ps=ps)
        return logits.softmax(dim=-1)

    @staticmethod
    def logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[TokenLogprobs | None]:
        """Per row that asked: the chosen token's logprob under the raw logits, and the top-N."""
        return Sampler.logprob_rows(rows, Sampler.logprob_tensors(raw_logits, tokens, rows))

    @staticmethod
    def logprob_tensors(raw_logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> tuple:
        """The device half of `logprobs` (async scheduling copies these back with the tokens). Raw logits, but a
        grammar's mask applies, as in vLLM (which masks the logits before its sampler): the distribution is over
        the tokens the grammar allows (a "choice" request's logprobs classify among its choices)."""
        idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not idx:
            return ()
        top_n = max(rows[i].params.logprobs for i in idx)
        logits = take_rows(raw_logits, idx)
        masked = [j for j, i in enumerate(idx) if rows[i].token_bitmask is not None]
        if masked:
            raw, logits = logits, logits.clone()
            apply_token_masks(logits, masked, [rows[idx[j]].token_bitmask for j in masked])
            # a mask that leaves nothing (the sampler then stops the row): its raw logits, not NaNs
            logits = torch.where(torch.isneginf(logits).all(dim=-1, keepdim=True), raw, logits)
        return token_logprob_tensors(logits.log_softmax(dim=-1), take_rows(tokens, idx), top_n)

    @staticmethod
    def logprob_rows(rows: list[SampleRow], tensors: tuple) -> list[TokenLogprobs | None]:
        """The host half: `logprob_tensors`' output (on any device) as rows."""
        lps: list[TokenLogprobs | None] = [None] * len(rows)
        if tensors:
            idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            for i, row in zip(idx, token_logprob_rows(*tensors)):
                lps[i] = row[: 1 + rows[i].params.logprobs]
        return lps


def token_logprob_tensors(logprobs: torch.Tensor, chosen: torch.Tensor, top_n: int) -> tuple:
    """(chosen, its logprob, its 1-based rank[, top-N values, top-N ids]) for every row, on the device."""
    lp = logprobs.gather(1, chosen.view(-1, 1)).view(-1)
    ranks = (logprobs > lp.unsqueeze(1)).sum(dim=1) + 1
    if not top_n:
        return chosen, lp, ranks
    vals, ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=1)  # a vocabulary smaller than 20 has no more
    return chosen, lp, ranks, vals, ids


def token_logprob_rows(chosen, lp, ranks, vals=None, ids=None) -> list[TokenLogprobs]:
    """Per row: [(chosen, logprob, rank), then the top-N as (id, logprob, 1-based position)] (vLLM's
    convention)."""
    rows = [[(t, v, r)] for t, v, r in zip(chosen.tolist(), lp.tolist(), ranks.tolist())]
    if vals is not None:
        for row, tv, ti in zip(rows, vals.tolist(), ids.tolist()):
            row.extend((t, v, j + 1) for j, (t, v) in enumerate(zip(ti, tv)))
    return rows
