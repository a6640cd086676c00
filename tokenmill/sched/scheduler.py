"""Continuous batching under a token budget (vLLM v1's rule, no prefill/decode phases).

Each step: running requests first (in order), each asking for the tokens it still lacks, capped by
the budget (chunked prefill; `long_prefill_token_threshold` caps one prefill's share of a step, so a
short prompt behind a long one starts in the next step); when blocks run out the lowest-priority running request is preempted
(its blocks freed, recomputed later). Then waiting requests join while budget, sequence slots and
blocks last. Because one request never needs more blocks than the cache holds (checked at startup),
preempting everyone else always makes room: no deadlock, and every request finishes.

With KV tiers, a waiting request whose prefix continues in a tier first gets blocks and a load
(SchedulerOutput.kv_loads) and waits aside (`loading`) while other requests run. When the load lands,
its blocks join the prefix cache and are given back, and the request rejoins the queue's front, where
its admission finds them as ordinary pool hits:

    waiting --(tier hit)--> loading --(KVLoadResult)--> waiting (front) --> running

With speculation (`spec`), a decoding request that carries drafts runs 1 + k tokens: its last token and
the drafts. The drafts get KV slots but are never hashed into the prefix cache; after the step,
`num_computed_tokens` rolls back over the rejected ones, whose slots the next step overwrites.

With `decode_steps` > 1 (num_scheduler_steps), a step in which every request is a plain greedy decode, and
no waiting request could join (none waits, or every seat is taken), becomes a burst: each request runs up to
that many decode steps inside the worker, its slots reserved like drafts', and `num_computed_tokens` moves
past every token that was also an input.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.manager import KVCacheManager
from tokenmill.multimodal.encoder_scheduler import EncoderScheduler
from tokenmill.sched.output import KVLoad, KVLoadResult, NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.spec_decode.adaptive import DraftPolicy

# steps in which shorter prompts may pass a prompt that waits for KV room; then they get only room beyond its need
PASS_STEPS = 64


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list = []
        self._tie = itertools.count()

    def _key(self, r: Request):
        return (r.priority, r.arrival_time, next(self._tie))

    def add(self, r: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (self._key(r), r))
        elif front:
            self._fifo.appendleft(r)
        else:
            self._fifo.append(r)

    def ordered(self) -> list[Request]:
        if self.policy == "priority":
            return [r for _, r in sorted(self._heap, key=lambda e: e[0])]
        return list(self._fifo)

    def remove(self, r: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[1] is not r]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(r)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __contains__(self, r: Request) -> bool:
        items = (e[1] for e in self._heap) if self.policy == "priority" else self._fifo
        return any(x is r for x in items)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 spec: DraftPolicy | None = None, long_prefill_token_threshold: int = 0,
                 encoder: EncoderScheduler | None = None, max_long_partial_prefills: int = 0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.chunked = enable_chunked_prefill
        # a prefill chunk takes at most this many tokens of a step (0: all of the budget), leaving the
        # rest to prompts that arrive behind a long one; decodes are never capped
        self.prefill_cap = long_prefill_token_threshold if enable_chunked_prefill and long_prefill_token_threshold \
            else max_num_batched_tokens
        # at most this many prompts longer than the cap prefill at once (0: any number); the others wait while
        # shorter prompts pass them, so a burst of documents leaves room in every step for short requests
        self.max_long_prefills = max_long_partial_prefills if self.prefill_cap < max_num_batched_tokens else 0
        self.requests: dict[str, Request] = {}
        # per running request: how many of its block ids the worker has been sent
        self._blocks_sent: dict[str, int] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []
        self.loading: dict[str, Request] = {}  # tier loads in flight (aborted ones too, until they land)
        self._loading_hashes: dict[bytes, str] = {}  # block hash -> the request loading it
        self._new_loads: list[KVLoad] = []
        self._load_cancels: list[str] = []
        self.spec = spec
        self.spec_lookahead = 0  # set by the engine when a draft model proposes (slots it writes ahead)
        self.decode_steps = 1  # set by the engine: num_scheduler_steps, where the worker can run bursts
        self._drafts: dict[str, list[int]] = {}  # this step's drafts per request
        # per step not yet done (id of its SchedulerOutput): the (block, hash) pairs it registered in the prefix
        # cache, taken back out if it fails
        self._registered_by_step: dict[int, list] = {}
        # pipeline parallelism: requests in a step not yet back (never rescheduled or preempted until it is),
        # and whether steps carry each request's new output tokens to the stages that do not sample
        # async scheduling (the engine sets it): a request in flight in the step before may be scheduled again,
        # its input the token that step samples (the worker fills it in on the device); see _may_run_ahead
        self.in_flight: dict[str, int] = {}  # request id -> steps in flight that hold it
        self.async_scheduling = False
        self._num_added = 0
        self.num_steps = 0  # schedule() calls
        self.num_run_ahead = 0  # requests scheduled while an earlier step held them (async scheduling)
        self.sync_output_tokens = False
        self._outputs_sent: dict[str, int] = {}
        self.encoder = encoder  # multimodal: images to encode per step, the encoder cache (None: text only)

    # -- admission -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        # (an aborted request whose tier load has not reported back still holds its id: `loading` is by id)
        if req.request_id in self.requests or req.request_id in self.loading:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._num_added += 1
        req.serial = self._num_added
        self.waiting.add(req)

    def abort(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def finish(self, req: Request, status: RequestStatus) -> None:
        loading = req.status == RequestStatus.WAITING_FOR_KV
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if loading:  # the load may still write its blocks: they are freed when its result comes back
            self._load_cancels.append(req.request_id)
        else:
            self.kv.free(req)
        del self.requests[req.request_id]
        self._forget_sent(req.request_id)
        self._finished_since_last_step.append(req.request_id)
        if self.spec is not None:
            self.spec.release(req.request_id)
        if self.encoder is not None:
            self.encoder.release(req)

    @property
    def num_unfinished(self) -> int:
        """Live requests, plus aborted ones whose blocks a load still holds."""
        return len(self.requests) + sum(1 for r in self.loading.values() if r.is_finished)

    def finish_loads(self, results: list[KVLoadResult]) -> None:
        """Tier loads that landed (fully, partly or not at all): see the module docstring."""
        for res in results:
            req = self.loading.pop(res.request_id)
            for h in req.block_hashes:
                if self._loading_hashes.get(h) == req.request_id:
                    del self._loading_hashes[h]
            if req.is_finished:
                self.kv.free(req)
                if req.request_id in self._load_cancels:  # its load is over: the cancel must not reach a new
                    self._load_cancels.remove(req.request_id)  # request under the same id
                continue
            self.kv.finish_load(req, res.num_loaded)
            self.kv.tiers.count_hits(res.tiers, self.kv.block_size)
            req.kv_load_failed = res.failed
            req.kv_loaded = True
            # admitted afresh: its pool hits and the loaded blocks are found as prefix hits (the start of the
            # load, set for its allocation, made admission read it as mid-prefill and recompute it all)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.add(req, front=True)

    def loads_not_started(self, loads: list[KVLoad]) -> None:
        """Loads a failed step never handed to the transfer worker: over at once, nothing loaded (their blocks
        would stay held and their prefix skipped by every later request, waiting for a result that never
        comes)."""
        self.finish_loads([KVLoadResult(load.request_id, 0, [], True) for load in loads])

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput(finished_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        if self.encoder is not None:
            self.encoder.begin_step()
        budget = self.max_num_batched_tokens
        # bursts of decode steps only while no waiting prompt could join: none waits, or every seat is taken (it
        # then waits at most one burst longer than it would for a request to finish)
        quiet = (self.decode_steps > 1 and not self.loading
                 and (not len(self.waiting) or len(self.running) >= self.max_num_seqs))
        scheduled: dict[str, int] = {}  # request id -> tokens to run, in scheduling order
        self.kv.take_registered()  # (registrations since the last step: computed KV, loads that landed)
        try:
            out = self._plan(out, budget, quiet, scheduled)
        except BaseException:
            # (a tier lookup, an allocation raised): blocks registered for the tokens planned so far will not be
            # computed; their hashes go, so that no later request hits them
            self.kv.unregister(self.kv.take_registered())
            self._drafts = {}  # fitted already (and taken off their requests): none must reach a later step
            if self.encoder is not None:
                self.encoder.abandon_schedule()
            raise
        registered = self.kv.take_registered()
        if registered:  # until the step is done: a step that fails takes them back out (step_failed)
            self._registered_by_step[id(out)] = registered
        elif self._registered_by_step:
            self._registered_by_step.pop(id(out), None)  # (a step never finished, whose id this one reuses)
        return out

    def _plan(self, out: SchedulerOutput, budget: int, quiet: bool, scheduled: dict[str, int]) -> SchedulerOutput:
        """schedule()'s work: which requests run how many tokens (into `scheduled`), then the step's message."""
        preempted_now = False
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.request_id in self.in_flight:
                if not self._may_run_ahead(req):
                    continue  # still in an earlier step
                self.num_run_ahead += 1
            n = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            if req.num_computed_tokens < req.num_tokens - 1:  # a prefill (or a preempted one's recompute)
                n = min(n, self.prefill_cap)
            if req.mm_items:
                n, _ = self.encoder.plan(req, n)
                if n <= 0:
                    continue
            drafts = self._fit_drafts(req, n, budget) if req.spec_token_ids else []
            n += len(drafts)
            # slots of pending tokens are never hashed here: their ids are not known yet (a draft model's
            # look-ahead slots are reserved after planning, for the requests that propose: _reserve_lookahead)
            while not self.kv.allocate_slots(req, n, num_draft_tokens=len(drafts) + req.num_pending):
                if drafts:  # speculation never preempts another request: the step runs without its drafts
                    n, drafts = n - len(drafts), []
                    continue
                if self._blocks_come_back_for(req, n):
                    break  # it waits a step for the blocks of requests ending now, rather than preempt one
                victim = self._pick_victim()  # `req` itself is a candidate
                if victim is None:  # pipeline stages: every other request is in flight; this one waits
                    break
                if victim.request_id in scheduled:  # priority policy may pick one already placed
                    budget += scheduled.pop(victim.request_id)
                    self._drafts.pop(victim.request_id, None)
                self._preempt(victim, out)
                preempted_now = True
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                budget -= n
                if drafts:
                    self._drafts[req.request_id] = drafts
                if req.mm_items:
                    self.encoder.commit(req, n)

        if not preempted_now and self._may_admit():
            budget = self._admit_waiting(budget, scheduled)

        propose = self._plan_drafts(scheduled)
        if self.spec is not None and self.spec.placeholders:  # a priced look: the scheduler makes the drafts
            out.placeholder_drafts, propose = propose, {}
        if self.spec_lookahead:
            self._reserve_lookahead(scheduled, propose)
        drafting = any(propose.values()) or bool(out.placeholder_drafts)  # a step that proposes is a single step
        steps = self._plan_decode_steps(scheduled) if quiet and not preempted_now and not drafting else {}
        out.burst_forgone = (quiet and not preempted_now and drafting
                             and all(self._may_burst(rid, n) for rid, n in scheduled.items()))
        seqs, in_flight, serials = out.seqs, self.in_flight, out.serials
        for rid, n in scheduled.items():
            req = self.requests[rid]
            samples = self._samples(req, n)
            seqs.append(self._scheduled(req, n, samples, propose.get(rid, 0), steps.get(rid, 1)))
            if req.mm_items:  # before counting this step's tokens: their images are read by this step's forward
                self.encoder.advance(req)
            if samples and self.async_scheduling:
                req.num_pending += 1
            req.num_computed_tokens += n
            in_flight[rid] = in_flight.get(rid, 0) + 1
            serials[rid] = req.serial
        out.num_scheduled_tokens = sum(scheduled.values())
        out.burst_steps = max(steps.values(), default=1)
        self._drafts = {}
        out.kv_stores, out.kv_backups = self.kv.take_stores()
        out.kv_loads, self._new_loads = self._new_loads, []
        out.kv_load_cancels, self._load_cancels = self._load_cancels, []
        if self.encoder is not None:
            self._prefetch_waiting(out)
        return out

    # -- multimodal ----------------------------------------------------------------------------------
    def _prefetch_waiting(self, out: SchedulerOutput) -> None:
        """Overlap: images of requests still queued go to the worker's encoder thread now."""
        if self.encoder.overlap and self.running:
            for req in self.waiting.ordered():
                if req.mm_items:
                    self.encoder.prefetch(req)
        out.encoder_inputs = self.encoder.take_step_encodes()
        out.encoder_prefetch = self.encoder.take_prefetch()
        out.encoder_frees = self.encoder.cache.take_freed()

    def finish_encodes(self, hashes: list[str], failed: list[str] = ()) -> None:
        """Images the encoder thread finished: their rows are on the worker now (or it raised on them)."""
        if hashes:
            self.encoder.cache.finish_pending(hashes)
        if failed:
            self.encoder.prefetch_failed(list(failed))

    def _may_admit(self) -> bool:
        """Whether waiting requests may join this step (always, under continuous batching)."""
        return True

    def _admit_waiting(self, budget: int, scheduled: dict[str, int]) -> int:
        # Blocks the running prefills still need before their prompts are in. A new prompt starts only when
        # the pool holds all of it on top: otherwise chunked prefills of long prompts take turns preempting
        # each other and recompute thousands of tokens each time (the long-text ladder measured 160-500
        # preemptions where this check gives none).
        # While a prompt waits for that room, only prompts prefilled whole in this step may pass it (short
        # requests behind a document); max_num_seqs bounds how many blocks they can hold at once.
        if not len(self.waiting):
            return budget
        debt = sum(self.kv.blocks_still_needed(r, r.num_tokens) for r in self.running) if self.chunked else 0
        long_prefills = sum(self._is_long_prefill(r) for r in self.running) if self.max_long_prefills else 0
        blocked = False
        for req in self.waiting.ordered():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            leader = req.prefix_leader
            if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                continue  # n > 1: wait until the leader's prompt blocks are cached, then share them
            fresh = req.num_computed_tokens == 0
            cached = self.kv.find_cached_prefix(req) if fresh else []
            if fresh and not req.kv_loaded and not req.kv_load_failed:
                started = self._start_tier_load(req, cached, debt)
                if started is not None:
                    if started:
                        if req.status is RequestStatus.WAITING_FOR_KV:  # (one waiting on another's load: at admission)
                            self.kv.count_prefix_lookup(req, cached)
                        continue
                    break
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - num_cached
            is_long = self.max_long_prefills and n > self.prefill_cap
            if is_long and long_prefills >= self.max_long_prefills:
                continue  # shorter prompts behind it may pass
            if self.chunked:
                need = self.kv.blocks_still_needed(req, req.num_tokens) - len(cached)
                if not self.kv.fits(need, cached, debt):
                    # shorter prompts may pass it for a while; after PASS_STEPS they may only use room beyond
                    # what it needs (a steady stream of them kept the free blocks below its need for as long as
                    # they came: a thousand steps and more)
                    if req.blocked_since is None:
                        req.blocked_since = self.num_steps
                    if self.num_steps - req.blocked_since >= PASS_STEPS:
                        debt += need
                    blocked = True
                    continue  # (the stamp stays: preempted later, it has waited long enough already)
                if blocked and n > min(budget, self.prefill_cap):
                    continue
                n = min(n, self.prefill_cap)
            if n > budget:
                if not self.chunked:
                    break
                n = budget
            req.num_computed_tokens = num_cached
            if req.mm_items:
                n = self._plan_admitted_encodes(req, n, scheduled)
                if n <= 0:
                    req.num_computed_tokens = 0
                    continue
            if not self.kv.allocate_slots(req, n, cached):
                req.num_computed_tokens = 0
                break
            self.waiting.remove(req)
            if fresh and not req.kv_loaded:  # one back from a tier load was counted when its load started
                self.kv.count_prefix_lookup(req, cached)
            req.kv_loaded = False
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n
            debt += self.kv.blocks_still_needed(req, req.num_tokens)
            long_prefills += bool(is_long)
            if req.mm_items:
                self.encoder.commit(req, n)
        return budget

    def _is_long_prefill(self, req: Request) -> bool:
        """A running prefill (a prompt's, or the recompute of a preempted request's prompt and output) with more
        than one capped chunk to go."""
        return req.num_tokens - req.num_computed_tokens > self.prefill_cap

    def _plan_admitted_encodes(self, req: Request, n: int, scheduled: dict[str, int]) -> int:
        """A joining request's tokens and inline encodes; 0 tokens when it must wait for its images (the
        encoder budget, or overlap: they are encoded aside while the others step)."""
        whole = n
        n, encodes = self.encoder.plan(req, n)
        if n < whole and not self.chunked:
            return 0  # without chunked prefill a prompt runs whole or not at all
        if encodes and self.encoder.encode_aside(req, bool(scheduled)):
            return 0
        return n

    def _start_tier_load(self, req: Request, cached: list, reserved: int = 0) -> bool | None:
        """None: no tier holds the next blocks; True: a load started (or another request is loading them,
        and this one waits to find them in the pool); False: no free blocks for it beyond the `reserved` ones
        that running prefills still need (taking those would preempt them)."""
        tiers = self.kv.find_tier_prefix(req, len(cached))
        if not tiers:
            return None
        start = len(cached)
        hashes = req.block_hashes[start:start + len(tiers)]
        if hashes[0] in self._loading_hashes:
            return True  # skipped this step; the other load's blocks will be pool hits
        req.num_computed_tokens = start * self.kv.block_size
        if not self.kv.allocate_for_load(req, cached, len(tiers), reserved):
            req.num_computed_tokens = 0
            return False
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[req.request_id] = req
        self._loading_hashes.update((h, req.request_id) for h in hashes)
        self._new_loads.append(KVLoad(req.request_id, self.kv.block_ids(req.request_id, start), hashes, tiers))
        return True

    def _may_run_ahead(self, req: Request) -> bool:
        """Async scheduling: whether a request in the step in flight may join the next one. Its pending token
        is the next step's input, filled in on the device (and what penalties count there). It may not when that
        token could end it by length (max_tokens, max_model_len: known without the token). If the token ends it
        otherwise (EOS, a stop), the next step's token for it is dropped."""
        if not self.async_scheduling:
            return False
        if not req.num_pending:  # a prefill chunk in flight: the next one needs no token of it
            return True
        return req.num_pending == 1 and not self._pending_token_ends_it(req)

    def _pending_token_ends_it(self, req: Request) -> bool:
        """Async scheduling: the token in flight ends the request by length (max_tokens, max_model_len)."""
        after = len(req.output_token_ids) + 1  # output tokens once the pending one is in
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and after >= max_tokens)
                or len(req.prompt_token_ids) + after >= self.max_model_len)

    def _blocks_come_back_for(self, req: Request, n: int) -> bool:
        """Async scheduling, when `req`'s `n` tokens find too few free blocks: whether requests that end by
        length with the step in flight hold enough to cover them. The plain engine would have freed those blocks
        before this schedule; preempting another request instead costs it a recomputation of its context."""
        if not self.async_scheduling:
            return False
        short = self.kv.blocks_still_needed(req, req.num_computed_tokens + n) - self.kv.num_free_blocks
        ending, in_flight = 0, self.in_flight
        for r in self.running:
            if r is not req and r.num_pending == 1 and r.request_id in in_flight and self._pending_token_ends_it(r):
                # blocks it shares (prefix hits, n > 1 siblings) stay held when it ends
                ending += sum(b.ref_cnt == 1 for b in self.kv.req_blocks.get(r.request_id, ()))
                if ending >= short:
                    return True
        return False

    def _pick_victim(self) -> Request | None:
        # Async scheduling runs steps in one stream, in order: a request in the step before may be preempted,
        # since its freed blocks are written again only after that step (its pending token still arrives).
        # Pipeline stages run steps side by side: never a request in flight there.
        candidates = self.running if self.async_scheduling else [
            r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req, num_valid_tokens=req.num_computed_tokens)  # before this step's tokens: never run
        self._forget_sent(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_placeholders = [], False
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.encoder is not None:
            self.encoder.release(req)
        self.waiting.add(req, front=True)
        out.preempted_ids.append(req.request_id)

    # -- speculation ---------------------------------------------------------------------------------
    def _fit_drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The request's drafts that fit this step: only after its last token (a decode), within the
        budget, and no further than max_model_len and max_tokens could use."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return []
        room = min(budget - 1, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        return drafts[:max(0, room)]

    def _lookahead(self, req: Request) -> int:
        """Slots past this step's tokens that a draft model writes while proposing for a request that samples
        this step (spec_decode/draft_model.py), never past max_model_len."""
        return max(0, min(self.spec_lookahead, self.max_model_len - req.num_tokens))

    def _reserve_lookahead(self, scheduled: dict[str, int], propose: dict[str, int]) -> None:
        """The draft model's look-ahead slots, for the requests that propose this step only: reserved for every
        sampling request, they cost a Python call and a check per request and step at depth 0 (~0.5 % of a
        32-request run of the shipped model) and could preempt another request for slots nobody writes. A
        request they do not fit proposes nothing this step (no preemption for speculation)."""
        for rid, k in propose.items():
            if not k:
                continue
            req = self.requests[rid]
            # the draft writes slots P .. P+k-1 (P <= num_tokens + drafts): k past this step's, within max_model_len
            ahead, drafts = k, len(self._drafts.get(rid, ()))
            if not self.kv.allocate_slots(req, scheduled[rid] + ahead,
                                          num_draft_tokens=drafts + ahead + req.num_pending):
                propose[rid] = 0

    def _plan_drafts(self, scheduled: dict[str, int]) -> dict[str, int]:
        """Drafts each request that samples this step proposes for its next step (DraftPolicy). (A request with
        structured outputs drafts too: the runner cuts its drafts where its grammar refuses one.)"""
        if self.spec is None:
            return {}
        plan = self.spec.plan([rid for rid, n in scheduled.items() if self._samples(self.requests[rid], n)])
        if self.spec_lookahead:
            # a draft model runs its drafts at positions P+1 .. P+k-1, P the request's last position once this
            # step's accepted drafts are in: up to num_tokens + its drafts this step. None may reach max_model_len
            for rid, k in plan.items():
                if k:
                    req = self.requests[rid]
                    room = self.max_model_len - req.num_tokens - len(self._drafts.get(rid, ()))
                    plan[rid] = max(0, min(k, self._lookahead(req), room))
        return plan

    def _samples(self, req: Request, n: int) -> bool:
        """Whether this step's `n` tokens (drafts included) reach the end of the request's tokens (pending
        ones included)."""
        return req.num_computed_tokens + n == req.num_tokens + req.num_pending + len(self._drafts.get(req.request_id, ()))

    # -- bursts of decode steps (num_scheduler_steps) -------------------------------------------------------
    def _plan_decode_steps(self, scheduled: dict[str, int]) -> dict[str, int]:
        """Steps per request when every scheduled request is a decode that the worker can continue on its own
        (greedy, no logprobs, penalties or pending min_tokens: its argmax is the whole sampler),
        as many as max_tokens and max_model_len leave; {} otherwise. Each gets slots for its extra inputs,
        never hashed until their tokens are known (as drafts' slots), or one step where blocks are short."""
        plan = {}
        for rid, n in scheduled.items():
            if not self._may_burst(rid, n):
                return {}
            req = self.requests[rid]
            sp = req.sampling_params
            room = self.max_model_len - req.num_tokens
            if sp.max_tokens is not None:
                room = min(room, sp.max_tokens - req.num_output_tokens)
            plan[rid] = max(1, min(self.decode_steps, room))
        for rid, k in plan.items():
            if k > 1 and not self.kv.allocate_slots(self.requests[rid], k, num_draft_tokens=k - 1):
                plan[rid] = 1
        return plan

    def _may_burst(self, rid: str, n: int) -> bool:
        """Whether this step's `n` tokens of request `rid` are one greedy decode the worker could continue."""
        req = self.requests[rid]
        sp = req.sampling_params
        # stop strings may: the output processor cuts a step's tokens at one and finishes the request, as after
        # an accepted run of drafts (a burst runs at most its length past it)
        return (n == 1 and rid not in self._drafts and self._samples(req, n) and sp.argmax_only
                and req.num_output_tokens >= sp.min_tokens)

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The proposer's drafts, to verify at each request's next step."""
        for rid, d in drafts.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.spec_token_ids, req.spec_placeholders = d, False

    def _scheduled(self, req: Request, n: int, samples: bool, propose_k: int = 0, num_steps: int = 1
                   ) -> ScheduledRequest:
        """The step's message about `req` (before its counters move); `samples`: self._samples(req, n)."""
        rid, start = req.request_id, req.num_computed_tokens
        drafts = self._drafts.get(rid, ())
        sent = self._blocks_sent.get(rid)
        new = None
        if sent is None:  # just admitted (or resumed after preemption): the worker gets everything once
            new = NewRequestData(rid, list(req.prompt_token_ids), list(req.output_token_ids), req.sampling_params,
                                 self.kv.block_ids(rid), req.mm_items)
            self._blocks_sent[rid] = len(new.block_ids)
            new_blocks = []
        else:
            new_blocks = self.kv.block_ids(rid, sent)
            if new_blocks:
                self._blocks_sent[rid] = sent + len(new_blocks)
        out_start, new_outputs = self._new_outputs(req, new is not None) if self.sync_output_tokens else (0, [])
        # positional (ScheduledRequest's field order): keywords cost twice as much, per request and step
        return ScheduledRequest(
            rid, start, n, new_blocks, 1 + len(drafts) if samples else 0,
            req.sampling_params.prompt_logprobs is not None and start < len(req.prompt_token_ids),
            new, list(drafts), bool(drafts) and req.spec_placeholders, propose_k, num_steps, out_start, new_outputs)

    def _new_outputs(self, req: Request, sent_whole: bool) -> tuple[int, list[int]]:
        start = len(req.output_token_ids) if sent_whole else self._outputs_sent.get(req.request_id, 0)
        self._outputs_sent[req.request_id] = len(req.output_token_ids)
        return start, req.output_token_ids[start:]

    # -- after the model ran -----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Append each request's sampled tokens in order, applying the stop rules after each (tokens past a
        stop are dropped); free finished requests. Returns the requests that got tokens, with the tokens
        they kept (finished requests included)."""
        touched = []
        if self._registered_by_step:
            self._registered_by_step.pop(id(out), None)  # its KV is written
        in_flight, requests, serials, placeholders = self.in_flight, self.requests, out.serials, out.placeholder_drafts
        for seq in out.seqs:
            rid = seq.request_id
            left = in_flight.pop(rid, 1) - 1
            if left:
                in_flight[rid] = left
            req = requests.get(rid)
            if req is None or req.serial != serials.get(rid):
                continue  # the step's request finished while it ran (async or pipeline), or this one reuses its id
            if seq.num_sampled_positions and self.async_scheduling:
                req.num_pending -= 1
            tokens = sampled.get(rid)
            if not tokens:
                continue
            if seq.num_steps > 1:  # a burst: every token but the last was also an input, its KV written
                req.num_computed_tokens += len(tokens) - 1
            if seq.draft_token_ids:  # the rejected drafts' KV is not the sequence's: roll back over it
                accepted = len(tokens) - 1  # placeholders: none (the worker keeps the target's token only)
                req.num_computed_tokens -= len(seq.draft_token_ids) - accepted
                if seq.draft_placeholders:
                    self.spec.record_placeholder(len(seq.draft_token_ids))
                else:
                    self.spec.record(req.request_id, len(seq.draft_token_ids), accepted)
            kept = []
            for token in tokens:
                req.output_token_ids.append(token)
                kept.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    if (seq.num_steps > 1 or seq.draft_token_ids) and not self.in_flight.get(req.request_id):
                        # KV is written up to num_computed_tokens (past a stop inside a burst too): what
                        # matches the kept tokens joins the prefix cache
                        self.kv.cache_written(req, min(req.num_computed_tokens, req.num_tokens))
                    self.finish(req, status)
                    break
            k = placeholders.get(rid, 0) if placeholders else 0
            if k and not req.is_finished:  # the last token repeated: free to make, and lossless to verify
                req.spec_token_ids, req.spec_placeholders = [kept[-1]] * k, True
            touched.append((req, kept))
        return touched

    def step_failed(self, out: SchedulerOutput) -> None:
        """`out` never ran (the model raised; the caller aborts what it held): its requests are no longer in
        flight for it, their tokens count as not computed again, and the blocks registered for those tokens
        lose their hashes (their KV was never written: a later request with the same prefix would hit garbage,
        and the tiers would store it). The images it was to encode leave the encoder cache's ledger (the worker
        may never have made their rows). A request id left marked in flight would keep a later request under
        that id from ever being scheduled without async scheduling (and never a preemption victim)."""
        # whoever holds those blocks now (a request aborted while the step was in flight freed them, hashes and
        # all; another request may have hit them in the same step)
        lost = self.kv.unregister(self._registered_by_step.pop(id(out), []))
        if self.encoder is not None:
            self.encoder.abandon(out.encoder_inputs, out.encoder_prefetch, out.encoder_frees)
        for seq in out.seqs:
            rid = seq.request_id
            left = self.in_flight.pop(rid, 1) - 1
            if left:
                self.in_flight[rid] = left
            req = self.requests.get(rid)
            if req is None or req.serial != out.serials.get(rid, req.serial):
                continue  # finished meanwhile, or its id now names another request
            if seq.num_sampled_positions and self.async_scheduling and req.num_pending:
                req.num_pending -= 1
            req.num_computed_tokens = min(req.num_computed_tokens, seq.start_pos)
            self._forget_sent(rid)  # the worker's copy may hold the lost step (blocks, placeholder tokens)
        for rid, block in lost.items():  # a request that hit a dropped block in that step: it recomputes it
            req = self.requests.get(rid)
            if req is not None and block * self.kv.block_size < req.num_computed_tokens:
                req.num_computed_tokens = block * self.kv.block_size
                self._forget_sent(rid)

    def _forget_sent(self, rid: str) -> None:
        """The worker gets the request whole at its next step (NewRequestData), its own copy replaced."""
        self._blocks_sent.pop(rid, None)
        self._outputs_sent.pop(rid, None)

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp, num_output = req.sampling_params, len(req.output_token_ids)
        # a grammar lets a stop token through before min_tokens only once it is complete (sample/grammar.py):
        # the request ends there, as nothing else could follow
        if num_output >= sp.min_tokens or sp.structured_outputs is not None:
            if not sp.ignore_eos and token in sp.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
