"""How many tokens each request drafts, from what the engine measures (the default when speculating).

A request whose drafts are accepted with probability a each emits, with k drafts, on average

    E(k) = 1 + a + a^2 + ... + a^k     tokens per step       (a: that request's measured acceptance)

and a step of n tokens costs T(n) = t0 + t1 * n seconds, a line fitted online to the engine's own step
timings, plus c seconds per draft the proposer makes (timed on its own: a draft model's forward passes
run in the step before the drafts are verified). While the line is still unknown, k cycles through
0 .. k_max, so the fit sees steps of different sizes. Each step picks the k_i that maximize the batch's useful tokens per second,
(base + sum (E_i(k_i) - 1)) / T(base + sum k_i), where the base tokens (the decodes' last tokens and
prefill chunks) all count as useful: drafts must not slow other requests' prefills for less than they
give back. While decoding is memory-bound (t1 small next to t0), drafts are nearly
free and k rises; once a batch is compute-bound, or drafts keep failing, k falls to 0. A draft position
whose acceptance chance a^k is below `min_gain` is never worth its fixed costs (proposing, verifying),
however cheap the tokens. A request at k = 0 probes with one draft every `probe_every` steps, so its
acceptance estimate can recover. The estimate starts at `prior` (two pseudo-trials that decay away).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class StepCostModel:
    """Least-squares line through (tokens, seconds) with exponential forgetting of old steps."""

    def __init__(self, decay: float = 0.98, min_steps: int = 16):
        self.decay, self.min_steps = decay, min_steps
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.sw = d * self.sw + 1.0
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds
        self.steps += 1

    def line(self) -> tuple[float, float] | None:
        """(t0, t1), or None until enough steps of different sizes were seen."""
        if self.steps < self.min_steps:
            return None
        var = self.sw * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.sxx * self.sw):
            return None
        t1 = max(0.0, (self.sw * self.sxy - self.sx * self.sy) / var)
        t0 = max(1e-6, (self.sy - t1 * self.sx) / self.sw)
        return t0, t1


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (tokenmill:spec_decode_*)."""
    num_drafts: int = 0  # steps in which a request verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the one token the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, prior: float = 0.6, decay: float = 0.8,
                 probe_every: int = 16, min_gain: float = 0.1):
        self.k_max, self.adaptive = k_max, adaptive
        self.prior, self.decay, self.probe_every, self.min_gain = prior, decay, probe_every, min_gain
        self.cost = StepCostModel()
        self._propose_s = self._proposed = 0.0  # decayed seconds and drafts of the proposer
        self.stats = SpecStats(accepted_per_pos=[0] * k_max)
        self._acc: dict[str, list[float]] = {}  # request -> [decayed accepted, decayed trials]
        self._idle: dict[str, int] = {}  # request -> steps planned at k = 0 in a row

    def acceptance(self, rid: str) -> float:
        num, den = self._acc.get(rid, (2 * self.prior, 2.0))
        return num / den

    def record(self, rid: str, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` drafts survived (the first rejection ends a run)."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        acc = self._acc.setdefault(rid, [2 * self.prior, 2.0])
        trials = accepted + (1 if accepted < drafted else 0)  # each acceptance, and the rejection if any
        acc[0] = self.decay * acc[0] + accepted
        acc[1] = self.decay * acc[1] + trials

    def observe_proposals(self, drafts: int, seconds: float) -> None:
        self._propose_s = 0.95 * self._propose_s + seconds
        self._proposed = 0.95 * self._proposed + drafts

    @property
    def propose_cost(self) -> float:
        """Seconds per draft token the proposer costs (0 until it has proposed)."""
        return self._propose_s / self._proposed if self._proposed else 0.0

    def release(self, rid: str) -> None:
        self._acc.pop(rid, None)
        self._idle.pop(rid, None)

    def plan(self, rids: list[str], base_tokens: int) -> dict[str, int]:
        """Drafts to propose for each sampling request, for a next step of about `base_tokens` tokens
        before drafts."""
        if not self.adaptive:
            return {rid: self.k_max for rid in rids}
        line = self.cost.line()
        if line is None:  # still measuring: vary k so the fit sees steps of different sizes
            return {rid: self.cost.steps % (self.k_max + 1) for rid in rids}
        t0, t1 = line
        per_draft = t1 + self.propose_cost
        total, gain, plan = float(base_tokens), float(base_tokens), {}
        for rid in rids:
            a = self.acceptance(rid)
            best_k, best = 0, gain / (t0 + t1 * total)
            e = 1.0
            for k in range(1, self.k_max + 1):
                if a ** k < self.min_gain:
                    break
                e += a ** k
                rate = (gain - 1.0 + e) / (t0 + t1 * total + per_draft * k)
                if rate > best * 1.0001:
                    best_k, best = k, rate
            if best_k == 0:
                idle = self._idle.get(rid, 0) + 1
                self._idle[rid] = idle
                if idle % self.probe_every == 0:
                    best_k = 1  # probe, so a recovering request is noticed
            else:
                self._idle[rid] = 0
            plan[rid] = best_k
            total += best_k
            gain += sum(a ** i for i in range(1, best_k + 1))
        return plan
