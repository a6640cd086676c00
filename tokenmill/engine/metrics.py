"""Prometheus metrics, named as vLLM's with a `tokenmill:` prefix.

Request-level numbers (TTFT, ITL, latency, token counts) are observed in the API process as outputs
arrive; engine-level numbers (queue lengths, KV usage, prefix cache, preemptions) come from the core's
EngineStats snapshot and are exported at scrape time by a collector."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.core import EngineStats
from tokenmill.engine.live_window import LiveWindow
from tokenmill.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineStatsCollector:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def describe(self):
        return []

    def collect(self):
        s, labels = self.stats, [self.model_name]
        if s is None:
            return

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_cache_usage)
        yield gauge("num_kv_blocks_total", "KV-cache blocks in the pool.", s.num_kv_blocks)
        yield gauge("num_kv_blocks_free", "KV-cache blocks free (cached-but-unused blocks count as free).",
                    s.num_free_kv_blocks)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over all prompt tokens so far.",
                    s.prefix_cache_hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (requests evicted and later recomputed).", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("num_requests_loading_kv", "Requests waiting for their prefix to load from the KV tiers.",
                    s.num_loading_kv)
        yield from _tier_metrics(s.kv_tiers, self.model_name)
        if s.spec_num_drafts or s.spec_accepted_per_pos:
            yield from _spec_metrics(s, self.model_name)
        if s.mm_images_encoded or s.mm_encoder_cache_hits:  # multimodal models
            yield counter("mm_images_encoded", "Images and video frames run through the vision encoder.",
                          s.mm_images_encoded)
            yield counter("mm_images_prefetched", "Of those, encoded in the encoder thread while decode steps ran.",
                          s.mm_images_prefetched)
            yield counter("mm_encoder_seconds", "Time spent in the vision encoder.", s.mm_encoder_seconds)
            yield counter("mm_encoder_cache_hits", "Images a step needed that the encoder cache held.",
                          s.mm_encoder_cache_hits)
            yield counter("mm_encoder_cache_misses", "Images a step needed that had to be encoded.",
                          s.mm_encoder_cache_misses)
        if s.comm_ops:  # tensor / pipeline parallelism: rank 0's share of communication
            yield counter("comm_seconds", "Time rank 0 spent in all-reduces, all-gathers and pipeline sends "
                          "(divide by engine_steps for the time per step).", s.comm_seconds)
            yield counter("comm_ops", "Collectives and pipeline sends rank 0 ran.", s.comm_ops)
            yield counter("comm_bytes", "Bytes rank 0 put into collectives and pipeline sends.", s.comm_bytes)


def _spec_metrics(s: EngineStats, model_name: str):
    """vLLM v1's spec-decode counters, with our prefix; the two gauges (acceptance rate, mean acceptance length)
    are ours (vLLM derives them on its dashboard)."""
    for name, doc, value in (
            ("spec_decode_num_drafts", "Verification steps that checked at least one draft token.", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)):
        c = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c
    per_pos = CounterMetricFamily("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by their position in the draft.",
                                  labels=["model_name", "position"])
    for i, v in enumerate(s.spec_accepted_per_pos):
        per_pos.add_metric([model_name, str(i)], v)
    yield per_pos
    for name, doc, value in (
            ("spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far.", s.spec_acceptance_rate),
            ("spec_decode_mean_acceptance_length", "Tokens per verification step (accepted drafts + 1).",
             s.spec_mean_acceptance_length)):
        g = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
        g.add_metric([model_name], value)
        yield g


# TierStats field -> (metric name, kind, help); one series per tier (host, disk, remote)
_TIER_METRICS = {
    "hit_tokens": ("kv_tier_hit_tokens", "counter", "Prompt tokens served from a KV tier."),
    "blocks_stored": ("kv_tier_blocks_stored", "counter", "KV blocks written to a tier."),
    "bytes_stored": ("kv_tier_bytes_stored", "counter", "KV bytes written to a tier."),
    "blocks_loaded": ("kv_tier_blocks_loaded", "counter", "KV blocks read from a tier."),
    "bytes_loaded": ("kv_tier_bytes_loaded", "counter", "KV bytes read from a tier."),
    "store_seconds": ("kv_tier_store_seconds", "counter", "Time spent writing blocks to a tier."),
    "load_seconds": ("kv_tier_load_seconds", "counter", "Time spent reading blocks from a tier."),
    "errors": ("kv_tier_errors", "counter", "Failed tier reads and writes (corrupt blocks included)."),
    "stores_dropped": ("kv_tier_stores_dropped", "counter", "KV blocks not stored: the tier's writes were behind."),
    "blocks": ("kv_tier_blocks", "gauge", "KV blocks held by a tier."),
    "bytes": ("kv_tier_bytes", "gauge", "KV bytes held by a tier."),
    "capacity_bytes": ("kv_tier_capacity_bytes", "gauge", "Size cap of a tier."),
}


def _tier_metrics(tiers: dict[str, dict[str, float]], model_name: str):
    for field_name, (name, kind, doc) in _TIER_METRICS.items():
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        m = family(f"tokenmill:{name}", doc, labels=["model_name", "tier"])
        for tier, stats in tiers.items():
            m.add_metric([model_name, tier], stats.get(field_name, 0))
        yield m


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = _EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        lab, r = ["model_name"], self.registry

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"tokenmill:{name}", doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token outputs of a request.")
        self.tpot = hist("request_time_per_output_token_seconds", "Per request: (latency - TTFT) / (tokens - 1).")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.")
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.gen_hist = hist("request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prefill tokens processed.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self._success = Counter("tokenmill:request_success", "Finished requests by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self.rejected = Counter("tokenmill:request_rejected", "Requests refused with 429 (queue full).", lab,
                                registry=r).labels(model_name)
        self.model_name = model_name
        self.window = LiveWindow()  # the dashboard's last minute (engine/live_window.py)
        self.output_tokens_streamed = 0  # as they reach the API process, not only when requests finish

    def observe_arrivals(self, n: int) -> None:
        self.window.arrived(n)

    def observe_output_tokens(self, n: int) -> None:
        self.output_tokens_streamed += n

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.engine.stats = stats

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.window.observe("itl", seconds)

    def observe_finished(self, m: RequestMetrics, num_prompt: int, num_generated: int, finish_reason: str,
                         now: float) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.prompt_hist.observe(num_prompt)
        self.gen_hist.observe(num_generated)
        self.e2e.observe(now - m.arrival_time)
        self.window.observe("e2e", now - m.arrival_time, now)
        self.window.done(num_generated, now)
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.window.observe("ttft", m.first_token_time - m.arrival_time, now)
            if num_generated > 1 and m.last_token_time is not None:
                tpot = (m.last_token_time - m.first_token_time) / (num_generated - 1)
                self.tpot.observe(tpot)
                self.window.observe("tpot", tpot, now)

    def render(self) -> bytes:
        return generate_latest(self.registry)
