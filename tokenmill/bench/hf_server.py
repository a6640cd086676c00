"""An outside reference: Hugging Face transformers with static batching, behind tokenmill's OpenAI endpoint
shape (/v1/completions streaming and not, /v1/models), so `tokenmill bench serve` measures it exactly as it
measures tokenmill.

    python -m tokenmill.bench.hf_server --model DIR --port 8001 --max-batch-size 8

Static batching, honestly: a batch starts when it is full or --batch-timeout-ms after its first request
arrived; it runs to completion (rows that finish early keep their slot and are computed to the end, as
with `generate` on a padded batch); requests arriving meanwhile wait for the next batch. The decode loop
is `generate`'s greedy/sampling loop written out (left padding, one KV cache per batch), so each token is
streamed the moment it is sampled.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Req:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("token", (id, finish_reason|None)) | ("error", msg)
    arrival: float = field(default_factory=time.monotonic)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class StaticBatcher:
    """One worker thread: collect a batch, run it to the end, repeat."""

    def __init__(self, model, eos_ids: set[int], pad_id: int, max_batch_size: int, batch_timeout_s: float):
        self.model, self.eos_ids, self.pad_id = model, eos_ids, pad_id
        self.max_batch_size, self.batch_timeout_s = max_batch_size, batch_timeout_s
        self.pending: queue.Queue[_Req] = queue.Queue()
        self.batch_sizes: list[int] = []  # one entry per batch run, for /debug/batches
        # transformers >= 5.x names the KV cache argument `cache` (past_key_values is deprecated)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # as `generate` does
        threading.Thread(target=self._loop, daemon=True, name="hf-static-batcher").start()

    def submit(self, req: _Req) -> None:
        self.pending.put(req)

    def _collect(self) -> list[_Req]:
        batch = [self.pending.get()]
        # the wait counts from the first request's arrival: one queued during the last batch has waited already
        deadline = batch[0].arrival + self.batch_timeout_s
        while len(batch) < self.max_batch_size:
            left = deadline - time.monotonic()
            try:  # past the deadline, still take whatever is already queued
                batch.append(self.pending.get(timeout=left) if left > 0 else self.pending.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._collect()
            try:
                self.run_batch(batch)
            except Exception as e:  # a broken batch fails its requests, not the server
                for r in batch:
                    r.emit("error", f"{type(e).__name__}: {e}")
            self.batch_sizes.append(len(batch))

    def _sample(self, logits: torch.Tensor, batch: list[_Req], gens: list) -> list[int]:
        out = []
        for i, r in enumerate(batch):
            row = logits[i].float()
            if r.temperature == 0:
                out.append(int(row.argmax()))
                continue
            row = row / r.temperature
            if r.top_k and r.top_k > 0:
                kth = torch.topk(row, min(r.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if r.top_p < 1.0:
                sp, si = probs.sort(descending=True)
                drop = sp.cumsum(-1) - sp > r.top_p  # keep the smallest prefix reaching top_p
                probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
            out.append(int(torch.multinomial(probs, 1, generator=gens[i])))
        return out

    @torch.inference_mode()
    def run_batch(self, batch: list[_Req]) -> None:
        from transformers import DynamicCache

        dev = self.model.device
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's next token lands in the last column
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = []
        for r in batch:
            g = torch.Generator()
            g.manual_seed(r.seed if r.seed is not None else random.getrandbits(63))
            gens.append(g)
        cache = DynamicCache()
        produced = [0] * len(batch)
        done = [False] * len(batch)
        steps = max(r.max_tokens for r in batch)
        for _ in range(steps):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                **{self._cache_kw: cache}, **self._extra).logits[:, -1, :]
            toks = self._sample(logits, batch, gens)
            for i, (r, t) in enumerate(zip(batch, toks)):
                if done[i]:
                    continue
                produced[i] += 1
                reason = "length" if produced[i] >= r.max_tokens else (
                    "stop" if t in self.eos_ids and not r.ignore_eos else None)
                done[i] = reason is not None
                r.emit("token", (t, reason))  # the last token carries its finish reason: no empty extra chunk
            if all(done):
                break  # `generate` also stops once every row has finished
            ids = torch.tensor(toks, dtype=torch.long, device=dev)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1


class _Detok:
    """Incremental detokenizer: emits only text that can no longer change (no dangling UTF-8 pieces)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def add(self, tid: int, final: bool = False) -> str:
        self.ids.append(tid)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new


def _error(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "BadRequestError" if status < 500 else "InternalError",
                                   "param": None, "code": status}}, status_code=status)


def build_app(model_path: str, served_name: str | None = None, max_batch_size: int = 8,
              batch_timeout_s: float = 0.05, dtype: str = "float32", max_model_len: int | None = None,
              device: str = "cpu") -> FastAPI:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device).eval()
    cfg_eos = model.generation_config.eos_token_id
    eos = set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    limit = max_model_len or getattr(model.config, "max_position_embeddings", 2048)
    batcher = StaticBatcher(model, eos, pad, max_batch_size, batch_timeout_s)
    name = served_name or model_path
    app = FastAPI(title="tokenmill hf reference server")
    app.state.batcher = batcher

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/debug/batches")
    async def batches():
        return {"max_batch_size": max_batch_size, "batch_sizes": batcher.batch_sizes}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hf-reference",
                                            "root": model_path, "max_model_len": limit}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "body is not valid JSON")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return _error(400, "'prompt' must be one string or one list of token ids")
        if body.get("n", 1) != 1:
            return _error(400, "only n=1 is supported")
        max_tokens = body.get("max_tokens") or 16
        if len(ids) + max_tokens > limit:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {limit}")
        temp = body.get("temperature")
        r = _Req(ids, int(max_tokens), 1.0 if temp is None else float(temp), float(body.get("top_p") or 1.0),
                 int(body.get("top_k") or 0), bool(body.get("ignore_eos", False)), body.get("seed"),
                 asyncio.get_running_loop())
        batcher.submit(r)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": name}
        usage = lambda n: {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}  # noqa
        if not body.get("stream"):
            det, n, reason = _Detok(tok), 0, None
            text = []
            while reason is None:
                kind, v = await r.events.get()
                if kind == "error":
                    return _error(500, v)
                n += 1
                reason = v[1]
                text.append(det.add(v[0], final=reason is not None))
            return {**head, "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                                         "finish_reason": reason}], "usage": usage(n)}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            det, n = _Detok(tok), 0
            while True:
                kind, v = await r.events.get()
                if kind == "error":
                    yield sse({"error": {"message": v, "type": "InternalError", "code": 500}})
                    break
                # one chunk per token, sent as soon as it is sampled
                n += 1
                tid, reason = v
                yield sse({**head, "choices": [{"index": 0, "text": det.add(tid, final=reason is not None),
                                                "logprobs": None, "finish_reason": reason}]})
                if reason is not None:
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage(n)})
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-timeout-ms", type=float, default=50.0,
                   help="how long a batch waits to fill after its first request")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    import uvicorn

    app = build_app(args.model, args.served_model_name, args.max_batch_size, args.batch_timeout_ms / 1000,
                    args.dtype, args.max_model_len, args.device)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
