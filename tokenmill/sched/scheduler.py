"""Continuous batching under a token budget (vLLM v1's rule, no prefill/decode phases).

Each step: running requests first (in order), each asking for the tokens it still lacks, capped by
the budget (chunked prefill); when blocks run out the lowest-priority running request is preempted
(its blocks freed, recomputed later). Then waiting requests join while budget, sequence slots and
blocks last. Because one request never needs more blocks than the cache holds (checked at startup),
preempting everyone else always makes room: no deadlock, and every request finishes.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput


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
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.chunked = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        # per running request: how many of its block ids the worker has been sent
        self._blocks_sent: dict[str, int] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []

    # -- admission -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
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
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._blocks_sent.pop(req.request_id, None)
        self._finished_since_last_step.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens to run, in scheduling order
        preempted_now = False

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim()
                if victim.request_id in scheduled:  # priority policy may pick one already placed
                    budget += scheduled.pop(victim.request_id)
                self._preempt(victim, out)
                preempted_now = True
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                budget -= n

        if not preempted_now and self._may_admit():
            budget = self._admit_waiting(budget, scheduled)

        out.seqs = [self._scheduled(self.requests[rid], n) for rid, n in scheduled.items()]
        out.num_scheduled_tokens = sum(scheduled.values())
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _may_admit(self) -> bool:
        """Whether waiting requests may join this step (always, under continuous batching)."""
        return True

    def _admit_waiting(self, budget: int, scheduled: dict[str, int]) -> int:
        for req in self.waiting.ordered():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            leader = req.prefix_leader
            if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                continue  # n > 1: wait until the leader's prompt blocks are cached, then share them
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - num_cached
            if n > budget:
                if not self.chunked:
                    break
                n = budget
            req.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(req, n, cached):
                req.num_computed_tokens = 0
                break
            self.waiting.remove(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n
        return budget

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self._blocks_sent.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)
        out.preempted_ids.append(req.request_id)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        rid, start = req.request_id, req.num_computed_tokens
        sent = self._blocks_sent.get(rid)
        new = None
        if sent is None:  # just admitted (or resumed after preemption): the worker gets everything once
            new = NewRequestData(rid, list(req.prompt_token_ids), list(req.output_token_ids), req.sampling_params,
                                 self.kv.block_ids(rid))
            self._blocks_sent[rid] = len(new.block_ids)
            new_blocks = []
        else:
            new_blocks = self.kv.block_ids(rid, start=sent)
            self._blocks_sent[rid] = sent + len(new_blocks)
        return ScheduledRequest(
            request_id=rid, start_pos=start, num_new_tokens=n, new_block_ids=new_blocks,
            num_sampled_positions=1 if start + n == req.num_tokens else 0,
            wants_prompt_logprobs=req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens,
            new_request=new)

    # -- after the model ran -----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Append each request's sampled tokens in order, applying the stop rules after each (tokens past a
        stop are dropped); free finished requests. Returns the requests that got tokens, with the tokens
        they kept (finished requests included)."""
        touched = []
        for seq in out.seqs:
            tokens = sampled.get(seq.request_id)
            req = self.requests.get(seq.request_id)
            if not tokens or req is None:
                continue
            kept = []
            for token in tokens:
                req.output_token_ids.append(token)
                kept.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self.finish(req, status)
                    break
            touched.append((req, kept))
        return touched

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in sp.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
