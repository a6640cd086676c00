"""EngineCore: the step loop over token ids. One step = schedule -> run model -> sample -> update."""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from tokenmill import cpu_threads
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.variants import build_attention_backend, build_kv_manager, build_scheduler
from tokenmill.kv.manager import KVCacheManager, cdiv
from tokenmill.kv.tiers.build import build_tier_chain
from tokenmill.models.loader import load_hf_config, load_model
from tokenmill.sample.sampler import TokenLogprobs
from tokenmill.sched.output import BlockStore
from tokenmill.spec_decode.build import build_proposer, kv_bytes_per_block, load_draft
from tokenmill.worker.kv_transfer import KVTransferWorker
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

_DEFAULT_CPU_KV_GB = 4.0


@dataclass
class EngineCoreOutput:
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
        self.model = load_model(config, self.model_config, self.dtype, config.device)
        spec = config.speculative
        self.draft = load_draft(config, self.model_config, self.dtype) if spec and spec.method == "draft_model" else None
        num_blocks = self._num_kv_blocks()
        mc = self.model_config
        proposer = build_proposer(spec, self.draft, num_blocks, config.block_size, self.dtype, config.device,
                                  build_attention_backend(config))
        self.runner = ModelRunner(self.model, build_attention_backend(config), num_blocks, config.block_size,
                                  mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, config.device, config.seed,
                                  proposer=proposer)
        backend = self.runner.backend
        block_shape = (mc.num_layers, 2, *self.runner.kv_cache.shape[3:])
        tiers = build_tier_chain(config, mc.architecture, self.dtype, block_shape,
                                 kv_layout=f"{type(backend).__name__}{tuple(backend.kv_cache_shape(1, 1, 1, 1))}")
        self.kv = build_kv_manager(config, num_blocks, tiers)
        self.kv_transfer = None
        if tiers is not None:
            self.kv_transfer = KVTransferWorker(self.runner.kv_cache, tiers, config.kv_load_timeout_s)
            self._finalizer = weakref.finalize(self, _close_tiers, self.kv_transfer, self.kv)
        self.scheduler = build_scheduler(config, self.kv)
        if self.draft is not None:
            self.scheduler.spec_lookahead = spec.num_speculative_tokens
        self.num_steps = 0
        self.governor = None
        if config.adaptive_cpu_threads and config.device == "cpu" and torch.get_num_threads() > 1:
            self.governor = cpu_threads.ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        logger.info("engine ready: %s, %s, %d KV blocks of %d tokens", mc.architecture, self.dtype,
                    num_blocks, config.block_size)

    def _num_kv_blocks(self) -> int:
        cfg, mc = self.config, self.model_config
        per_seq = cdiv(cfg.max_model_len, cfg.block_size)
        bytes_per_block = kv_bytes_per_block(mc, cfg.block_size, self.dtype)
        if self.draft is not None:  # the draft's KV lives in the same blocks (spec_decode/draft_model.py)
            bytes_per_block += kv_bytes_per_block(self.draft[1], cfg.block_size, self.dtype)
        if cfg.num_kv_blocks is not None:
            n = cfg.num_kv_blocks
        elif cfg.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            used = total - free
            # leave room for one worst-case step's activations (a rough bound; logits dominate)
            act = cfg.max_num_batched_tokens * (mc.hidden_size * 16 + mc.vocab_size * 4)
            n = int((total * cfg.gpu_memory_utilization - used - act) // bytes_per_block)
        else:
            gb = cfg.kv_cache_memory_gb or _DEFAULT_CPU_KV_GB
            # more blocks than every sequence at full length can use only ever holds cached prefixes
            n = min(int(gb * 2**30 // bytes_per_block), cfg.max_num_seqs * per_seq + per_seq)
        if n < per_seq:
            raise ValueError(f"the KV cache holds {n} blocks but one {cfg.max_model_len}-token sequence needs "
                             f"{per_seq}; raise the KV memory budget or lower max_model_len")
        return n

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort(self, request_ids) -> list[str]:
        aborted = [r.request_id for r in self.scheduler.abort(request_ids)]
        if self.kv_transfer is not None and self.scheduler.loading:
            # a cancelled load is final at once: free its blocks now, not at the next step
            self.kv_transfer.cancel(aborted)
            self.scheduler.finish_loads(self.kv_transfer.poll())
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.governor is not None:
            self.governor.tick()
        xfer = self.kv_transfer
        if xfer is not None:
            self.scheduler.finish_loads(xfer.poll())
        sched = self.scheduler.schedule()
        if xfer is not None:
            xfer.store(sched.kv_stores)  # before the forward, which may overwrite the evicted blocks
            xfer.start_loads(sched.kv_loads)
            xfer.cancel(sched.kv_load_cancels)
        if sched.is_empty:
            self.runner.release_requests(sched.finished_ids)
            if xfer is not None and xfer.num_in_flight:
                xfer.wait(0.01)  # only loads are in flight: sleep until one lands instead of spinning
            return []
        self.num_steps += 1
        spec = self.scheduler.spec
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        if spec is not None:  # the draft policy learns from real step times
            decode_only = all(s.num_sampled_positions == s.num_new_tokens for s in sched.seqs)
            spec.observe_step(sum(len(t) for t in result.sampled_token_ids.values()),
                              time.perf_counter() - t0 - result.propose_seconds, decode_only, result.propose_seconds)
        if xfer is not None:
            xfer.store(sched.kv_backups)
        outputs: dict[str, EngineCoreOutput] = {}
        for rid, rows in result.prompt_logprobs.items():
            outputs[rid] = EngineCoreOutput(rid, [], prompt_logprobs=rows)
        for req, tokens in self.scheduler.update(sched, result.sampled_token_ids):
            o = outputs.setdefault(req.request_id, EngineCoreOutput(req.request_id, []))
            o.new_token_ids.extend(tokens)
            o.finish_reason, o.stop_reason = req.finish_reason, req.stop_reason
            o.num_cached_tokens = max(req.num_cached_tokens, 0)
            if req.request_id in result.logprobs:
                o.logprobs.extend(result.logprobs[req.request_id][:len(tokens)])
        if result.draft_token_ids:
            self.scheduler.set_drafts(result.draft_token_ids)
        return list(outputs.values())

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
            num_running=len(s.running), num_waiting=len(s.waiting) + len(s.loading), num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate, num_preemptions=s.num_preemptions, num_steps=self.num_steps,
            num_loading_kv=len(s.loading), kv_tiers=kv.tiers.snapshot() if kv.tiers is not None else {},
            **_spec_stats(s.spec))

    def close(self) -> None:
        """Write the pool's cached blocks down the tiers and stop the transfer threads (also at exit)."""
        if self.kv_transfer is not None:
            self._finalizer()

    def check_invariants(self) -> None:
        """KV accounting is exact; when idle, every block is back in the pool."""
        self.kv.check_invariants()
        if self.kv.tiers is not None:
            self.kv.tiers.check_invariants()
        if not self.has_unfinished():
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, (
                f"idle engine holds {self.kv.pool.num_blocks - self.kv.num_free_blocks} KV blocks")


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
