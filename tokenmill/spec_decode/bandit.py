"""The depth bandit of adaptive speculation: the number of drafts per request that gives the most tokens per
second of engine time, per batch-size bucket, from measured steps (spec_decode/adaptive.py feeds it)."""
from __future__ import annotations

import math


class DepthBandit:
    """Tokens per second of each depth, per batch-size bucket: decayed sums of tokens over decayed sums of
    seconds (a mean of per-step rates would let one slow step, a switch or a catch-up, count as little as a
    fast one, and a decayed mean seeded with the first step weighs that cold step for dozens more). Depths
    0, 1 and k_max are tried `min_trials` times first; only if 1 or k_max beats 0 are the depths between
    tried too. Then the best is played, with a look at a neighbour now and then to track drift. Where
    speculation does not pay, that costs a few steps at two depths per bucket; where one draft does not pay
    for a verification's fixed cost but k_max drafts do (n-gram drafts on a small model), k_max is still
    found, where a climb from 0 stopped."""

    def __init__(self, k_max: int, min_trials: int = 3, explore_every: int = 32, decay: float = 0.9,
                 margin: float = 1.05, leave_margin: float = 1.15, hopeless: float = 2.0,
                 max_explore_every: int = 2048, look_budget: float = 0.01, z: float = 1.5):
        self.k_max, self.min_trials, self.explore_every, self.decay = k_max, min_trials, explore_every, decay
        self.margin = margin  # a challenger must beat the incumbent depth by this factor: single steps are noisy
        # and to leave no drafts for drafts, by this one: leaving costs what a rate does not show (a draft model's
        # catch-up, requests that no longer finish together), and near break-even the rates are mostly noise
        # (the shipped pair on a 2-core CPU: 1.0-1.03x at one request, where a 5 % margin drafted and lost)
        self.leave_margin = leave_margin
        # and by this many standard errors of the difference in seconds per token, from the steps' own spread:
        # on a noisy machine a few lucky steps beat a fixed margin (the shipped pair, break-even on a 2-core
        # Zen 3, was played at depths that lost)
        self.z = z
        # a depth at under 1/hopeless of another's rate is settled by one try (one that paid no switch); looking
        # at a depth again waits twice as long each time it still loses to the best by the margin (up to
        # max_explore_every steps of its bucket): a verification step that falls off the fast decode path
        # costs several plain steps, so losing looks are what a loaded server pays for
        self.hopeless, self.max_explore_every = hopeless, max_explore_every
        # looks are spaced so that what they cost beyond the best depth's steps stays within this share of
        # the bucket's time (a look that costs three steps waits >= 300 steps at 1 %)
        self.look_budget = look_budget
        self.exploring = False  # whether the last choice was a first try or a look (not the best depth)
        self._first = sorted({0, min(1, k_max), k_max})  # the depths every bucket tries first
        # (bucket, depth) -> decayed [tokens, seconds, seconds^2 / tokens, tokens^2]: the rate, and the spread of
        # the steps' seconds per token around it (weighted by tokens) with its effective number of steps
        self._sums: dict[tuple[int, int], list[float]] = {}
        # seconds per token that every step at a depth also costs outside its decode steps, by (bucket, depth):
        # set by the owner (DraftPolicy: what admitting prompts costs at that depth); none by default
        self.surcharge = lambda bucket, k: 0.0
        self._trials: dict[tuple[int, int], int] = {}
        self._best: dict[int, int] = {}
        self._choices: dict[int, int] = {}  # per bucket
        # (bucket, depth) -> the bucket's choice count at which to look at that depth, and the interval
        self._next_look: dict[tuple[int, int], int] = {}
        self._look_every: dict[tuple[int, int], int] = {}
        self._pending: dict[int, tuple[int, int]] = {}  # bucket -> (depth, choice count) of a first try in flight
        self._looking: dict[int, int] = {}  # bucket -> the depth of a look in flight
        self._clean: set[tuple[int, int]] = set()  # (bucket, depth)s with a try that paid no switch
        self._priced: set[tuple[int, int]] = set()  # (bucket, depth)s whose last observation was priced
        # bucket -> choice count until which its best depth is played without weighing the rates again (every
        # step of a small model pays for this choice: the full comparison took ~50 us)
        self._settled_until: dict[int, int] = {}
        # bucket -> (a depth that beat 0 once, its trials then): looked at again before the bandit leaves 0
        self._confirming: dict[int, tuple[int, int]] = {}

    def _behind(self, bucket: int, k: int, than: int, factor: float) -> bool:
        """Whether depth k's rate times `factor` is still under depth `than`'s (both seen)."""
        r, other = self.rate(bucket, k), self.rate(bucket, than)
        return r is not None and other is not None and r * factor < other

    def _tried(self, bucket: int, k: int) -> bool:
        """Tried `min_trials` times, or once without a switch and found far behind depth 0 (or behind it at
        all, for a priced try, whose tokens are an expectation rather than one step's luck): more tries of a
        losing depth only cost steps (on CPU a verification off the one-call decode step costs several plain
        ones); the looks come back to it."""
        n = self._trials.get((bucket, k), 0)
        if n >= self.min_trials:
            return True
        if n < 1 or k == 0 or (bucket, k) not in self._clean or not self._tried(bucket, 0):
            return False
        if (bucket, k) in self._priced:
            r, r0 = self.rate(bucket, k), self.rate(bucket, 0)
            return r is not None and r0 is not None and r < r0
        return self._behind(bucket, k, 0, self.hopeless)

    def _beyond_reach(self, bucket: int, k: int, acceptance: float | None) -> bool:
        """Whether depth k cannot beat depth 0, judged from depth 1: a step's cost does not fall as k grows, and
        with per-draft acceptance a the tokens per step grow from 1 + a to 1 + a + ... + a^k, so k's rate is at
        most rate(1) times that ratio. Trying k then only costs steps (a draft model that loses at one draft
        and is accepted 40 % of the time has no deeper depth that wins)."""
        if acceptance is None or not (self._tried(bucket, 0) and self._tried(bucket, 1)):
            return False
        gain = expected_tokens(acceptance, k) / (1 + acceptance)
        return self.rate(bucket, 1) * gain < self.rate(bucket, 0)

    def choose(self, bucket: int, acceptance: float | None = None) -> int:
        """`acceptance`: the measured per-draft acceptance so far (None until there is enough of it)."""
        count = self._choices[bucket] = self._choices.get(bucket, 0) + 1
        self.exploring = False
        if count < self._settled_until.get(bucket, 0):
            return self._best.get(bucket, 0)
        pending = self._pending.get(bucket)
        if pending is not None and count - pending[1] <= 3:
            return 0  # a first try of drafts is still to be credited (a step later): wait for its result
        self.exploring = True
        for k in self._first:
            if not self._tried(bucket, k) and not self._beyond_reach(bucket, k, acceptance):
                if k > 0:
                    self._pending[bucket] = (k, count)
                return k

        def rate(k: int) -> float:
            return self.rate(bucket, k)

        first = [k for k in self._first if self._tried(bucket, k)]
        if max(rate(k) for k in first) > self.margin * rate(0):  # drafts pay somewhere: look between too
            for k in range(self.k_max + 1):
                if not self._tried(bucket, k):
                    return k
        tried = [k for k in range(self.k_max + 1) if self._tried(bucket, k)]
        best = self._best.get(bucket, 0)
        challenger = max(tried, key=rate)
        if challenger != best and self._clearly_better(bucket, challenger, best):
            trials = self._trials.get((bucket, challenger), 0)
            seen = self._confirming.get(bucket)
            if best == 0 and (seen is None or seen[0] != challenger):
                # leaving no drafts on one look's word: a look at a normal moment against a depth-0 rate from a
                # slow stretch (a 10-step memory) won now and then, and the shipped pair at one request then
                # drafted for minutes at 0.75-0.84x of no drafts. Look again first; leave if it still wins
                self._confirming[bucket] = (challenger, trials)
                self._looking[bucket] = challenger
                return challenger
            if best == 0 and trials == seen[1]:
                # the second look is still in flight (an engine credits a step after the next one is planned)
                self.exploring = False
                return best
            self._confirming.pop(bucket, None)
            best = self._best[bucket] = challenger
        else:
            self._confirming.pop(bucket, None)
        if best and self._clearly_better(bucket, 0, best):
            # no drafts beats the depth played, weighed on its own: the top rate may be a neighbour's few noisy
            # steps that never clear the test, which held the shipped pair at depth 2 for whole runs (0.77x)
            best = self._best[bucket] = 0
        # track drift: look now and then at the depths next to the best one, and at 0 (seen only in its first
        # tries, it could never win back from a depth that won its own first steps by luck: the shipped pair at
        # one request sat at depth 3 for whole runs, 0.73-0.84x of no drafts); from 0, at the depths first tried
        # (one draft may not pay for a verification where k_max do). Each depth has its own schedule
        if best == 0:
            candidates = [k for k in self._first if k and not self._beyond_reach(bucket, k, acceptance)] or [1]
        else:
            candidates = sorted({0} | {best + d for d in (-1, 1) if 0 <= best + d <= self.k_max})
        due = {k: self._next_look.setdefault((bucket, k), count - 1 + self.explore_every) for k in candidates}
        look = min(candidates, key=lambda k: due[k])
        if count < due[look]:
            self.exploring = False
            self._settled_until[bucket] = min(count + self.REWEIGH_EVERY, due[look])
            return best
        self._looking[bucket] = look
        every = self._look_every.get((bucket, look), self.explore_every)
        self._next_look[(bucket, look)] = count + every  # until it lands
        return look

    REWEIGH_EVERY = 16  # choices between two comparisons of the rates while nothing new is tried

    def best(self, bucket: int) -> int:
        return self._best.get(bucket, 0)

    def _landed_look(self, bucket: int, k: int, tokens: float, seconds: float, step: tuple[int, float]) -> None:
        """A look's result replaces its depth's estimate (which may be thousands of steps old) and sets when to
        look next: twice as late while the depth keeps losing to the best one by more than the margin (depth 0:
        while under half its rate), back to the base interval otherwise, and never sooner than the look budget
        allows for what this look cost beyond a step at the best depth. (Spaced by the budget alone, priced
        looks at one draft from no drafts, at half no drafts' rate, cost the shipped pair 0.75 % of every run at
        16 requests.)"""
        del self._looking[bucket]
        sums = self._sums.get((bucket, k))
        if k == 0 and sums is not None:
            # no drafts has no state to go stale (no draft model behind), and a best depth is held against
            # it: one lucky look must not decide that, so looks at 0 add to its estimate
            for i, x in enumerate(_fresh(tokens, seconds)):
                sums[i] = self.decay * sums[i] + x
        else:
            self._sums[(bucket, k)] = _fresh(tokens, seconds)
        self._trials[(bucket, k)] = self._trials.get((bucket, k), 0) + 1
        best, base = self._best.get(bucket, 0), self.explore_every
        every = self._look_every.get((bucket, k), base)
        # looks at 0 back off only from a hopeless depth 0: it is the fallback, and its estimate is what goes
        # stale when the machine's speed moves (rounds at 4 requests that drafted at 0.67-0.78x of no drafts
        # for minutes, depth 0 seen last in a slow stretch and looked at once per 2048 steps)
        losing = self._behind(bucket, k, best, self.hopeless if k == 0 else self.margin)
        every = min(2 * every, self.max_explore_every) if losing else base
        best_rate = self.rate(bucket, best, with_surcharge=False)
        real_tokens, real_seconds = step
        if best_rate and real_tokens > 0 and k != best:
            best_step = real_tokens / best_rate  # what the same tokens take at the best depth
            every = max(every, math.ceil((real_seconds - best_step) / (self.look_budget * best_step)))
        self._look_every[(bucket, k)], self._next_look[(bucket, k)] = every, self._choices.get(bucket, 0) + every

    def lost(self, bucket: int, k: int) -> None:
        """A step at depth k that teaches nothing (it carried prefill chunks): a first try or a look that it
        was is not waited for; the try comes again, the look at its next time."""
        if self._pending.get(bucket, (None,))[0] == k:
            del self._pending[bucket]
        if self._looking.get(bucket) == k:
            del self._looking[bucket]
            if self._confirming.get(bucket, (None,))[0] == k:
                del self._confirming[bucket]  # a lost confirmation: the next win starts it again

    def observe(self, bucket: int, k: int, tokens: float, seconds: float, switch_seconds: float = 0.0,
                step: tuple[int, float] | None = None) -> None:
        """`switch_seconds`: the part of `seconds` that switched a draft model back on after depth 0 (its
        catch-up over every token since it last ran). It is charged (a bandit that leaves 0 for a depth that
        is no better pays it again each time: leaving it out made the shipped pair flap between 0 and 1 at 16
        requests, 0.8x of off), but a try that paid it does not settle a depth as hopeless on its own.
        `step`: the tokens the step really emitted and the seconds it really took, where `tokens` and
        `seconds` are a priced estimate instead (DraftPolicy's placeholder looks); what a look cost is
        judged from those."""
        if seconds <= 0:
            return
        key = (bucket, k)
        if step is None:
            self._priced.discard(key)
        else:
            self._priced.add(key)
        if k != self._best.get(bucket, 0):
            self._settled_until.pop(bucket, None)  # news about another depth: weigh the rates at the next choice
        first_clean = switch_seconds <= 0 and key not in self._clean
        if switch_seconds <= 0:
            self._clean.add(key)
        if self._pending.get(bucket, (None,))[0] == k:
            del self._pending[bucket]
        if self._looking.get(bucket) == k:
            return self._landed_look(bucket, k, tokens, seconds, step or (tokens, seconds))
        n = self._trials.get(key, 0)
        # the first try without a switch replaces an estimate made only of tries with one (a depth that pays
        # would otherwise look, for a while, as if it did not)
        sums = self._sums.get(key)
        if n == 0 or first_clean or sums is None:
            self._sums[key] = _fresh(tokens, seconds)
        else:
            for i, x in enumerate(_fresh(tokens, seconds)):
                sums[i] = self.decay * sums[i] + x
        self._trials[key] = n + 1

    def _clearly_better(self, bucket: int, k: int, than: int) -> bool:
        """k's rate beats `than`'s by the margin (the larger one to leave no drafts) and by `z` standard
        errors of the difference in seconds per token. A depth seen in one step only borrows the other's
        spread (relative to its seconds per token)."""
        rk, rt = self.rate(bucket, k), self.rate(bucket, than)
        if rk <= (self.leave_margin if than == 0 else self.margin) * rt:
            return False
        spread = [self._spread(bucket, d) for d in (k, than)]
        cv = max((c for c, _ in spread if c is not None), default=0.0)
        se2 = sum((cv / r) ** 2 / n for r, (_, n) in zip((rk, rt), spread))  # per-token seconds ~ 1 / rate
        return 1.0 / rt - 1.0 / rk > self.z * math.sqrt(se2)

    def _spread(self, bucket: int, k: int) -> tuple[float | None, float]:
        """(coefficient of variation of a step's seconds per token, or None from one step; effective steps)."""
        tokens, seconds, sq, t2 = self._sums[(bucket, k)]
        n = tokens * tokens / t2 if t2 > 0 else 1.0
        if n < 1.5 or tokens <= 0 or seconds <= 0:
            return None, max(n, 1.0)
        mean = seconds / tokens
        return math.sqrt(max(0.0, sq / tokens - mean * mean)) / mean, n

    def rate(self, bucket: int, k: int, with_surcharge: bool = True) -> float | None:
        """Tokens per second at depth k: its decode steps, plus the owner's surcharge per token."""
        sums = self._sums.get((bucket, k))
        if sums is None:
            return None
        per_token = sums[1] / sums[0] if sums[0] > 0 else math.inf
        return 1.0 / (per_token + (self.surcharge(bucket, k) if with_surcharge else 0.0))


def _fresh(tokens: float, seconds: float) -> list[float]:
    """One step's contribution to a depth's decayed sums (DepthBandit._sums)."""
    return [tokens, seconds, seconds * seconds / tokens if tokens > 0 else 0.0, tokens * tokens]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of k drafts emits on average, each draft accepted with probability
    `acceptance` until the first rejection: 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))
