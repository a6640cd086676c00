"""How many tokens each request drafts, from what the engine measures (the default when speculating).

Two things decide whether drafts pay. One is the request: with per-draft acceptance a, k drafts emit
1 + a + ... + a^k tokens per step, so a draft position whose chance a^k is below `min_gain` is never
worth its fixed costs; a request's a is a decayed average of its own verifications, starting at
`prior`. The other is the step: what a verification of 1 + k tokens per request costs, against a plain
decode, depends on the batch size, the model, the attention path and the machine, and does not follow
a formula (on CPU, a verified sequence leaves the batched decode kernel for the prefill path). So the
step is measured, not modelled:

    per batch-size bucket (1, 2, 4, 8, ... sampling requests) and depth K = 0 .. k_max:
        rate[bucket][K] = decayed mean of tokens emitted / seconds, over decode-only steps at depth K
                          (seconds = the verifying step + the proposer's time for its drafts)

Each step takes the K with the best rate for its bucket (a bandit that first tries K = 0, 1 and k_max, and
the depths between where drafts pay, then plays the best with an occasional neighbour to track drift), and
each request drafts min(K, its useful depth).
When the batch is compute-bound, or drafts keep failing, the best K is 0 and speculation stops; a
request at depth 0 probes with one draft every `probe_every` steps, so its estimate can recover.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


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


def bucket_of(batch: int) -> int:
    return 1 << (max(1, batch).bit_length() - 1)


class DepthBandit:
    """Decayed tokens-per-second of each depth, per batch-size bucket. Depths 0, 1 and k_max are tried
    `min_trials` times first; only if 1 or k_max beats 0 are the depths between tried too. Then the best is
    played, with a neighbour now and then to track drift. Where speculation does not pay, that costs a few
    steps at two depths per bucket; where one draft does not pay for a verification's fixed cost but
    k_max drafts do (n-gram drafts on a small model), k_max is still found, where a climb from 0 stopped."""

    def __init__(self, k_max: int, min_trials: int = 3, explore_every: int = 32, decay: float = 0.9,
                 margin: float = 1.05, hopeless: float = 2.0, max_explore_every: int = 2048, seed: int = 0):
        self.k_max, self.min_trials, self.explore_every, self.decay = k_max, min_trials, explore_every, decay
        self.margin = margin  # a challenger must beat the incumbent depth by this factor: single steps are noisy
        # a depth at under 1/hopeless of another's rate is settled by one try (one that paid no switch), and looking at it again waits
        # twice as long each time it is still that far behind (up to max_explore_every steps of its bucket):
        # a verification step that falls off the fast decode path costs several plain steps, and probing
        # from depth 0 costs a draft model its catch-up, so hopeless looks are what a loaded server pays for
        self.hopeless, self.max_explore_every = hopeless, max_explore_every
        self._first = sorted({0, min(1, k_max), k_max})  # the depths every bucket tries first
        self._rate: dict[tuple[int, int], float] = {}
        self._trials: dict[tuple[int, int], int] = {}
        self._best: dict[int, int] = {}
        self._choices: dict[int, int] = {}  # per bucket
        self._next_look: dict[int, int] = {}  # bucket -> its choice count at which to look at a neighbour
        self._look_every: dict[int, int] = {}
        self._pending: dict[int, tuple[int, int]] = {}  # bucket -> (depth, choice count) of a first try in flight
        self._looking: dict[int, int] = {}  # bucket -> the depth of a look in flight
        self._clean: set[tuple[int, int]] = set()  # (bucket, depth)s with a try that paid no switch
        self._rng = random.Random(seed)

    def _far_behind(self, bucket: int, k: int, than: int) -> bool:
        r, other = self._rate.get((bucket, k)), self._rate.get((bucket, than))
        return r is not None and other is not None and r * self.hopeless < other

    def _tried(self, bucket: int, k: int) -> bool:
        n = self._trials.get((bucket, k), 0)
        if n >= self.min_trials:
            return True
        return (n >= 1 and k > 0 and (bucket, k) in self._clean and self._tried(bucket, 0)
                and self._far_behind(bucket, k, 0))

    def _beyond_reach(self, bucket: int, k: int, acceptance: float | None) -> bool:
        """Whether depth k cannot beat depth 0, judged from depth 1: a step's cost does not fall as k grows, and
        with per-draft acceptance a the tokens per step grow from 1 + a to 1 + a + ... + a^k, so k's rate is at
        most rate(1) times that ratio. Trying k then only costs steps (a draft model that loses at one draft
        and is accepted 40 % of the time has no deeper depth that wins)."""
        if acceptance is None or not (self._tried(bucket, 0) and self._tried(bucket, 1)):
            return False
        gain = sum(acceptance ** i for i in range(k + 1)) / (1 + acceptance)
        return self._rate[(bucket, 1)] * gain < self._rate[(bucket, 0)]

    def choose(self, bucket: int, acceptance: float | None = None) -> int:
        """`acceptance`: the measured per-draft acceptance so far (None until there is enough of it)."""
        count = self._choices[bucket] = self._choices.get(bucket, 0) + 1
        pending = self._pending.get(bucket)
        if pending is not None and count - pending[1] <= 3:
            return 0  # a first try of drafts is still to be credited (a step later): wait for its result
        for k in self._first:
            if not self._tried(bucket, k) and not self._beyond_reach(bucket, k, acceptance):
                if k > 0:
                    self._pending[bucket] = (k, count)
                return k

        def rate(k: int) -> float:
            return self._rate[(bucket, k)]

        first = [k for k in self._first if self._tried(bucket, k)]
        if max(rate(k) for k in first) > self.margin * rate(0):  # drafts pay somewhere: look between too
            for k in range(self.k_max + 1):
                if not self._tried(bucket, k):
                    return k
        tried = [k for k in range(self.k_max + 1) if self._tried(bucket, k)]
        best = self._best.get(bucket, 0)
        challenger = max(tried, key=rate)
        if rate(challenger) > self.margin * rate(best):
            best = self._best[bucket] = challenger
        # track drift: look at a neighbour now and then; from depth 0 less often, since leaving it costs a
        # draft model the catch-up over every token since it last ran
        if count < self._next_look.setdefault(bucket, count - 1 + self._base_look_every(best)):
            return best
        steps = [d for d in (-1, 1) if 0 <= best + d <= self.k_max]
        look = best + self._rng.choice(steps) if steps else best
        self._looking[bucket] = look
        self._next_look[bucket] = count + self._look_every.get(bucket, self._base_look_every(best))  # until it lands
        return look

    def _base_look_every(self, best: int) -> int:
        return self.explore_every * (4 if best == 0 else 1)

    def _landed_look(self, bucket: int, k: int, rate: float) -> None:
        """A look's result replaces its depth's estimate (which may be thousands of steps old) and sets when to
        look next: twice as late while the depth stays far behind, back to the base interval otherwise."""
        del self._looking[bucket]
        self._rate[(bucket, k)] = rate
        self._trials[(bucket, k)] = self._trials.get((bucket, k), 0) + 1
        best = self._best.get(bucket, 0)
        base = self._base_look_every(best)
        every = self._look_every.get(bucket, base)
        every = min(2 * every, self.max_explore_every) if self._far_behind(bucket, k, best) else base
        self._look_every[bucket], self._next_look[bucket] = every, self._choices.get(bucket, 0) + every

    def lost(self, bucket: int, k: int) -> None:
        """A step at depth k that teaches nothing (it carried prefill chunks): a first try or a look that it
        was is not waited for; the try comes again, the look at its next time."""
        if self._pending.get(bucket, (None,))[0] == k:
            del self._pending[bucket]
        if self._looking.get(bucket) == k:
            del self._looking[bucket]

    def observe(self, bucket: int, k: int, tokens: int, seconds: float, switch_seconds: float = 0.0) -> None:
        """`switch_seconds`: the part of `seconds` that switched a draft model back on after depth 0 (its
        catch-up over every token since it last ran). It is charged (a bandit that leaves 0 for a depth that
        is no better pays it again each time: leaving it out made the shipped pair flap between 0 and 1 at 16
        requests, 0.8x of off), but a try that paid it does not settle a depth as hopeless on its own."""
        if seconds <= 0:
            return
        key, rate = (bucket, k), tokens / seconds
        first_clean = switch_seconds <= 0 and key not in self._clean
        if switch_seconds <= 0:
            self._clean.add(key)
        if self._pending.get(bucket, (None,))[0] == k:
            del self._pending[bucket]
        if self._looking.get(bucket) == k:
            return self._landed_look(bucket, k, rate)
        n = self._trials.get(key, 0)
        # the first try without a switch replaces an estimate made only of tries with one (which would
        # otherwise weigh most in the decayed mean and keep a depth that pays looking as if it did not)
        fresh = n == 0 or first_clean
        self._rate[key] = rate if fresh else self.decay * self._rate[key] + (1 - self.decay) * rate
        self._trials[key] = n + 1

    def rate(self, bucket: int, k: int) -> float | None:
        return self._rate.get((bucket, k))


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, prior: float = 0.6, decay: float = 0.8,
                 probe_every: int = 16, min_gain: float = 0.1, min_acceptance_drafts: int = 8):
        self.k_max, self.adaptive = k_max, adaptive
        self.prior, self.decay, self.probe_every, self.min_gain = prior, decay, probe_every, min_gain
        self.min_acceptance_drafts = min_acceptance_drafts  # verified drafts before their acceptance bounds depths
        self.bandit = DepthBandit(k_max)
        self.stats = SpecStats(accepted_per_pos=[0] * k_max)
        self._acc: dict[str, list[float]] = {}  # request -> [decayed accepted, decayed trials]
        self._judged = [0, 0]  # all requests: drafts accepted, drafts judged (accepted or the rejection)
        self._idle: dict[str, int] = {}  # request -> steps planned at depth 0 in a row
        # (bucket, K) planned last step: the drafts this step verifies. The step that plans K does not
        # run those drafts yet, so crediting it to K would blur the depths.
        self._verifying: tuple[int, int] | None = None
        self._planned: tuple[int, int] | None = None  # (bucket, K) planned this step
        self._propose_s = 0.0  # the proposer's time for the drafts this step verifies
        self._switch_s = 0.0  # the part of it that switched drafts back on after depth 0
        self._carried_s = 0.0  # proposing charged to steps with prefill, owed by the next nonzero depth
        self._last_step: tuple | None = None  # (emitted, decode_only, propose_s, started, ended, switch_s): credited at the next start

    # -- per request --------------------------------------------------------------------------------------
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
        self._judged[0] += accepted
        self._judged[1] += trials
        acc[0] = self.decay * acc[0] + accepted
        acc[1] = self.decay * acc[1] + trials

    def release(self, rid: str) -> None:
        self._acc.pop(rid, None)
        self._idle.pop(rid, None)

    def _useful_depth(self, rid: str, cap: int) -> int:
        a, k = self.acceptance(rid), 0
        while k < cap and a ** (k + 1) >= self.min_gain:
            k += 1
        if k == 0 and cap > 0:
            idle = self._idle.get(rid, 0) + 1
            self._idle[rid] = idle
            if idle % self.probe_every == 0:
                return 1  # probe, so a recovering request is noticed
        else:
            self._idle[rid] = 0
        return k

    # -- per step -----------------------------------------------------------------------------------------
    def plan(self, rids: list[str]) -> dict[str, int]:
        """Drafts to propose for each request that samples this step."""
        if not rids:
            return {}
        if not self.adaptive:
            return {rid: self.k_max for rid in rids}
        bucket = bucket_of(len(rids))
        # per-draft acceptance a: drafts after the first rejection were never judged, so accepted / drafted
        # (the reported acceptance rate) understates a, and with it how far deeper depths could reach
        accepted, judged = self._judged
        acceptance = accepted / judged if judged >= self.min_acceptance_drafts else None
        depth = self.bandit.choose(bucket, acceptance)
        self._verifying, self._planned = self._planned, (bucket, depth)
        if depth == 0:
            return {}  # no request drafts (a request's own probes only happen below a nonzero depth)
        return {rid: self._useful_depth(rid, depth) for rid in rids}

    # The engine reports each step's whole cycle: from its start to the next step's start, which takes in
    # scheduling, output handling and the caller's per-step work as well as the forward. Those are part of
    # what a verification of k drafts saves or costs per token; the forward's time alone left them out, and
    # the bandit then favoured depths that lost end to end.
    def step_started(self, now: float) -> None:
        last, self._last_step = self._last_step, None
        if last is None:
            return
        emitted, decode_only, propose_s, started, ended, switch_s = last
        busy = ended - started
        cycle = now - started if now - ended <= busy else busy  # a gap longer than the step is idle time
        self.observe_step(emitted, cycle - propose_s, decode_only, propose_s, switch_s)

    def step_ran(self, emitted: int, decode_only: bool, propose_seconds: float, started: float,
                 ended: float, switch_seconds: float = 0.0) -> None:
        """A step that ran from `started` to `ended` (its outputs handed back): credited at the next start.
        `switch_seconds`: the part of the proposing spent catching a draft model up over long stale runs;
        right after a step at depth 0 that is the cost of switching drafts back on (see DepthBandit)."""
        switch = switch_seconds if self._verifying is None or self._verifying[1] == 0 else 0.0
        self._last_step = (emitted, decode_only, propose_seconds, started, ended, switch)

    def observe_step(self, emitted: int, seconds: float, decode_only: bool, propose_seconds: float,
                     switch_seconds: float = 0.0) -> None:
        """One step ran: `emitted` tokens in `seconds` (its own proposing excluded, which belongs to the
        drafts it verifies next). Only decode-only steps teach the bandit: prefill chunks blur the rate. The
        proposing charged to a step with prefill is not dropped with it but carried to the next step the
        bandit learns from at a nonzero depth: it holds the draft model's run over each newly admitted
        prompt, a cost of drafting that only steps with prefill see (left out, the shipped pair at 16
        requests measured depth 1 as 8 % faster per step than no drafts, and ran 0.86x end to end)."""
        if self._verifying is not None:
            bucket, depth = self._verifying
            if decode_only:
                carried = self._carried_s if depth else 0.0
                self.bandit.observe(bucket, depth, emitted, seconds + self._propose_s + carried, self._switch_s)
                if depth:
                    self._carried_s = 0.0
            else:
                self.bandit.lost(bucket, depth)
                self._carried_s += self._propose_s
        self._propose_s, self._switch_s = propose_seconds, switch_seconds
