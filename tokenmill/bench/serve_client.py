"""`tokenmill bench serve`: an async load generator for any OpenAI-compatible server.

Streams every request (/v1/completions, or /v1/chat/completions) with `stream_options.include_usage`, and
times chunks on the client as `vllm bench serve` does: TTFT at the first chunk with choices, ITL between
such chunks, latency at the last one. Output token counts come from the server's `usage` when it sends
one, else from the tokenizer, else one per chunk. Arrivals follow --request-rate / --burstiness, capped
by --max-concurrency (time spent waiting for a slot is the request's queue_time, not its latency).
A server that speculates and exposes its counters on /metrics (tokenmill, vLLM) also gets the run's draft
acceptance figures (bench/server_metrics.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import traceback
from datetime import datetime

import aiohttp
from tqdm.asyncio import tqdm

from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import RequestResult, compute_metrics, per_request_fields
from tokenmill.bench.server_metrics import scrape_spec_counters, spec_decode_delta

TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


def resolve_endpoint(endpoint: str) -> str:
    """'chat' / 'completions' shorthands, or a path."""
    return {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH}.get(endpoint, endpoint)


async def _sse_events(response: aiohttp.ClientResponse):
    """Yield each SSE `data:` payload as it arrives (lines can split across network reads)."""
    buf = b""
    async for piece in response.content.iter_any():
        buf += piece
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8")
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip().decode("utf-8")


def _is_role_opener(choices: list) -> bool:
    """Chat servers may open with {"role": "assistant", "content": ""} before any token is computed;
    that chunk carries no token, so it must not stop the TTFT clock."""
    deltas = [c.get("delta") or {} for c in choices]
    return all("role" in d and not d.get("content") and not c.get("finish_reason")
               for d, c in zip(deltas, choices))


def _chunk_text(choices: list, chat: bool) -> str:
    c = choices[0]
    return ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""


def build_payload(req: SampleRequest, model: str, chat: bool, tokenizer, ignore_eos: bool,
                  sampling: dict, extra_body: dict | None) -> dict:
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(req.prompt)
        content = [{"type": "text", "text": text}] + req.multi_modal_data if req.multi_modal_data else text
        payload = {"model": model, "messages": [{"role": "user", "content": content}],
                   "max_completion_tokens": req.expected_output_len}
    else:
        payload = {"model": model, "prompt": req.prompt, "max_tokens": req.expected_output_len}
    payload.update(stream=True, stream_options={"include_usage": True})
    payload.update({k: v for k, v in sampling.items() if v is not None})
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict, chat: bool,
                       prompt_len: int, t0: float) -> RequestResult:
    """One streamed request; never raises (failures come back as success=False with the error)."""
    out = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    out.start_time = st - t0
    last = st
    text = []
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            first = True
            async for data in _sse_events(resp):
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg and not msg.get("choices"):
                    out.error = json.dumps(msg["error"])[:500]
                    return out
                choices = msg.get("choices")
                if choices and not (chat and _is_role_opener(choices)):
                    if first:
                        out.ttft, first = now - st, False
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(_chunk_text(choices, chat))
                elif usage := msg.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or 0
                    if out.output_tokens:  # (0 or null: counted from the text instead, as vLLM does)
                        out.output_tokens_source = "usage"
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = usage["prompt_tokens"]
            out.generated_text = "".join(text)
            out.latency = last - st
            out.success = not first
            if first:
                out.error = "the stream carried no token-bearing chunk"
    except Exception:
        out.error = traceback.format_exc(limit=3)
    return out


def _fill_output_tokens(results: list[RequestResult], tokenizer) -> None:
    """Requests whose server sent no usage: count with the tokenizer, else one token per chunk."""
    for r in results:
        if r.success and not r.output_tokens_source:
            if tokenizer is not None:
                r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
                r.output_tokens_source = "tokenizer"
            else:
                r.output_tokens = len(r.itl) + 1
                r.output_tokens_source = "chunks"


async def fetch_first_model(base_url: str, headers: dict) -> str:
    """The first model the server lists; ValueError (one line, naming the URL) where it lists none."""
    url = f"{base_url}/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(url, headers=headers) as r:
                if r.status != 200:
                    hint = ("; pass --api-key KEY (or set OPENAI_API_KEY)" if r.status in (401, 403) else
                            "; is it an OpenAI-compatible server? (or name the model with --model)")
                    raise ValueError(f"{url} answered HTTP {r.status} {r.reason or ''}".rstrip() + hint)
                body = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"{url}: {e or type(e).__name__}") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url} did not answer with JSON; is it an OpenAI-compatible server?") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ValueError(f"{url} did not answer with an OpenAI model list ({{\"data\": [{{\"id\": ...}}]}})")
    if not data:
        raise ValueError(f"{url} lists no models")
    return data[0]["id"]


def auth_headers(api_key: str | None) -> dict:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_benchmark(requests: list[SampleRequest], base_url: str, model: str, *, endpoint: str = "completions",
                        tokenizer=None, request_rate: float = math.inf, burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0, ignore_eos: bool = False,
                        sampling: dict | None = None, extra_body: dict | None = None, api_key: str | None = None,
                        num_warmups: int = 0, percentiles=(50, 90, 99), goodput_slos_ms: dict | None = None,
                        disable_tqdm: bool = False) -> dict:
    """Send `requests` on their arrival schedule and return the result dict (aggregates + per-request samples)."""
    if max_concurrency is not None and max_concurrency <= 0:
        raise ValueError("--max-concurrency must be positive")
    path = resolve_endpoint(endpoint)
    chat = path.rstrip("/").endswith("chat/completions")
    url = base_url.rstrip("/") + path
    headers = auth_headers(api_key)
    sampling = sampling or {}
    payloads = [build_payload(r, model, chat, tokenizer, ignore_eos, sampling, extra_body) for r in requests]
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:
        for _ in range(num_warmups):  # one at a time: warm caches and the connection, measure nothing
            await send_request(session, url, payloads[0], headers, chat, requests[0].prompt_len, 0.0)
        spec_before = await scrape_spec_counters(session, base_url, headers)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="bench serve", dynamic_ncols=True)
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            arrived = time.perf_counter()
            async with sem:
                res = await send_request(session, url, payloads[i], headers, chat, requests[i].prompt_len, t0)
            res.queue_time = res.start_time - (arrived - t0)
            res.length_class = requests[i].length_class
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t0
        bar.close()
        spec = spec_decode_delta(spec_before, await scrape_spec_counters(session, base_url, headers))
    _fill_output_tokens(results, tokenizer)
    result = {
        "kind": "serve",
        "date": datetime.now().isoformat(timespec="seconds"),
        "backend": "openai-chat" if chat else "openai",
        "base_url": base_url, "endpoint": path, "model_id": model,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness, "max_concurrency": max_concurrency, "num_prompts": len(requests),
        "ignore_eos": ignore_eos, "sampling": sampling,
        "percentiles": list(percentiles), "goodput_slos_ms": goodput_slos_ms or None,
    }
    result.update(compute_metrics(results, duration, list(percentiles), goodput_slos_ms))
    result.update(per_request_fields(results))
    if spec is not None:  # the server speculates: its counters' difference over the run
        result["spec_decode"] = spec
    return result
