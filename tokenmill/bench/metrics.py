"""Benchmark metric math, with `vllm bench serve`'s definitions so our numbers compare with everyone's.

Pure functions over per-request samples (seconds); no I/O, no clocks. Per request:
  TTFT  time from sending the request to the first token-bearing chunk
  ITL   the gaps between consecutive token-bearing chunks (one list per request)
  E2EL  time from sending to the last token-bearing chunk ("latency")
  TPOT  (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token
Aggregates: mean, median, std and the chosen percentiles (numpy's linear interpolation, as vLLM), in ms.
Goodput: completed requests per second that meet every SLO given (ms); a request with one output token
counts TPOT as 0 there, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
METRIC_HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured; times in seconds, start_time on the benchmark's own clock."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage when it reports it
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0  # time spent waiting for a --max-concurrency slot before sending
    generated_text: str = ""
    error: str = ""
    output_tokens_source: str = ""  # "usage" | "tokenizer" | "chunks" | "engine"
    length_class: str | None = None  # the request's class in a mixed workload (long-text: "short" / "long")


def tpot(r: RequestResult) -> float | None:
    """Time per output token after the first, or None when there is at most one output token."""
    if r.output_tokens <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (the key suffix vLLM uses: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std and percentiles of samples given in seconds, returned in ms. Empty -> zeros (as vLLM)."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(np.mean(v)), "median": float(np.median(v)), "std": float(np.std(v))}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(v, p))
    return out


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, val = pair.split(":")
            slos[name.strip().lower()] = float(val)
        except ValueError:
            raise ValueError(f"goodput SLO must be KEY:MS (e.g. ttft:200), got {pair!r}") from None
    for name, val in slos.items():
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO name must be one of {list(GOODPUT_METRICS)}, got {name!r}")
        if val < 0:
            raise ValueError(f"goodput SLO must be non-negative, got {name}:{val}")
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(slos_ms[k] / 1000.0 >= got[k] for k in slos_ms)


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once: a sweep over half-open [start, start + latency) intervals."""
    events = []
    for r in results:
        if r.success:
            events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    events.sort()  # at equal times -1 sorts first: an ending request frees its slot before the next starts
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def peak_output_tokens_per_s(results: list[RequestResult]) -> float:
    """Most token-bearing chunks landing in any one-second bucket (vLLM's 'peak output token throughput')."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    n = int(np.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    buckets = np.zeros(n)
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for x in times:
            b = int(x - t0)
            if 0 <= b < n:
                buckets[b] += 1
    return float(buckets.max())


CLASS_STATS = (("ttft", lambda r: r.ttft), ("e2el", lambda r: r.latency))


def by_length_class(results: list[RequestResult], percentiles: list[float]) -> dict | None:
    """TTFT and E2EL percentiles per length class (ms), or None when the workload has no classes. With both
    "long" and "short" present, also the long/short P99 TTFT ratio: the playbook's 7x problem."""
    classes = sorted({r.length_class for r in results if r.length_class})
    if not classes:
        return None
    out: dict = {}
    for c in classes:
        ok = [r for r in results if r.success and r.length_class == c]
        row: dict = {"completed": len(ok), "failed": sum(1 for r in results if r.length_class == c and not r.success)}
        for m, get in CLASS_STATS:
            for stat, v in summarize([get(r) for r in ok], list(percentiles)).items():
                row[f"{stat}_{m}_ms"] = v
        out[c] = row
    return out


def long_short_ratio(by_class: dict | None, key: str = "p99_ttft_ms") -> float | None:
    if not by_class or "long" not in by_class or "short" not in by_class:
        return None
    long, short = by_class["long"].get(key), by_class["short"].get(key)
    return long / short if long is not None and short else None


def compute_metrics(results: list[RequestResult], duration_s: float, percentiles: list[float] = (50, 90, 99),
                    goodput_slos_ms: dict[str, float] | None = None) -> dict:
    """The aggregate result dict (vLLM's key names). Failed requests count only in 'failed'."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (tpot(r) for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    dur = duration_s if duration_s > 0 else float("nan")
    good = sum(meets_slos(r, goodput_slos_ms) for r in ok) if goodput_slos_ms else None
    out = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": (good / dur) if good is not None else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_output_tokens_per_s(results),
        "max_concurrent_requests": peak_concurrency(results),
    }
    for m in METRICS:
        for stat, v in summarize(samples[m], list(percentiles)).items():
            out[f"{stat}_{m}_ms"] = v
    classes = by_length_class(results, list(percentiles))
    if classes:
        out["by_length_class"] = classes
        out["long_short_p99_ttft_ratio"] = long_short_ratio(classes)
        out["long_short_p99_e2el_ratio"] = long_short_ratio(classes, "p99_e2el_ms")
    return out


def per_request_fields(results: list[RequestResult]) -> dict:
    """Per-request samples saved in the result JSON (vLLM's names), so reports can draw CDFs."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results],
        "successes": [r.success for r in results],
        "output_lens_source": [r.output_tokens_source for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "length_classes": [r.length_class for r in results],
    }


def results_from_json(d: dict) -> list[RequestResult]:
    """Rebuild per-request results from a saved result file (ours or vLLM's --save-detailed)."""
    n = len(d.get("latencies", []))
    succ = d.get("successes") or [not e for e in d.get("errors", [""] * n)]
    return [RequestResult(success=bool(succ[i]), prompt_len=d["input_lens"][i], output_tokens=d["output_lens"][i],
                          ttft=d["ttfts"][i] or 0.0, itl=list(d["itls"][i] or []), latency=d["latencies"][i] or 0.0,
                          start_time=(d.get("start_times") or [0.0] * n)[i],
                          length_class=(d.get("length_classes") or [None] * n)[i])
            for i in range(n)]


def format_table(result: dict, metrics: list[str], percentiles: list[float], title: str) -> str:
    """The console table, laid out like vLLM's."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(name, val, fmt="{:<10.2f}"):
        lines.append(f"{name:<48} " + (fmt.format(val) if isinstance(val, (int, float)) else str(val)))

    row("Successful requests:", result["completed"], "{:<10}")
    row("Failed requests:", result["failed"], "{:<10}")
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"], "{:<10}")
    rate = result.get("request_rate")
    if rate not in (None, "inf") and rate != float("inf"):
        row("Request rate configured (RPS):", rate)
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for key, label in (("peak_rss_mb", "Peak RSS (MiB):"), ("cpu_utilization", "CPU utilization (%):"),
                       ("peak_gpu_memory_mb", "Peak GPU memory (MiB):")):
        if result.get(key) is not None:
            row(label, result[key])
    kv = result.get("kv_cache")
    if kv:
        row("Prefix cache hit rate (%):", 100 * kv["prefix_cache_hit_rate"])
        for tier, t in kv["tiers"].items():
            lines.append(f"{' KV tier: ' + tier + ' ':-^60}")
            row("Hit tokens:", t["hit_tokens"], "{:<10}")
            row("Blocks stored / loaded:", f"{t['blocks_stored']} / {t['blocks_loaded']}")
            row("MiB stored / loaded:", f"{t['bytes_stored'] / 2**20:.1f} / {t['bytes_loaded'] / 2**20:.1f}")
            if t["blocks_loaded"]:
                row("Mean load latency per block (ms):", 1000 * t["load_seconds"] / t["blocks_loaded"])
            if t["blocks_stored"]:
                row("Mean store latency per block (ms):", 1000 * t["store_seconds"] / t["blocks_stored"])
            row("Occupancy (MiB of cap):", f"{t['bytes'] / 2**20:.1f} of {t['capacity_bytes'] / 2**20:.0f}")
            row("Errors:", t["errors"], "{:<10}")
    mm = result.get("multimodal")
    if mm:
        lines.append(f"{' Multimodal ':-^60}")
        row("Images (completed requests):", mm["images"], "{:<10}")
        row("Images per second:", mm["images_per_s"])
        row("Images encoded / in the encoder thread:", f"{mm['images_encoded']} / {mm['images_prefetched']}")
        row("Encoder seconds:", mm["encoder_seconds"])
        row("Encoder cache hits / misses:", f"{mm['encoder_cache_hits']} / {mm['encoder_cache_misses']}")
    spec = result.get("spec_decode")
    if spec:
        lines.append(f"{' Speculative decoding ':-^60}")
        row("Draft acceptance rate (%):", 100 * spec["acceptance_rate"])
        row("Mean acceptance length (tokens/step):", spec["mean_acceptance_length"])
        row("Drafted / accepted tokens:", f"{spec['num_draft_tokens']} / {spec['num_accepted_tokens']}")
        row("Accepted per draft position:", " ".join(str(v) for v in spec["accepted_per_pos"]))
    comm = result.get("comm")
    if comm:
        lines.append(f"{' Communication (rank 0) ':-^60}")
        row("Time per step (ms):", comm["ms_per_step"])
        row("Collectives and sends / MiB:", f"{comm['ops']} / {comm['bytes'] / 2**20:.1f}")
    classes = result.get("by_length_class")
    if classes:
        lines.append(f"{' By prompt length class ':-^60}")
        for c, row_ in classes.items():
            row(f"{c}: requests ok / failed:", f"{row_['completed']} / {row_['failed']}")
            row(f"{c}: TTFT P50 / P99 (ms):", f"{row_['median_ttft_ms']:.1f} / {row_.get('p99_ttft_ms', 0):.1f}")
            row(f"{c}: E2EL P50 / P99 (ms):", f"{row_['median_e2el_ms']:.1f} / {row_.get('p99_e2el_ms', 0):.1f}")
        if result.get("long_short_p99_ttft_ratio") is not None:
            row("long / short P99 TTFT:", f"{result['long_short_p99_ttft_ratio']:.2f}x")
            row("long / short P99 E2EL:", f"{result['long_short_p99_e2el_ratio']:.2f}x")
    for m in metrics:
        name = METRIC_NAMES[m]
        lines.append(f"{METRIC_HEADERS[m]:-^60}")
        row(f"Mean {name} (ms):", result[f"mean_{m}_ms"])
        row(f"Median {name} (ms):", result[f"median_{m}_ms"])
        for p in percentiles:
            if p != 50:  # P50 is the median, already shown
                row(f"P{percentile_word(p)} {name} (ms):", result[f"p{percentile_word(p)}_{m}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
