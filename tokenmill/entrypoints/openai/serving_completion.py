"""POST /v1/completions."""
from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.errors import APIError, error_dict
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_engine import ServingBase, usage
from tokenmill.entrypoints.openai.streaming import SSE_DONE, sse


def _prompts(p) -> list:
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "'prompt' must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


class OpenAIServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "'suffix' is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "'best_of' other than n is not supported", "best_of")
        prompts = _prompts(req.prompt)
        # echo + logprobs returns the prompt's logprobs too (the first prompt token has none)
        want_prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = self.sampling_params(req, req.max_tokens, req.logprobs, want_prompt_lp)
        rid, subs = self.submit(prompts, params, req.priority, "cmpl")
        created = int(time.time())
        stream = self._stream(req, rid, subs, created) if req.stream else None
        return await self.respond(raw, subs, stream, lambda: self._full(req, rid, subs, created))

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else (self.tokenizer.decode(ids) if self.tokenizer else "")

    def _echo_rows(self, prompt_rows: list, ids: list[int]) -> list:
        # n > 1: every sample reports the shared prompt's rows; one copy is the prompt's
        rows = list(prompt_rows[:len(ids)])
        return rows + [None] * (len(ids) - len(rows))

    async def _full(self, req: CompletionRequest, rid: str, subs, created: int) -> Response:
        choices, prompt_rows = await self.collect(subs, req.n)
        out, num_prompt = [], 0
        for k, (_, text, ids) in enumerate(subs):
            num_prompt += len(ids)
            for j in range(req.n):
                ch = choices[k * req.n + j]
                prefix = self._echo_text(text, ids) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    if req.echo:
                        lp = self.completion_logprobs(self._echo_rows(prompt_rows[k], ids) + ch.logprobs,
                                                      ids + [0] * len(ch.logprobs), 0)
                    else:
                        lp = self.completion_logprobs(ch.logprobs, None, 0)
                out.append({"index": ch.index, "text": prefix + ch.text, "logprobs": lp,
                            "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": out, "usage": usage(num_prompt, sum(c.num_tokens for c in choices))}
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(self, req: CompletionRequest, rid: str, subs, created: int):
        n = req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [0] * (len(subs) * n)
        started = [False] * (len(subs) * n)
        prompt_rows: list[list] = [[] for _ in subs]
        num_completion, failed = 0, False
        # closed on every exit: a break must stop the pump tasks of several prompts now
        async with contextlib.aclosing(self._interleaved(subs)) as items:
            async for k, item in items:
                if isinstance(item, Exception):
                    code = 503 if isinstance(item, EngineDeadError) else 500
                    yield sse(error_dict(code, str(item)))
                    failed = True
                    break
                _, text, ids = subs[k]
                if item.prompt_logprobs:
                    prompt_rows[k].extend(item.prompt_logprobs)
                for c in item.outputs:
                    idx = k * n + c.index
                    if not c.token_ids and c.finish_reason is None:
                        continue
                    num_completion += len(c.token_ids)
                    piece, rows, row_ids = c.text, c.logprobs, None
                    if req.echo and not started[idx]:
                        piece = self._echo_text(text, ids) + piece
                        if rows is not None:
                            rows = self._echo_rows(prompt_rows[k], ids) + rows
                            row_ids = ids + [0] * len(c.logprobs)
                    started[idx] = True
                    lp = None
                    if req.logprobs is not None and rows is not None:
                        lp = self.completion_logprobs(rows, row_ids, offsets[idx])
                    offsets[idx] += len(piece)
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [{"index": idx, "text": piece, "logprobs": lp,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
        if include_usage and not failed:
            num_prompt = sum(len(s[2]) for s in subs)
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": usage(num_prompt, num_completion)})
        yield SSE_DONE

    async def _interleaved(self, subs):
        """(prompt index, delta output or the exception that ended it) as they arrive. One prompt is read
        directly; several are pumped by one task each into a single queue."""
        if len(subs) == 1:
            try:
                async for out in self.engine.stream(subs[0][0]):
                    yield 0, out
            except Exception as e:
                yield 0, e
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, sub_id: str) -> None:
            try:
                async for out in self.engine.stream(sub_id):
                    queue.put_nowait((k, out))
            except Exception as e:
                queue.put_nowait((k, e))
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(k, s[0])) for k, s in enumerate(subs)]
        live = len(subs)
        try:
            while live:
                k, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                yield k, item
        finally:
            for t in tasks:
                t.cancel()
