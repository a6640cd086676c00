"""Lossless verification of draft tokens against the target model's logits.

One request with k drafts d_1..d_k runs k + 1 positions; row j of its logits predicts the token after
d_j (row 0: after the last accepted token). Row j's penalties and min_tokens see the output *as if*
d_1..d_j were accepted, which is exactly the history plain decoding would have had there.

    greedy:   accept d_{j+1} while it equals row j's argmax; then emit row j's argmax (the correction,
              or the bonus token when every draft was accepted). Token-identical to plain greedy.
    sampling: accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); on the first rejection emit a
              sample of norm(max(0, p_j - q_j)); after k acceptances emit a sample of p_k (the bonus).
              p is the target's distribution after temperature / top-k / top-p / min-p, q the
              proposer's. The emitted tokens follow p exactly.

For a deterministic proposer (n-gram, or a draft model proposing its argmax), q is one-hot and the rule
becomes: draw x ~ p_j with the request's generator; accept the draft iff x == d_{j+1}, else emit x
(x given x != d is exactly norm(max(0, p_j - q_j))). Each emitted token costs one draw, in order, as in
plain decoding, so a seeded request gives the *same* tokens with or without speculation, whatever k. On a GPU
the draws are made ahead for every row and read back with the rows' argmaxes in one transfer (not one device
read per token); a seeded request's generator is then put back to its state after the last emitted token's
draw. (Logprobs, when asked for, are one more read.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.device_copy import device_tensor
from tokenmill.sample.sampler import SampleRow, Sampler, TokenLogprobs, argmax_rows, exponential_sample


DRAW_AHEAD_DEVICES = {"cuda"}  # where reading a draw back means waiting for the device (the tests add "cpu")


@dataclass
class DraftCheck:
    """One request's verification input: its k + 1 sampling rows and its drafts."""
    row: SampleRow  # history before this step
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # [k, V] the proposer's distributions; None: one-hot (n-gram)
    # structured outputs: per row, (the grammar's packed mask after drafts[:j] or None, whether only stops remain)
    # (sample/grammar.py RequestGrammar.draft_bitmasks)
    grammar_rows: list[tuple[torch.Tensor | None, bool]] | None = None


def expanded_rows(check: DraftCheck) -> list[SampleRow]:
    r, g = check.row, check.grammar_rows
    return [SampleRow(r.params, r.prompt_token_ids, r.output_token_ids + check.drafts[:j], r.generator,
                      token_bitmask=g[j][0] if g else None, grammar_complete=g[j][1] if g else False)
            for j in range(len(check.drafts) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, checks: list[DraftCheck]
           ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """`logits` [sum(k_i + 1), V], each request's rows in order. Returns the emitted tokens per request
    (accepted drafts, then one more) and, for requests that asked, one logprobs row per emitted token."""
    rows = [row for c in checks for row in expanded_rows(c)]
    adjusted = sampler.adjusted_logits(logits, rows)
    greedy_tokens = argmax_rows(adjusted)
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = {}
    if rand:
        p = sampler.probs(adjusted.index_select(0, device_tensor(rand, torch.int64, adjusted.device)),
                          [rows[i] for i in rand])
        probs = {i: p[j] for j, i in enumerate(rand)}
    greedy_tokens, draws = _draw_ahead(sampler, checks, probs, greedy_tokens)
    emitted, emitted_rows, start = [], [], 0
    for i, c in enumerate(checks):
        n = len(c.drafts) + 1
        gen = c.row.generator or sampler.generator
        if c.draft_probs is not None and not c.row.params.greedy:
            out = _verify_against_q(c, [probs[start + j] for j in range(n)], gen)
        elif c.row.params.greedy:
            out = accept_greedy(greedy_tokens[start:start + n], c.drafts)
        elif i in draws:
            xs, states = draws[i]
            out = accept_greedy(xs, c.drafts)  # x_j accepts draft j + 1 while equal: the one-hot q rule
            if states is not None and len(out) < n:
                gen.set_state(states[len(out)])  # as if only the emitted tokens had been drawn
        else:  # on a CPU a read costs nothing: draw only what is emitted
            out = []
            for j in range(n):
                x = _draw(probs[start + j], gen)
                out.append(x)
                if j == n - 1 or x != c.drafts[j]:
                    break
        emitted.append(out)
        emitted_rows.append(list(range(start, start + len(out))))
        start += n
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(checks)
    want = [i for i, c in enumerate(checks) if c.row.params.logprobs is not None]
    if want:
        idx = [r for i in want for r in emitted_rows[i]]
        toks = device_tensor([t for i in want for t in emitted[i]], torch.int64, logits.device)
        lps = sampler.logprobs(logits.index_select(0, device_tensor(idx, torch.int64, logits.device)), toks,
                               [rows[r] for r in idx])
        pos = 0
        for i in want:
            logprobs[i] = lps[pos:pos + len(emitted[i])]
            pos += len(emitted[i])
    return emitted, logprobs


def accept_greedy(row_tokens: list[int], drafts: list[int]) -> list[int]:
    """The greedy rule: row j's token (its argmax) accepts draft j + 1 while they are equal; the emitted tokens
    are the accepted drafts, then the first row token that disagreed (or the bonus after the last draft)."""
    out = [row_tokens[0]]
    for j, d in enumerate(drafts):
        if d != out[j]:
            break
        out.append(row_tokens[j + 1])
    return out


def _draw_ahead(sampler: Sampler, checks: list[DraftCheck], probs: dict, greedy: torch.Tensor
                ) -> tuple[list[int], dict]:
    """Every row's argmax and, per one-hot sampled check, every row's draw x_j, read back together (one device
    read for the step instead of one per emitted token), with, for a request's own generator, its state before
    each draw, so that the caller can put it back after the last emitted token: a seeded request consumes one
    draw per emitted token, as plain decoding does. The shared generator (unseeded rows) promises no such thing
    and is left as is. Draws ahead only on a GPU: on a CPU the draws past a rejection would cost more than the
    reads they save (the caller then draws what it emits)."""
    if not probs or next(iter(probs.values())).device.type not in DRAW_AHEAD_DEVICES:
        return greedy.tolist(), {}
    pending, start = {}, 0
    for i, c in enumerate(checks):
        n = len(c.drafts) + 1
        if c.draft_probs is None and not c.row.params.greedy:
            gen = c.row.generator or sampler.generator
            states = [] if c.row.generator is not None else None
            xs = []
            for j in range(n):
                if states is not None:
                    states.append(gen.get_state())
                xs.append(_draw_on_device(probs[start + j], gen))
            pending[i] = (xs, states)
        start += n
    flat = torch.cat([greedy] + [x for xs, _ in pending.values() for x in xs]).tolist()
    out, pos = {}, len(greedy)
    for i, (xs, states) in pending.items():
        out[i] = (flat[pos:pos + len(xs)], states)
        pos += len(xs)
    return flat[:len(greedy)], out


def _draw_on_device(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token from p as a [1] tensor on p's device, as the plain sampler draws it (exponential race, one [V]
    draw)."""
    return exponential_sample(p.unsqueeze(0), [gen], gen)


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    return int(_draw_on_device(p, gen)[0])


def _verify_against_q(c: DraftCheck, p: list[torch.Tensor], gen: torch.Generator) -> list[int]:
    """Rejection sampling for a proposer with a full distribution q (a sampling draft model)."""
    out = []
    for j, d in enumerate(c.drafts):
        q = c.draft_probs[j]
        u = torch.rand((), generator=gen, device=gen.device).item()
        if float(q[d]) > 0 and u < min(1.0, float(p[j][d]) / float(q[d])):
            out.append(d)
            continue
        residual = (p[j] - q).clamp_min(0.0)
        total = float(residual.sum())
        out.append(_draw(residual / total if total > 0 else p[j], gen))
        return out
    out.append(_draw(p[len(c.drafts)], gen))  # every draft accepted: the bonus token
    return out
