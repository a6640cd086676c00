"""`tokenmill bench offline`: throughput and latency of the in-process engine, same result format as serve.

We drive `LLMEngine.add_request` / `step` ourselves: each request is added at its arrival time (request
rate inf: all at t=0, a pure throughput run), and every step's outputs are timed as a streaming client
would see them — TTFT when a request's first token appears, ITL between steps that gave it tokens,
latency at its last token. A request's clock starts at its scheduled arrival, so time spent waiting
behind a running step counts, as it would in a server's queue.

`run_offline(requests, engine_kwargs, ...)` takes the engine's keyword arguments (or a built engine), so a
ladder can send one workload through several configurations.

A request with images (`multi_modal_data`: OpenAI content parts) goes in as the chat message a server would
build from it, [text part, *its parts], through the model's chat template; its data URIs are decoded at its
arrival, as a server would. Its input length then counts the image placeholder tokens, as a server's usage
does, and the result gains a `multimodal` block (images, encoder work and the encoder cache).
"""
from __future__ import annotations

import math
import time
from datetime import datetime

from tqdm.auto import tqdm

from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import RequestResult, compute_metrics, per_request_fields
from tokenmill.bench.resources import ResourceMonitor


def build_engine(engine_kwargs: dict):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_kwargs))


def _params(req: SampleRequest, sampling: dict, ignore_eos: bool):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=req.expected_output_len, ignore_eos=ignore_eos,
                          **{k: v for k, v in sampling.items() if v is not None})


def _engine_prompt(engine, req: SampleRequest, parts: list[dict] | None = None):
    """(the prompt to add, images in it: one per image, one per sampled video frame)."""
    parts = req.multi_modal_data if parts is None else parts
    if not parts:
        return req.prompt, 0
    text = req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(req.prompt)
    prompt = engine.input_processor.chat_prompt([{"role": "user", "content": [{"type": "text", "text": text}, *parts]}])
    items = prompt.get("multi_modal_data", {}).get("items", [])
    return prompt, sum(len(x) if kind == "video" else 1 for kind, x in items)


def _warmup_prompt(engine, req: SampleRequest):
    """The first request's text; with images, one flat grey image that no request carries, so the warm-up
    runs the encoder yet leaves no encoder-cache hit behind for the measured run."""
    if not req.multi_modal_data:
        return req.prompt
    from PIL import Image

    return _engine_prompt(engine, req, [{"type": "image", "image": Image.new("RGB", (64, 64), (127, 127, 127))}])[0]


def _encoder_counters(engine) -> dict | None:
    """The engine's cumulative encoder counters; None for a text-only model (or an engine core elsewhere)."""
    core = getattr(engine, "core", None)
    encoder = getattr(getattr(core, "runner", None), "encoder", None)
    if encoder is None:
        return None
    cache = core.scheduler.encoder.cache
    return {"images_encoded": encoder.images_encoded, "images_prefetched": encoder.images_prefetched,
            "encoder_seconds": encoder.encode_seconds, "encoder_cache_hits": cache.hits,
            "encoder_cache_misses": cache.misses}


def _multimodal_block(before: dict | None, after: dict | None, images: int, duration: float) -> dict | None:
    """What the measured run (not the warm-up) asked of the encoder. images: those in completed requests."""
    if after is None:
        return None
    out = {k: after[k] - before[k] for k in after}
    out.update(images=images, images_per_s=images / duration if duration > 0 else 0.0)
    return out


def _drain(engine, ids: set[str]) -> None:
    while ids:
        for out in engine.step():
            if out.finished:
                ids.discard(out.request_id)


def run_offline(requests: list[SampleRequest], engine_kwargs: dict | None = None, *, engine=None,
                request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                sampling: dict | None = None, num_warmups: int = 1, percentiles=(50, 90, 99),
                goodput_slos_ms: dict | None = None, disable_tqdm: bool = False) -> dict:
    """Run the workload through one engine and return the result dict (aggregates + per-request samples)."""
    if engine is None:
        engine = build_engine(engine_kwargs or {})
    sampling = sampling or {}
    multimodal = any(r.multi_modal_data for r in requests)
    if multimodal and getattr(getattr(engine, "input_processor", None), "mm", None) is None:
        raise ValueError("the workload carries images but the model takes none: use a multimodal (LLaVA) model")
    params = [_params(r, sampling, ignore_eos) for r in requests]
    # warm-up: one-off costs (allocator, kernel selection, first-call paths) stay out of the measurement
    if num_warmups and requests:
        warm_prompt = _warmup_prompt(engine, requests[0])
        warm = {engine.add_request(f"warmup-{i}", warm_prompt, params[0]) for i in range(num_warmups)}
        _drain(engine, warm)
    counters = _encoder_counters(engine) if multimodal else None
    before = engine.get_stats() if hasattr(engine, "get_stats") else None  # (the warm-up's counts stay out)
    images = [0] * len(requests)

    n = len(requests)
    offsets = arrival_times(n, request_rate, burstiness, seed)
    order = sorted(range(n), key=lambda i: offsets[i])
    results = [RequestResult(prompt_len=r.prompt_len, start_time=offsets[i], output_tokens_source="engine",
                             length_class=r.length_class) for i, r in enumerate(requests)]
    index: dict[str, int] = {}
    seen = [0] * n
    last = [0.0] * n
    done = nxt = 0
    bar = tqdm(total=n, disable=disable_tqdm, desc="bench offline", dynamic_ncols=True)
    device = getattr(getattr(engine, "config", None), "device", "cpu")
    with ResourceMonitor(device=device) as mon:
        t0 = time.perf_counter()
        while done < n:
            now = time.perf_counter() - t0
            while nxt < n and offsets[order[nxt]] <= now:
                i = order[nxt]
                nxt += 1
                rid = requests[i].request_id or f"bench-{i}"
                try:
                    prompt, images[i] = _engine_prompt(engine, requests[i])
                    engine.add_request(rid, prompt, params[i], arrival_time=time.time() - (now - offsets[i]))
                    index[rid] = i
                except ValueError as e:  # e.g. prompt longer than max_model_len: a failed request
                    results[i].error = str(e)
                    done += 1
                    bar.update(1)
            if not engine.has_unfinished_requests():
                if nxt >= n:  # nothing queued or running, yet some request never finished: don't spin
                    for r in results:
                        if not r.success and not r.error:
                            r.error = "the engine dropped the request"
                    break
                time.sleep(max(0.0, offsets[order[nxt]] - (time.perf_counter() - t0)))
                continue
            outs = engine.step()
            t = time.perf_counter() - t0
            for out in outs:
                i = index.get(out.request_id)
                if i is None:
                    continue
                r, c = results[i], out.outputs[0]
                k = len(c.token_ids)
                if k > seen[i]:
                    if seen[i] == 0:
                        r.ttft = t - r.start_time
                        if images[i]:  # the engine's prompt: the chat template's and the images' tokens too
                            r.prompt_len = len(out.prompt_token_ids)
                    else:
                        r.itl.append(t - last[i])
                    last[i], seen[i] = t, k
                if out.finished:
                    r.output_tokens, r.generated_text = k, c.text
                    r.success = k > 0 and c.finish_reason != "abort"
                    r.latency = last[i] - r.start_time if k else t - r.start_time
                    if not r.success:
                        r.error = f"finished with {k} tokens, finish_reason={c.finish_reason}"
                    done += 1
                    bar.update(1)
        duration = time.perf_counter() - t0
    bar.close()
    cfg = getattr(engine, "config", None)
    result = {
        "kind": "offline",
        "date": datetime.now().isoformat(timespec="seconds"),
        "backend": "tokenmill-offline",
        "model_id": getattr(cfg, "model", None),
        "engine_kwargs": {k: v for k, v in (engine_kwargs or {}).items() if _jsonable(v)},
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness, "max_concurrency": None, "num_prompts": n,
        "ignore_eos": ignore_eos, "sampling": sampling,
        "percentiles": list(percentiles), "goodput_slos_ms": goodput_slos_ms or None,
    }
    result.update(compute_metrics(results, duration, list(percentiles), goodput_slos_ms))
    if before is not None:
        result.update(_engine_blocks(before, engine.get_stats()))
    if multimodal:
        done_images = sum(c for c, r in zip(images, results) if r.success)
        result["multimodal"] = _multimodal_block(counters, _encoder_counters(engine), done_images, duration)
    result.update(mon.summary())
    result.update(per_request_fields(results))
    return result


# a tier's gauges (occupancy now), reported as they are; its other fields are counters, differenced
_TIER_GAUGES = ("blocks", "bytes", "capacity_bytes")


def _engine_blocks(before, after) -> dict:
    """The run's kv_cache, spec_decode and comm blocks: the engine's counters after the run less before it
    (the warm-up, and earlier runs on a passed-in engine, stay out, as `bench serve` takes /metrics deltas)."""
    def d(name):
        return getattr(after, name) - getattr(before, name)
    queries, hits = d("prefix_cache_queries"), d("prefix_cache_hits")
    tiers = {name: {k: v if k in _TIER_GAUGES else v - before.kv_tiers.get(name, {}).get(k, 0)
                    for k, v in stats.items()} for name, stats in after.kv_tiers.items()}
    out = {"kv_cache": {"prefix_cache_hit_rate": hits / queries if queries else 0.0,
                        "num_preemptions": d("num_preemptions"), "tiers": tiers}}
    drafts, draft_tokens, accepted = d("spec_num_drafts"), d("spec_num_draft_tokens"), d("spec_num_accepted_tokens")
    if drafts:
        per_pos = [a - (before.spec_accepted_per_pos[i] if i < len(before.spec_accepted_per_pos) else 0)
                   for i, a in enumerate(after.spec_accepted_per_pos)]
        out["spec_decode"] = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                              "accepted_per_pos": per_pos,
                              "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                              "mean_acceptance_length": 1.0 + accepted / drafts}
    if d("comm_ops"):
        out["comm"] = {"seconds": d("comm_seconds"), "ops": d("comm_ops"), "bytes": d("comm_bytes"),
                       "ms_per_step": 1e3 * d("comm_seconds") / max(1, d("num_steps"))}
    return out


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, list, dict))
