"""How many tokens each request drafts, from what the engine measures (the default when speculating).

Two things decide whether drafts pay. One is the request: with per-draft acceptance a, k drafts emit
1 + a + ... + a^k tokens per step, so a draft position whose chance a^k is below `min_gain` is never
worth its fixed costs; a request's a is a decayed average of its own verifications, starting at
`prior`. The other is the step: what a verification of 1 + k tokens per request costs, against a plain
decode, depends on the batch size, the model, the attention path and the machine, and does not follow
a formula (on CPU, a verified sequence leaves the batched decode kernel for the prefill path). So the
step is measured, not modelled:

    per batch-size bucket (1, 2, 4, 8, ... sampling requests) and depth K = 0 .. k_max:
        rate[bucket][K] = decayed tokens emitted / decayed seconds, over decode-only steps at depth K
                          (seconds = the verifying step's whole cycle + the proposer's time for its drafts),
                          plus what admitting prompts costs per emitted token at K (steps with prefill)

Each step takes the K with the best rate for its bucket (bandit.py: first tries of K = 0, 1 and k_max, and
the depths between where drafts pay, then the best with looks at its neighbours to track drift; with a
draft model, looks away from K = 0 are priced with placeholder drafts), and each request drafts
min(K, its useful depth).
When the batch is compute-bound, or drafts keep failing, the best K is 0 and speculation stops; a
request at depth 0 probes with one draft every `probe_every` steps, so its estimate can recover.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.spec_decode.bandit import DepthBandit, expected_tokens


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


POSITION_DECAY = 0.995  # per verification: the per-position acceptance follows a workload over ~200 of them
PRIOR_PREFILL_TOKENS = 1000  # the weight, in prompt tokens, of the prior on what admitting costs while drafting


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, prior: float = 0.6, decay: float = 0.8,
                 probe_every: int = 16, min_gain: float = 0.1, min_acceptance_drafts: int = 8,
                 price_looks: bool = False, model_proposer: bool | None = None, per_request: bool = False):
        self.k_max, self.adaptive = k_max, adaptive
        # price_looks: a proposer whose first drafts after depth 0 cost a catch-up (a draft model) explores
        # with placeholder drafts instead (see plan)
        self.price_looks = price_looks
        # whether the proposer is a model that runs over every admitted prompt too (a draft model), so that
        # admitting costs more while drafting; n-gram lookup adds nothing to an admission
        self.model_proposer = price_looks if model_proposer is None else model_proposer
        # per_request: each request's depth from its own acceptance and the measured cost of a draft row
        # (RowCost), no shared depth; for proposers whose drafts cost nothing to make (n-gram)
        self.per_request = per_request
        self.row_cost: dict[int, RowCost] = {}  # bucket -> step seconds as a line in the draft rows verified
        self._rows_now = 0  # draft rows verified by the step being finished (record / record_placeholder)
        # the most rows a step keeps on its fast path (the CPU's one-call decode step; None: no such edge). Past
        # it a step goes op by op, 2.5x a plain step's time at one request: a cliff, not a slope RowCost fits
        self.max_rows: int | None = None
        self.placeholders = False  # whether the last plan's drafts are placeholders, made by the scheduler
        self.prior, self.decay, self.probe_every, self.min_gain = prior, decay, probe_every, min_gain
        self.min_acceptance_drafts = min_acceptance_drafts  # verified drafts before their acceptance bounds depths
        self.bandit = DepthBandit(k_max)
        self.stats = SpecStats(accepted_per_pos=[0] * k_max)
        self._acc: dict[str, list[float]] = {}  # request -> [decayed accepted, decayed trials]
        self._judged = [0, 0]  # all requests: drafts accepted, drafts judged (accepted or the rejection)
        # all requests, per draft position i: decayed [accepted, judged] of drafts judged there (every draft
        # before it accepted): the chance a run goes on past i, which copying makes far higher than a
        self._at_pos = [[0.0, 0.0] for _ in range(k_max)]
        self._idle: dict[str, int] = {}  # request -> steps planned at depth 0 in a row
        self._plans = 0  # plans made: probes fall on every probe_every-th (_with_probe)
        # (bucket, K) planned last step: the drafts this step verifies. The step that plans K does not
        # run those drafts yet, so crediting it to K would blur the depths.
        self._verifying: tuple[int, int, bool] | None = None
        self._planned: tuple[int, int, bool] | None = None  # (bucket, K, priced) planned this step
        self._draft_cost: dict[int, float] = {}  # bucket -> decayed seconds of one batched draft position
        # bucket -> decayed seconds per step of a burst (decode steps run N at a time where no request drafts):
        # what drafting forgoes, since a step that verifies drafts is a single step
        self._burst_step_s: dict[int, float] = {}
        self._priced: dict[tuple[int, int], float] = {}  # (bucket, K) -> its last priced rate, unbiased
        self._bias: dict[int, float] = {}  # bucket -> decayed real rate / priced rate, where both were seen
        self._placeholder_tokens = [0, 0.0]  # this step's placeholder verifications: tokens emitted, priced
        # the proposing that made the drafts this step verifies, split three ways: all of it, the part that
        # switched a draft model back on after depth 0, and the part spent on newly admitted prompts
        self._propose_s = self._switch_s = self._admit_s = 0.0
        # admissions: what a prompt token's prefill adds to steps beyond their decoding, at depth 0 and while
        # drafting ([decayed prefill tokens, decayed seconds] each), and prefill tokens per emitted token
        self._admission = {False: [0.0, 0.0], True: [0.0, 0.0]}
        self._prefill_per_token = [0.0, 0.0]
        self.bandit.surcharge = self._admission_surcharge
        self._last_step: tuple | None = None  # credited at the next step's start (step_started)

    # -- per request --------------------------------------------------------------------------------------
    def acceptance(self, rid: str) -> float:
        num, den = self._acc.get(rid, (2 * self.prior, 2.0))
        return num / den

    def record(self, rid: str, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` drafts survived (the first rejection ends a run)."""
        self._rows_now += drafted
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        acc = self._acc.setdefault(rid, [2 * self.prior, 2.0])
        trials = accepted + (1 if accepted < drafted else 0)  # each acceptance, and the rejection if any
        for i, pos in enumerate(self._at_pos[:trials]):
            pos[0] = POSITION_DECAY * pos[0] + (i < accepted)
            pos[1] = POSITION_DECAY * pos[1] + 1
        self._judged[0] += accepted
        self._judged[1] += trials
        acc[0] = self.decay * acc[0] + accepted
        acc[1] = self.decay * acc[1] + trials

    def record_placeholder(self, drafted: int) -> None:
        """A verified step of placeholder drafts (the worker keeps only the target's own token, so the
        token stream is what a step without drafts makes): not in the metrics or acceptance. It is priced as
        the step the proposer's drafts would have made: the tokens they would emit on average."""
        self._rows_now += drafted
        a = self._per_draft_acceptance() or 0.0
        self._placeholder_tokens[0] += 1
        self._placeholder_tokens[1] += expected_tokens(a, drafted)

    def _per_draft_acceptance(self) -> float | None:
        # drafts after the first rejection were never judged, so accepted / drafted (the reported acceptance
        # rate) understates a, and with it how far deeper depths could reach
        accepted, judged = self._judged
        return accepted / judged if judged >= self.min_acceptance_drafts else None

    def release(self, rid: str) -> None:
        self._acc.pop(rid, None)
        self._idle.pop(rid, None)

    def _continues(self, i: int, a: float) -> float:
        """The chance a draft at position i >= 1 is accepted once every draft before it was: measured over all
        requests, or `a` (a geometric run) until enough drafts were judged there."""
        accepted, judged = self._at_pos[i]
        return accepted / judged if judged >= self.min_acceptance_drafts else a

    def _useful_depth(self, rid: str, cap: int) -> int:
        """Drafts while the chance that the last one is accepted stays >= min_gain: the request's own
        acceptance for the first, then the measured chance that a run goes on at each later position. A
        geometric a^k (every position like the first) cut copying runs short: n-gram drafts on quoted passages
        were accepted 0.33 of the time overall but 0.88-0.95 of the time once a run had started."""
        a, k = self.acceptance(rid), 0
        reach = a
        while k < cap and reach >= self.min_gain:
            k += 1
            if k < cap:
                reach *= self._continues(k, a)
        if cap == 0:
            self._idle[rid] = 0
            return 0
        return self._with_probe(rid, k)

    def _with_probe(self, rid: str, k: int) -> int:
        """k, or for a request planned at 0 drafts at least `probe_every` times in a row, one draft: a probe, so
        that a request whose drafts start landing again is noticed. Probes fall on every `probe_every`-th plan
        only, every idle request's together: a step that proposes or verifies is a single step where decoding
        would run bursts, and probes on each request's own count broke a burst every few steps (n-gram on free
        text: 4 requests, 0.93x of no speculation, the probes' single steps 16 % of the run)."""
        if k:
            self._idle[rid] = 0
            return k
        idle = self._idle[rid] = self._idle.get(rid, 0) + 1
        if idle < self.probe_every or self._plans % self.probe_every:
            return 0
        self._idle[rid] = 0
        return 1

    # -- per step -----------------------------------------------------------------------------------------
    def plan(self, rids: list[str]) -> dict[str, int]:
        """Drafts to propose for each request that samples this step.

        With `price_looks`, a first try or a look at depth K > 0 from depth 0 does not run the draft model,
        which would first have to catch up over every live request's context since it last ran (its prefill
        over them all: at 4-16 requests that made each look cost several steps). The scheduler gives each
        request K placeholder drafts instead (its last token repeated; verified losslessly like any draft),
        and the step is priced as the proposer's would have been:

            rate(K) ~ tokens the drafts would emit at the measured acceptance
                      / (the verifying step as measured + K x one batched draft forward at this bucket)

        corrected by what real steps at K later showed against their priced estimates. Only a depth that
        the price says wins is played with real drafts.
        """
        if not rids:
            return {}
        if not self.adaptive:
            return {rid: self.k_max for rid in rids}
        self._plans += 1
        bucket = bucket_of(len(rids))
        if self.per_request:
            return self._plan_per_request(bucket, rids)
        acceptance = self._per_draft_acceptance()
        depth = self.bandit.choose(bucket, acceptance)
        # from a bucket whose best is no drafts, the draft model is behind on these requests: price instead
        priced = (depth > 0 and self.price_looks and self.bandit.exploring and self.bandit.best(bucket) == 0
                  and acceptance is not None and self._draft_seconds(bucket) is not None)
        self.placeholders = priced
        self._verifying, self._planned = self._planned, (bucket, depth, priced)
        if depth == 0:
            return {}  # no request drafts (a request's own probes only happen below a nonzero depth)
        if priced:
            return {rid: depth for rid in rids}
        return {rid: self._useful_depth(rid, depth) for rid in rids}

    def _plan_per_request(self, bucket: int, rids: list[str]) -> dict[str, int]:
        """Drafts that raise the step's tokens per second: every candidate draft (request r's j-th, reached
        and accepted with chance p = a_r x the measured continuations before j) in descending p, each taken
        while p / c1 > tokens / seconds of the step so far (the step's base c0 plus c1 per draft row, measured
        at this bucket), and while the step's rows stay within `max_rows` (if it started there). A request
        follows its own regime: copying, its a rises and it drafts deep; in free text its drafts fail, a falls
        and it stops, with a probe of one draft every `probe_every` steps."""
        cost = self.row_cost.get(bucket)
        c0, c1 = cost.line() if cost is not None else (None, None)
        plan = dict.fromkeys(rids, 0)
        room = self.max_rows - len(rids) if self.max_rows and len(rids) <= self.max_rows else None
        if c0 is None:  # no decode-only step measured at this bucket yet: draft what acceptance says is useful
            for rid in rids:
                plan[rid] = self._useful_depth(rid, self.k_max if room is None else min(self.k_max, room))
                room = None if room is None else room - plan[rid]
        elif max(map(self.acceptance, rids)) * c0 > c1 * len(rids):  # else not even the likeliest draft pays
            # (and below min_gain a draft is never proposed, as in _useful_depth)
            candidates = []
            for rid in rids:
                a = self.acceptance(rid)
                reach = a
                for j in range(self.k_max):
                    candidates.append((reach, rid))
                    reach *= self._continues(j + 1, a) if j + 1 < self.k_max else 0.0
            candidates.sort(key=lambda c: -c[0])  # per request, reach falls with j: its drafts stay in order
            tokens, seconds = float(len(rids)), c0
            for p, rid in candidates[:len(candidates) if room is None else room]:
                if p < self.min_gain or p * seconds <= c1 * tokens:  # min_gain: a noisy c1 near 0 drafts nothing
                    break
                plan[rid] += 1
                tokens, seconds = tokens + p, seconds + c1
            burst = self._burst_step_s.get(bucket)
            if burst is not None and tokens * burst <= len(rids) * seconds:  # bursts without drafts emit faster
                plan = dict.fromkeys(rids, 0)
        if c0 is not None:
            for rid, k in plan.items():
                if self._with_probe(rid, k) > k and (room is None or sum(plan.values()) < room):
                    plan[rid] = 1
        depth = max(plan.values(), default=0)
        self.placeholders = False
        self._verifying, self._planned = self._planned, (bucket, depth, False)
        return {rid: k for rid, k in plan.items() if k}

    def _draft_seconds(self, bucket: int) -> float | None:
        """One batched draft forward at this bucket: measured there, or scaled from the nearest bucket that
        drafted by how a plain step's time grows between them."""
        if bucket in self._draft_cost:
            return self._draft_cost[bucket]
        rate = self.bandit.rate(bucket, 0)
        known = [b for b in self._draft_cost if self.bandit.rate(b, 0)]
        if not rate or not known:
            return None
        b = min(known, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
        return self._draft_cost[b] * (bucket / rate) / (b / self.bandit.rate(b, 0))

    # The engine reports each step's whole cycle: from its start to the next step's start, which takes in
    # scheduling, output handling and the caller's per-step work as well as the forward. Those are part of
    # what a verification of k drafts saves or costs per token; the forward's time alone left them out, and
    # the bandit then favoured depths that lost end to end.
    def step_started(self, now: float) -> None:
        last, self._last_step = self._last_step, None
        if last is None:
            return
        emitted, prefill_tokens, propose_s, started, ended, catch_up_s, rows, steps, forgone = last
        busy = ended - started
        cycle = now - started if now - ended <= busy else busy  # a gap longer than the step is idle time
        self.observe_step(emitted, cycle - propose_s, prefill_tokens, propose_s, catch_up_s, rows, steps, forgone)

    def step_ran(self, emitted: int, prefill_tokens: int, propose_seconds: float, started: float,
                 ended: float, catch_up_seconds: float = 0.0, steps: int = 1, burst_forgone: bool = False) -> None:
        """A step that ran from `started` to `ended` (its outputs handed back), with `prefill_tokens` prompt
        tokens (0: a decode-only step): credited at the next start. `catch_up_seconds`: the part of the
        proposing spent catching a draft model up over long stale runs. `steps` > 1: a burst of that many
        decode steps; `burst_forgone`: a single step only because it proposed drafts."""
        self._last_step = (emitted, prefill_tokens, propose_seconds, started, ended, catch_up_seconds, self._rows_now,
                           steps, burst_forgone)
        self._rows_now = 0

    def observe_step(self, emitted: int, seconds: float, prefill_tokens: int, propose_seconds: float,
                     catch_up_seconds: float = 0.0, draft_rows: int | None = None, steps: int = 1,
                     burst_forgone: bool = False) -> None:
        """One step ran: `emitted` tokens in `seconds` (its own proposing excluded: that belongs to the
        drafts it verifies next). Decode-only steps teach the bandit each depth's decode rate. Steps with
        prefill teach what admitting a prompt costs on top, at depth 0 and while drafting: the prefill
        beside verifications, and the draft model's own run over each new prompt (the long catch-up of the
        proposing that follows). That cost is charged per emitted token in proportion to how much prompt
        the workload brings per output token (`_admission_surcharge`). Left out, the shipped pair at 4-16
        requests measured one draft as 8-35 % faster per step than none, and ran 0.86-0.9x end to end."""
        verifying, drafting_before = self._verifying, self._was_drafting(self._verifying)
        drafted_now = self._was_drafting(self._planned)
        # this step's long catch-up: a switch when the draft model sat out the last plan, else new prompts
        switch_s = catch_up_seconds if drafted_now and not drafting_before else 0.0
        admit_s = catch_up_seconds - switch_s
        pf = self._prefill_per_token
        pf[0], pf[1] = 0.995 * pf[0] + prefill_tokens, 0.995 * pf[1] + emitted
        if verifying is not None:
            bucket, depth, priced = verifying
            total = seconds + self._propose_s - self._admit_s  # the verifying step and the drafting it verifies
            if prefill_tokens:
                self.bandit.lost(bucket, depth)
                if not priced:
                    self._learn_admission(bucket, depth, emitted, total + admit_s, prefill_tokens)
            elif priced:
                self._observe_priced(bucket, depth, emitted, seconds)
            else:
                if steps > 1:  # a burst: cheaper per step than a single one (RowCost fits single steps)
                    before = self._burst_step_s.get(bucket)
                    per_step = total / steps
                    self._burst_step_s[bucket] = per_step if before is None else 0.9 * before + 0.1 * per_step
                elif draft_rows is not None:
                    cost = self.row_cost.get(bucket)
                    if cost is None:
                        cost = self.row_cost[bucket] = RowCost(bucket)
                    cost.observe(draft_rows, total)
                if burst_forgone and not depth and bucket in self._burst_step_s:
                    # depth 0 bursts here; this step did not only because the next one drafts (a look away
                    # from 0, or the first tries alternating with it): counted as the single step it was, it
                    # made depth 0 look slower than it is, so it is charged a burst's step
                    total = min(total, self._burst_step_s[bucket])
                self.bandit.observe(bucket, depth, emitted, total, self._switch_s)
                if depth:
                    self._learn_prices(bucket, depth, emitted / total)
                if admit_s:
                    self._learn_admission(bucket, depth, 0, admit_s, 0)
        self._placeholder_tokens = [0, 0.0]
        self._propose_s, self._switch_s, self._admit_s = propose_seconds, switch_s, admit_s

    @staticmethod
    def _was_drafting(plan: tuple[int, int, bool] | None) -> bool:
        return plan is not None and plan[1] > 0 and not plan[2]

    def _learn_admission(self, bucket: int, depth: int, emitted: int, seconds: float, prefill_tokens: int) -> None:
        """A step with prefill at `depth`: its seconds beyond what its emitted tokens take in decode steps."""
        rate = self.bandit.rate(bucket, depth, with_surcharge=False)
        if emitted and not rate:
            return
        sums = self._admission[depth > 0]
        sums[0] = 0.9 * sums[0] + prefill_tokens
        sums[1] = 0.9 * sums[1] + max(0.0, seconds - (emitted / rate if emitted else 0.0))

    def _admission_surcharge(self, bucket: int, depth: int) -> float:
        """Seconds per emitted token that admissions add at this depth. A drafting depth is charged its own
        measurements pulled toward depth 0's cost, scaled up by the draft model's share of a step for a draft
        model (it prefills each prompt too). For n-gram drafts that prior is depth 0's cost itself: charged
        twice it, 7K-token documents per 256 new tokens priced drafting out though it was 2-4x faster per
        token."""
        tokens, emitted = self._prefill_per_token
        base, own = self._admission[False], self._admission[True]
        if emitted <= 0 or tokens <= 0:
            return 0.0
        if depth == 0:
            cost = base[1] / base[0] if base[0] > 0 else 0.0
        elif base[0] > 0:
            # drafting's own measurements, pulled toward the prior by PRIOR_PREFILL_TOKENS of pseudo-weight: a
            # prompt that hit the prefix cache prefills a few tokens while the draft model runs over all of it,
            # and one such sample must not price drafting out for good (only real drafting measures it again)
            plain_rate, draft_s = self.bandit.rate(bucket, 0, with_surcharge=False), self._draft_seconds(bucket)
            share = (draft_s * plain_rate / bucket if plain_rate and draft_s else 1.0) if self.model_proposer else 0.0
            prior = base[1] / base[0] * (1 + share)
            cost = (own[1] + prior * PRIOR_PREFILL_TOKENS) / (own[0] + PRIOR_PREFILL_TOKENS)
        else:  # depth 0 has not admitted a prompt yet: drafting is charged what it measured (0 stays the default)
            cost = own[1] / own[0] if own[0] > 0 else 0.0
        return cost * tokens / emitted

    def _observe_priced(self, bucket: int, depth: int, emitted: int, seconds: float) -> None:
        real, priced = self._placeholder_tokens
        draft_s = self._draft_seconds(bucket)
        if real == 0 or draft_s is None:
            return self.bandit.lost(bucket, depth)
        tokens, total = emitted - real + priced, seconds + depth * draft_s
        self._priced[(bucket, depth)] = tokens / total
        self.bandit.observe(bucket, depth, tokens * self._bias.get(bucket, 1.0), total, step=(emitted, seconds))

    def _learn_prices(self, bucket: int, depth: int, rate: float) -> None:
        """After a real step at `depth`: what one batched draft forward costs at this bucket, and how far the
        real rate is from the last priced one (ignoring steps that paid a switch, which pricing leaves out)."""
        drafting_s = self._propose_s - self._admit_s
        if self._switch_s > 0 or drafting_s <= 0:
            return
        per_draft = drafting_s / depth
        old = self._draft_cost.get(bucket)
        self._draft_cost[bucket] = per_draft if old is None else self.decay * old + (1 - self.decay) * per_draft
        est = self._priced.get((bucket, depth))
        if est:
            ratio = min(2.0, max(0.25, rate / est))
            old = self._bias.get(bucket)
            self._bias[bucket] = ratio if old is None else self.decay * old + (1 - self.decay) * ratio


class RowCost:
    """A decode-only step's seconds at one batch-size bucket as c0 + c1 x (draft rows it verified), fitted by
    decayed least squares over its steps. Until the rows have varied, c1 leans on a prior of c0 / (4 x
    bucket): a draft row costs a quarter of a request's share of the step (cheap at one request, where rows
    share one read of the weights and the context, dearer as the batch fills)."""

    PRIOR_WEIGHT = 4.0  # the prior's weight, in steps whose rows differ from the mean by one

    def __init__(self, bucket: int, decay: float = 0.98):
        self.bucket, self.decay = bucket, decay
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.n, self.x, self.y = d * self.n + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds

    def line(self) -> tuple[float | None, float | None]:
        if self.n < 1:
            return None, None
        mx, my = self.x / self.n, self.y / self.n
        sxx, sxy = self.xx - self.n * mx * mx, self.xy - self.n * mx * my
        base = my  # before the slope: the mean step as the base
        prior = base / (4 * self.bucket)
        c1 = max((sxy + self.PRIOR_WEIGHT * prior) / (sxx + self.PRIOR_WEIGHT), 1e-3 * base)
        return max(my - c1 * mx, 1e-6), c1
