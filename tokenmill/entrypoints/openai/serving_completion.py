"""POST /v1/completions."""
from __future__ import annotations

import time
from dataclasses import replace

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_engine import ChunkEvents, ServingBase, top_of_row, usage
from tokenmill.entrypoints.openai.structured import grammar_field


def _prompts(p) -> list:
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "'prompt' must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


def _prompt_only(choice):
    """Echo with max_tokens 0: the one token the engine computed is not part of the answer."""
    kw = {"num_tokens": 0} if hasattr(choice, "num_tokens") else {}  # (a whole answer's Choice, or a delta)
    return replace(choice, text="", token_ids=[], logprobs=[] if choice.logprobs is not None else None,
                   finish_reason="length", stop_reason=None, **kw)


class OpenAIServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_stream_options(req)
        if req.suffix:
            raise APIError(400, "'suffix' is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "'best_of' other than n is not supported", "best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "'max_tokens' must be >= 1 (0 only with echo: the prompt alone)", "max_tokens")
        prompts = _prompts(req.prompt)
        # echo + logprobs returns the prompt's logprobs too (the first prompt token has none), and so does
        # prompt_logprobs (vLLM's): the rows are computed once, for the larger top-N
        wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
        # (echo with max_tokens 0, OpenAI's and vLLM's: the prompt alone; one token is computed, then dropped)
        params = self.sampling_params(req, req.max_tokens or (1 if req.max_tokens == 0 else None), req.logprobs,
                                      max(wanted) if wanted else None)
        rid, subs = await self.submit(prompts, params, req.priority, "cmpl",
                                      request_id=self.client_request_id(req, raw), grammar_field=grammar_field(req))
        created = int(time.time())
        if req.stream:
            with self.aborted_on_error(subs):
                return self.stream_response(subs, _CompletionEvents(self, req, rid, subs, created))
        return await self.respond(raw, subs, lambda: self._full(req, rid, subs, created))

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else (self.tokenizer.decode(ids) if self.tokenizer else "")

    def _echo_rows(self, prompt_rows: list, ids: list[int], top_n: int) -> list:
        # n > 1: every sample reports the shared prompt's rows; one copy is the prompt's
        rows = [None if r is None else top_of_row(r, top_n) for r in prompt_rows[:len(ids)]]
        return rows + [None] * (len(ids) - len(rows))

    def _logprobs(self, rows, offset: int, echo_text: str | None = None, prompt_rows=None, ids=None, top_n: int = 0
                  ) -> tuple[dict, int]:
        """Legacy logprobs of generated `rows` starting at text `offset`, with the prompt's rows first when
        echoing, and the offset after them. Offsets add up token strings (as vLLM's do) rather than the
        text sent so far: a token that ends mid-character shows as U+FFFD while the detokenizer holds its
        bytes back, and a BOS token is in the tokens but not in the text; this way they only increase,
        and streaming and non-streaming responses agree."""
        head = None
        if echo_text is not None:
            head = self.completion_logprobs(self._echo_rows(prompt_rows, ids, top_n), ids, offset)
            offset += sum(len(t) for t in head["tokens"])
        out = self.completion_logprobs(rows, None, offset)
        end = offset + sum(len(t) for t in out["tokens"])
        if head is None:
            return out, end
        return {key: head[key] + out[key] for key in out}, end

    async def _full(self, req: CompletionRequest, rid: str, subs, created: int) -> Response:
        choices, prompt_rows = await self.collect(subs, req.n)
        out, num_prompt, num_completion = [], 0, 0
        for k, (_, text, ids) in enumerate(subs):
            num_prompt += len(ids)
            for j in range(req.n):
                ch = _prompt_only(choices[k * req.n + j]) if req.max_tokens == 0 else choices[k * req.n + j]
                num_completion += ch.num_tokens
                prefix = self._echo_text(text, ids) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._logprobs(ch.logprobs, 0, prefix if req.echo else None, prompt_rows[k], ids,
                                           req.logprobs)
                choice = {"index": ch.index, "text": prefix + ch.text, "logprobs": lp,
                          "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs(prompt_rows[k], ids, req.prompt_logprobs)
                if req.return_token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = ids, ch.token_ids
                out.append(choice)
        body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_for(req),
                "choices": out, "usage": usage(num_prompt, num_completion)}
        return Response(msgspec.json.encode(body), media_type="application/json")


class _CompletionEvents(ChunkEvents):
    """SSE chunks of a streamed completion (StreamEvents). Choice index = prompt index * n + sample index;
    echo puts the prompt before a choice's first text."""

    def __init__(self, serving: OpenAIServingCompletion, req: CompletionRequest, rid: str, subs, created: int):
        super().__init__(serving, req, rid, "text_completion", created, sum(len(s[2]) for s in subs))
        self.subs = subs
        self.offsets = [0] * (len(subs) * req.n)
        self.started = [False] * (len(subs) * req.n)
        self.sent_prompt_ids = [False] * (len(subs) * req.n)
        self.prompt_rows: list[list] = [[] for _ in subs]

    def on_output(self, k: int, out) -> bytes:
        req, serving = self.req, self.serving
        _, text, ids = self.subs[k]
        if out.prompt_logprobs:
            self.prompt_rows[k].extend(out.prompt_logprobs)
        events = []
        for c in out.outputs:
            idx = k * req.n + c.index
            if not c.token_ids and c.finish_reason is None:
                continue
            if req.max_tokens == 0:
                c = _prompt_only(c)
            piece, echo = c.text, None
            if req.echo and not self.started[idx]:
                echo = serving._echo_text(text, ids)
                piece = echo + piece
            self.started[idx] = True
            lp = None
            if req.logprobs is not None and c.logprobs is not None:
                lp, self.offsets[idx] = serving._logprobs(c.logprobs, self.offsets[idx], echo, self.prompt_rows[k], ids,
                                                          req.logprobs)
            choice = {"index": idx, "text": piece, "logprobs": lp, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if req.return_token_ids:  # (the prompt's with each choice's first chunk, as vLLM)
                choice["token_ids"] = list(c.token_ids)
                if not self.sent_prompt_ids[idx]:
                    choice["prompt_token_ids"], self.sent_prompt_ids[idx] = ids, True
            events.append(self.choice_chunk(idx, msgspec.json.encode(choice), len(ids), len(c.token_ids)))
        return b"".join(events)
