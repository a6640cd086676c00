"""EngineCore: the step loop over token ids. One step = schedule -> run model -> sample -> update."""
from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenmill import cpu_threads
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.grammar_wait import GrammarWait
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.variants import build_kv_manager, build_scheduler
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.tiers.build import build_tier_chain
from tokenmill.models.loader import load_hf_config
from tokenmill.sample.sampler import TokenLogprobs
from tokenmill.sched.burst import AutoBurst
from tokenmill.sched.output import BlockStore
from tokenmill.worker.build import build_runner
from tokenmill.worker.kv_transfer import KVTransferWorker

logger = logging.getLogger("tokenmill")


@dataclass
class EngineCoreOutput:
    # EngineCore._finish_step builds these positionally: a new field goes last
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    num_loading_kv: int = 0  # requests waiting for their prefix to load from the KV tiers
    # per tier (host, disk, remote): TierStats counters (kv/tiers/connector.py)
    kv_tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    # speculative decoding (spec_decode/adaptive.py SpecStats); zeros when off
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_acceptance_rate: float = 0.0
    spec_mean_acceptance_length: float = 0.0
    # tensor / pipeline parallelism: rank 0's time, operations and bytes in collectives and sends (comm.py)
    comm_seconds: float = 0.0
    comm_ops: int = 0
    comm_bytes: int = 0
    # multimodal: images / frames encoded (inline and in the encoder thread), encoder time, encoder cache
    mm_images_encoded: int = 0
    mm_images_prefetched: int = 0
    mm_encoder_seconds: float = 0.0
    mm_encoder_cache_hits: int = 0
    mm_encoder_cache_misses: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_hf(load_hf_config(config.model))
        config.resolve(self.model_config)
        self.dtype = config.torch_dtype(self.model_config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if cpu_threads.applied_too_late:
            logger.warning("torch was imported before tokenmill, so OpenMP kept its long spin-wait, which slows the "
                           "engine down many times over when another process takes a core; import tokenmill first "
                           "or set %s", " ".join(f"{k}={v}" for k, v in cpu_threads.OPENMP_DEFAULTS.items()))
        torch.manual_seed(config.seed)
        spec = config.speculative
        self.executor = None
        if config.world_size > 1:  # worker processes for the other ranks; this process is rank 0
            from tokenmill.distributed.executor import MultiprocExecutor

            self.executor = MultiprocExecutor(config, self.model_config, self.dtype)
            self.runner = self.executor.runner
            self._executor_finalizer = weakref.finalize(self, self.executor.close)
        else:
            self.runner = build_runner(config, self.model_config, self.dtype)
        self._in_flight: deque = deque()  # pipeline parallelism: steps submitted, results not yet back
        num_blocks = self.runner.num_blocks
        mc = self.model_config
        backend = self.runner.backend
        block_shape = (mc.num_layers, 2, *self.runner.kv_cache.shape[3:])
        tiers = build_tier_chain(config, mc.architecture, self.dtype, block_shape,
                                 kv_layout=f"{type(backend).__name__}{tuple(backend.kv_cache_shape(1, 1, 1, 1))}")
        self.kv = build_kv_manager(config, num_blocks, tiers)
        self.kv_transfer = None
        if tiers is not None:
            self.kv_transfer = KVTransferWorker(self.runner.kv_cache, tiers, config.kv_load_timeout_s)
            self._finalizer = weakref.finalize(self, _close_tiers, self.kv_transfer, self.kv)
        self.scheduler = build_scheduler(config, self.kv, mc.is_multimodal)
        self.scheduler.sync_output_tokens = config.pipeline_parallel_size > 1  # stages that do not sample
        # async scheduling: the step whose tokens are still on the device (collected after the next launches)
        self._deferred: tuple | None = None
        self.set_async_scheduling(bool(config.async_scheduling))
        if spec is not None and spec.method == "draft_model":
            self.scheduler.spec_lookahead = spec.num_speculative_tokens
        if self.scheduler.spec is not None and getattr(self.runner, "decode_step", None) is not None:
            # the CPU's one-call step, or the decode graphs' largest bucket
            self.scheduler.spec.max_rows = self.runner.decode_step.max_rows
        self.auto_burst = None  # num_scheduler_steps=0: burst lengths from measured step times
        if config.num_scheduler_steps != 1:
            if (self.executor is None and getattr(self.runner.decode_step, "runs_greedy_steps", False)
                    and not config.async_scheduling):
                if config.num_scheduler_steps:
                    self.scheduler.decode_steps = config.num_scheduler_steps
                else:  # with speculation, steps where no request drafts (DraftPolicy prices them in)
                    self.auto_burst = AutoBurst()
            elif config.num_scheduler_steps > 1:
                logger.warning("num_scheduler_steps=%d ignored: bursts of decode steps run on the CPU's one-call "
                               "decode step only (not with enforce_eager, a GPU, or a model split over ranks)",
                               config.num_scheduler_steps)
        self.grammar_wait = GrammarWait(self.runner.grammars)  # structured outputs' requests, while they compile
        self.num_steps = 0
        self.governor = None
        if (config.adaptive_cpu_threads and config.device == "cpu" and torch.get_num_threads() > 1
                and self.executor is None):
            self.governor = cpu_threads.ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        logger.info("engine ready: %s, %s, %d KV blocks of %d tokens%s", mc.architecture, self.dtype,
                    num_blocks, config.block_size, _parallel_note(config))

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.scheduler.requests or rid in self.grammar_wait.waiting:
            # checked here, not only by the scheduler: a structured request would otherwise replace the one
            # waiting for its grammar, or fail later inside a step (every request in it with it)
            raise ValueError(f"request_id {rid!r} is already in use")
        if req.sampling_params.structured_outputs is not None:
            if self.executor is not None and req.prefix_leader is None:  # the other sampling ranks compile it
                # meanwhile (once per request: n > 1's children share it)
                self.executor.precompile(req.sampling_params.structured_outputs)
            self.grammar_wait.add(req)  # joins the scheduler once its grammar compiled, off the step's thread
        else:
            self.scheduler.add_request(req)

    def abort(self, request_ids) -> list[str]:
        aborted = [r.request_id for r in self.scheduler.abort(request_ids)]
        if self.grammar_wait.waiting:
            aborted += self.grammar_wait.abort(request_ids)
        if self.kv_transfer is not None and self.scheduler.loading:
            # a cancelled load is final at once: free its blocks now, not at the next step
            self.kv_transfer.cancel(aborted)
            self.scheduler.finish_loads(self.kv_transfer.poll())
        return aborted

    def _busy(self) -> bool:
        """Requests to run (or waiting for their grammar), or a step in flight."""
        return (self.scheduler.num_unfinished > 0 or bool(self._in_flight) or self._deferred is not None
                or bool(self.grammar_wait.waiting))

    def has_unfinished(self) -> bool:
        """Whether stepping has work left: requests, a step in flight, or KV-tier stores still landing."""
        return self._busy() or (self.kv_transfer is not None and self.kv_transfer.has_landing)

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.grammar_wait.waiting:  # compiled grammars' requests join the scheduler (failed ones end here)
            failed = self._admit_compiled()
            if failed:
                return failed
        spec, started = self.scheduler.spec, time.perf_counter()
        if spec is not None:
            spec.step_started(started)  # the last step's whole cycle ends here
        if self.governor is not None:
            self.governor.tick()
        xfer, encoder = self.kv_transfer, self.runner.encoder
        if xfer is not None:
            self.scheduler.finish_loads(xfer.poll())
        if encoder is not None:
            self.scheduler.finish_encodes(*encoder.poll())
        sched = self.scheduler.schedule()
        if xfer is not None:
            started = False
            try:
                # cancels first: a cancel for an aborted request must not reach a new load under its reused id
                xfer.cancel(sched.kv_load_cancels)
                # before the forward and the loads, which may overwrite the evicted blocks
                xfer.store(sched.kv_stores)
                xfer.start_loads(sched.kv_loads)
                started = True
            except BaseException:
                if not started:
                    self.scheduler.loads_not_started(sched.kv_loads)
                self.scheduler.step_failed(sched)
                raise
        if sched.is_empty:
            # (a step may preempt and then schedule nothing: the runner and the draft must still hear of it)
            self._executor().release_requests(sched.finished_ids, sched.preempted_ids)
            if xfer is not None:  # write-through copies of blocks earlier steps filled (no forward to wait for)
                xfer.store(sched.kv_backups)
            if encoder is not None:  # no forward this step to hand the encoder its orders (prefetches, frees,
                try:  # encodes of requests preempted in this schedule): they must not be lost
                    encoder.apply(sched)
                except BaseException:
                    self.scheduler.step_failed(sched)
                    raise
            if self._deferred is not None:
                return self._finish_deferred()
            if self._in_flight:
                return self._finish_oldest()
            if xfer is not None and xfer.has_landing:  # no forward to overlap: the last stores go to the tiers now
                xfer.land(wait=True)  # (else an idle engine would keep them in pinned memory, unseen by its peers)
            if xfer is not None and xfer.num_in_flight:
                xfer.wait(0.01)  # only loads are in flight: sleep until one lands instead of spinning
            if encoder is not None and encoder.num_in_flight:  # only encodes are in flight: sleep until one lands
                self.scheduler.finish_encodes(*encoder.poll(wait_s=0.01))
            if self.grammar_wait.waiting:  # only grammars are compiling: sleep until one is done
                return self._admit_compiled(wait_s=0.01)
            return []
        self.num_steps += 1
        if self.executor is not None and self.executor.max_in_flight > 1:
            # pipeline: keep up to pp steps in flight; schedule the next while the later stages run this one
            self.executor.submit(sched)
            self._in_flight.append(sched)
            return [] if len(self._in_flight) < self.executor.max_in_flight else self._finish_oldest()
        try:
            result = self._executor().execute(sched)
        except BaseException:
            self.scheduler.step_failed(sched)
            raise
        if xfer is not None:
            xfer.store(sched.kv_backups)
        if self._deferred is not None or result.deferred is not None:
            # async scheduling: this step is launched; the one before finishes while the device runs it
            try:
                outputs = self._finish_deferred() if self._deferred is not None else []
            except BaseException:  # (a device error shows here) the step just launched is lost with it
                self.scheduler.step_failed(sched)
                raise
            if result.deferred is not None:
                self._deferred = (sched, result)
                return outputs
            return outputs + self._finish_step(sched, result)
        outputs = self._finish_step(sched, result)
        if self.auto_burst is not None and sched.num_scheduled_tokens == len(sched.seqs):  # decodes only
            # less the drafts' proposing (a draft model catching up over a burst's tokens is no decode step)
            seconds = time.perf_counter() - started - result.propose_seconds
            self.scheduler.decode_steps = self.auto_burst.observe(seconds, sched.burst_steps)
        if spec is not None:  # the draft policy learns from real step times
            prefill_tokens = sum(s.num_new_tokens - s.num_sampled_positions for s in sched.seqs)
            steps = max(map(len, result.sampled_token_ids.values()), default=1) if sched.burst_steps > 1 else 1
            spec.step_ran(sum(len(t) for t in result.sampled_token_ids.values()), prefill_tokens,
                          result.propose_seconds, started, time.perf_counter(), result.catch_up_seconds, steps,
                          sched.burst_forgone)
        return outputs

    def _executor(self):
        return self.executor if self.executor is not None else self.runner

    def _admit_compiled(self, wait_s: float = 0.0) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled join the scheduler; those whose grammar failed end, aborted."""
        ok, failed = self.grammar_wait.ready(wait_s)
        for req in ok:
            self.scheduler.add_request(req)
        return [EngineCoreOutput(req.request_id, [], RequestStatus.FINISHED_ABORTED.value) for req in failed]

    def set_async_scheduling(self, on: bool) -> None:
        """The scheduler runs requests ahead and the runner leaves tokens on the device, or neither (between
        steps only: no step in flight)."""
        assert self._deferred is None, "a step is in flight"
        self.config.async_scheduling = self.scheduler.async_scheduling = self.runner.defer_tokens = on

    def flush(self) -> list[EngineCoreOutput]:
        """Finish the step whose tokens are still on the device, if any (async scheduling), and land the KV-tier
        stores still copying to the host. LLM.generate calls it at the end: a request that stopped on EOS may
        leave a step in flight for it."""
        outputs = self._finish_deferred() if self._deferred is not None else []
        if self.kv_transfer is not None:
            self.kv_transfer.land(wait=True)
        return outputs

    def _finish_deferred(self) -> list[EngineCoreOutput]:
        sched, result = self._deferred
        self._deferred = None
        try:
            self.runner.collect(result.deferred, result)
        except BaseException:
            self.scheduler.step_failed(sched)
            raise
        return self._finish_step(sched, result)

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        return self._finish_step(self._in_flight.popleft(), self.executor.collect())

    def _finish_step(self, sched, result) -> list[EngineCoreOutput]:
        outputs: dict[str, EngineCoreOutput] = {}
        if result.prompt_logprobs:
            self._prompt_logprob_outputs(sched, result.prompt_logprobs, outputs)
        logprobs = result.logprobs
        for req, tokens in self.scheduler.update(sched, result.sampled_token_ids):
            rid, finish = req.request_id, req.finish_reason
            o = outputs.get(rid)
            if o is None:  # positional (the field order): keywords cost more, per request and step
                o = outputs[rid] = EngineCoreOutput(rid, tokens, finish, req.stop_reason, [], [],
                                                    max(req.num_cached_tokens, 0))
            else:  # its prompt logprobs came first
                o.new_token_ids.extend(tokens)
                o.finish_reason, o.stop_reason = finish, req.stop_reason
                o.num_cached_tokens = max(req.num_cached_tokens, 0)
            if logprobs and rid in logprobs:
                o.logprobs.extend(logprobs[rid][:len(tokens)])
        if result.draft_token_ids:
            self.scheduler.set_drafts(result.draft_token_ids)
        return list(outputs.values())

    def _prompt_logprob_outputs(self, sched, rows_of: dict, outputs: dict) -> None:
        """Each request's prompt-logprob rows from this step's chunk, past those it has had: a request preempted
        and resumed prefills its prompt again, and each row goes out once. Rows of a request that finished
        while the step ran (async scheduling), or of an earlier request under a reused id, go nowhere."""
        starts = {s.request_id: s.start_pos for s in sched.seqs if s.wants_prompt_logprobs}
        for rid, rows in rows_of.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.serial != sched.serials.get(rid):
                continue
            # row j scores prompt token start + 1 + j; the first num_prompt_logprobs_sent tokens after the first
            # are out already
            start, sent = starts[rid], req.num_prompt_logprobs_sent
            req.num_prompt_logprobs_sent = max(sent, start + len(rows))
            rows = rows[max(0, sent - start):]
            if rows:
                outputs[rid] = EngineCoreOutput(rid, [], prompt_logprobs=rows)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> None:
        """Called by the output side when a stop string matched."""
        req = self.scheduler.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.stop_reason = stop_reason
            self.scheduler.finish(req, status)

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.kv
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(s.loading) + len(self.grammar_wait),
            num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate, num_preemptions=s.num_preemptions, num_steps=self.num_steps,
            num_loading_kv=len(s.loading), kv_tiers=kv.tiers.snapshot() if kv.tiers is not None else {},
            **_spec_stats(s.spec), **self._comm_stats(), **self._mm_stats())

    def _mm_stats(self) -> dict:
        enc = self.runner.encoder
        if enc is None:
            return {}
        cache = self.scheduler.encoder.cache
        return dict(mm_images_encoded=enc.images_encoded, mm_images_prefetched=enc.images_prefetched,
                    mm_encoder_seconds=enc.encode_seconds, mm_encoder_cache_hits=cache.hits,
                    mm_encoder_cache_misses=cache.misses)

    def _comm_stats(self) -> dict:
        if self.executor is None:
            return {}
        c = self.executor.comm_stats
        return dict(comm_seconds=c.seconds, comm_ops=c.ops, comm_bytes=c.bytes)

    def close(self) -> None:
        """Write the pool's cached blocks down the tiers and stop the transfer threads (also at exit); stop
        the worker processes of a multi-rank engine."""
        self.grammar_wait.close()
        if self.kv_transfer is not None:
            self._finalizer()
        if self.executor is not None:
            self._executor_finalizer()

    def check_invariants(self) -> None:
        """KV accounting is exact; when idle, every block is back in the pool."""
        self.kv.check_invariants()
        if self.scheduler.encoder is not None:
            self.scheduler.encoder.cache.check_invariants()
        if self.kv.tiers is not None:
            self.kv.tiers.check_invariants()
        if not self._busy():
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, (
                f"idle engine holds {self.kv.pool.num_blocks - self.kv.num_free_blocks} KV blocks")


def _parallel_note(config: EngineConfig) -> str:
    if config.world_size == 1:
        return ""
    return f", tensor parallel {config.tensor_parallel_size} x pipeline parallel {config.pipeline_parallel_size}"


def _spec_stats(spec) -> dict:
    if spec is None:
        return {}
    st = spec.stats
    return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                spec_num_accepted_tokens=st.num_accepted_tokens, spec_accepted_per_pos=list(st.accepted_per_pos),
                spec_acceptance_rate=st.acceptance_rate, spec_mean_acceptance_length=st.mean_acceptance_length)


_SHUTDOWN_BUDGET_S = 4.0  # the API process waits 5 s for the core to exit


def _close_tiers(transfer: KVTransferWorker, kv: KVCacheManager) -> None:
    """Blocks still cached in the pool would die with the process: store them in the lower tiers first, so a
    restarted engine finds them on disk (or in Redis). Most recently used first, within a time budget."""
    recent_first = [*kv.pool.blocks_in_use(), *reversed(kv.pool.free_blocks())]
    cached = [BlockStore(b.block_id, b.block_hash) for b in recent_first if b.block_hash is not None]
    if transfer.lower and cached:
        transfer.store_lower(cached, timeout_s=_SHUTDOWN_BUDGET_S / 2)
    transfer.close(flush_timeout_s=_SHUTDOWN_BUDGET_S / 4)
