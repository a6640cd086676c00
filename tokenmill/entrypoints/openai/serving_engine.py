"""What completions and chat share: model check, SamplingParams from a request, submission with error
mapping, per-choice accumulation and logprob formatting."""
from __future__ import annotations

import asyncio
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.async_llm import AsyncLLM, QueueFullError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.errors import APIError, bad_request, error_dict
from tokenmill.entrypoints.openai.streaming import SSE_DONE, SSEStream, cancel_on_disconnect, sse
from tokenmill.entrypoints.openai.structured import requested_grammar
from tokenmill.sample.grammar import GrammarError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import TokenBytes


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One choice's accumulated output (non-streaming) or running offsets (streaming)."""
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        self.token_ids += c.token_ids
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class StreamEvents(Protocol):
    """An endpoint's SSE format: synchronous, it runs inside the engine's output loop."""

    def on_output(self, k: int, out: RequestOutput) -> bytes:
        """The events for one delta of sub-request k (b"" for none)."""

    def on_end(self) -> bytes:
        """The events after every sub-request finished (the usage chunk), before [DONE]."""


class _JoinedSubs:
    """One streamed response over several sub-requests (prompts): it ends after the last one finishes,
    or at the first failure with an OpenAI-style error event (500, or 503 when the engine died)."""

    def __init__(self, events: StreamEvents, response: SSEStream, num_subs: int):
        self.events, self.response, self.live = events, response, num_subs

    def put(self, k: int, out: RequestOutput) -> None:
        data = self.events.on_output(k, out)
        if out.finished:
            self.live -= 1
            if self.live == 0:
                self.response.close(data + self.events.on_end() + SSE_DONE)
                return
        if data:
            self.response.write(data)

    def fail(self, err: BaseException) -> None:
        code = 503 if isinstance(err, EngineDeadError) else 500
        self.response.close(sse(error_dict(code, str(err))) + SSE_DONE)


class _SubSink:
    """The RequestSink of sub-request k."""

    def __init__(self, joined: _JoinedSubs, k: int):
        self.joined, self.k = joined, k

    def put(self, out: RequestOutput) -> None:
        self.joined.put(self.k, out)

    def fail(self, err: BaseException) -> None:
        self.joined.fail(err)


class ChunkEvents:
    """What both endpoints' StreamEvents share: the bytes around a chunk's choices list, encoded once per
    response rather than once per token, the completion-token count, and the closing usage chunk."""

    def __init__(self, serving: "ServingBase", req, rid: str, obj: str, created: int, num_prompt: int):
        self.serving, self.req, self.num_prompt = serving, req, num_prompt
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's counts so far (its
        # prompt's tokens, its own completion tokens), so a chunk holds one choice
        self.continuous_usage = self.include_usage and options.continuous_usage_stats
        self.head = (b'data: {"id":' + msgspec.json.encode(rid) + b',"object":' + msgspec.json.encode(obj) +
                     b',"created":' + str(created).encode() + b',"model":' +
                     msgspec.json.encode(serving.model_for(req)) + b',"choices":[')
        self.tail = b'],"usage":null}\n\n' if self.include_usage else b']}\n\n'
        self.num_completion = 0
        self.choice_tokens: dict[int, int] = {}  # choice index -> completion tokens so far

    def _head(self, extra: bytes) -> bytes:
        """`extra`: more top-level fields, encoded, each followed by a comma (chat's first chunk's prompt ids)."""
        return self.head if not extra else self.head[:-len(b'"choices":[')] + extra + b'"choices":['

    def chunk(self, encoded_choices: list[bytes], extra: bytes = b"") -> bytes:
        return self._head(extra) + b",".join(encoded_choices) + self.tail

    def choice_chunk(self, index: int, encoded_choice: bytes, num_prompt: int, num_new: int, extra: bytes = b""
                     ) -> bytes:
        """One choice's chunk after `num_new` more of its tokens (its usage so far, when continuous)."""
        self.num_completion += num_new
        if not self.continuous_usage:
            return self.chunk([encoded_choice], extra)
        n = self.choice_tokens[index] = self.choice_tokens.get(index, 0) + num_new
        return self._head(extra) + encoded_choice + self._usage_tail(num_prompt, n)

    def _usage_tail(self, num_prompt: int, num_completion: int) -> bytes:
        return b'],"usage":' + msgspec.json.encode(usage(num_prompt, num_completion)) + b"}\n\n"

    def on_end(self) -> bytes:
        """The last chunk before [DONE] when the client asked for usage: no choices, the totals."""
        return self.head + self._usage_tail(self.num_prompt, self.num_completion) if self.include_usage else b""


class ServingBase:
    def __init__(self, engine: AsyncLLM, served_names: list[str]):
        self.engine = engine
        self.served_names = served_names
        self.tokenizer = engine.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def model_for(self, req) -> str:
        """The name a response carries: the one the request asked for (any served alias), as vLLM answers."""
        return req.model or self.served_names[0]

    @staticmethod
    def check_stream_options(req) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "'stream_options' can only be set when 'stream' is true", "stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "'prompt_logprobs' is not supported with 'stream'", "prompt_logprobs")

    def prompt_logprobs(self, rows: list, ids: list[int], top_n: int) -> list:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}} for the prompt's token and the top `top_n`."""
        out = []
        for i in range(len(ids)):
            row = rows[i] if i < len(rows) else None
            out.append(None if row is None else {
                str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": self.token_str(t, lp)}
                for t, lp in top_of_row(row, top_n).items()})
        return out

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, tool_grammar=None) -> SamplingParams:
        bias = None
        if req.logit_bias:  # OpenAI's: token ids as strings, biases clamped to [-100, 100] (as vLLM); the engine
            try:  # refuses ids outside the vocabulary
                if not all(t.isascii() and t.isdigit() for t in req.logit_bias):  # ("1_0" and " 1" are int()s)
                    raise ValueError
                bias = {int(t): min(max(b, -100.0), 100.0) for t, b in req.logit_bias.items()}
            except ValueError:
                raise APIError(400, "'logit_bias' keys must be token ids", "logit_bias") from None
        kw = dict(n=req.n, max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                  logit_bias=bias, truncate_prompt_tokens=req.truncate_prompt_tokens,
                  ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
                  skip_special_tokens=req.skip_special_tokens,
                  structured_outputs=requested_grammar(req, tool_grammar), allowed_token_ids=req.allowed_token_ids,
                  bad_words=req.bad_words)
        # the model's defaults (generation_config.json) for what the request leaves unset; its max_tokens is
        # applied per prompt, within the context (AsyncLLM._process)
        defaults = self.engine.input_processor.sampling_defaults
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(req, name)
            if v is None:
                v = defaults.get(name)
            if v is not None:
                kw[name] = v
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(e) from None

    async def submit(self, prompts: list, params: SamplingParams, priority: int, prefix: str, field: str = "prompt",
                     request_id: str | None = None, grammar_field: str | None = None,
                     ) -> tuple[str, list[tuple[str, str | None, list[int]]]]:
        """Submit every prompt or none. Returns the response id and (request id, prompt text, prompt ids).
        `field`: what errors about the prompt name (chat: 'messages'); `grammar_field`: what a refused grammar's
        error names (the field it came in). `request_id`: the client's (vLLM's X-Request-Id or `request_id`), the
        response's id; the engine's ids stay unique (a client may reuse one)."""
        if priority and self.engine.config.scheduling_policy != "priority":  # it would be ignored (vLLM refuses too)
            raise APIError(400, "'priority' needs the server started with --scheduling-policy priority", "priority")
        if len(prompts) * params.n > self.engine.max_waiting_requests:
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} sequences exceed the server's queue limit "
                           f"({self.engine.max_waiting_requests})", "n")
        rid = random_id(prefix) if request_id is None else f"{prefix}-{request_id}"
        base = rid if request_id is None else f"{rid}-{uuid.uuid4().hex[:12]}"
        sub_ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        with engine_errors(field, grammar_field=grammar_field):
            done = await self.engine.add_requests(list(zip(sub_ids, prompts)), params, priority, strict_max_tokens=True)
        return rid, [(sub_id, text, ids) for sub_id, (text, ids) in zip(sub_ids, done)]

    @contextmanager
    def aborted_on_error(self, subs):
        """Between submission and the response that owns the requests (it aborts them when it ends), a
        failure (a bug building the response) must abort them: nobody would ever read them."""
        try:
            yield
        except BaseException:
            self.abort_all(subs)
            raise

    @staticmethod
    def client_request_id(req, raw) -> str | None:
        """vLLM's: the X-Request-Id header, else the body's `request_id`, else none (a random id). An empty header
        is none (a proxy may always send one; the response header gets a new id for it too)."""
        header = raw.headers.get("x-request-id") if raw is not None else None
        if header is not None and len(header) > 256:
            raise APIError(400, "the X-Request-Id header must be at most 256 characters", "request_id")
        return header or req.request_id

    def abort_all(self, subs) -> None:
        for sub_id, _, _ in subs:
            self.engine.abort(sub_id)

    def stream_response(self, subs, events: "StreamEvents") -> SSEStream:
        """An SSE response fed by the output loop: each sub-request's deltas go through `events` (the
        endpoint's chunk format) straight into the response. When it ends, for whatever reason, the
        sub-requests are aborted: a no-op for finished ones; for the rest it frees their KV blocks."""
        response = SSEStream(on_close=lambda: self.abort_all(subs))
        joined = _JoinedSubs(events, response, len(subs))
        for k, (sub_id, _, _) in enumerate(subs):
            self.engine.attach_sink(sub_id, _SubSink(joined, k))
        return response

    async def respond(self, raw: Request, subs, full: Callable[[], Awaitable[Response]]) -> Response:
        """`full()`'s response unless the client goes away first. Either way the sub-requests are aborted
        at the end (see stream_response)."""
        try:
            resp = await cancel_on_disconnect(raw, full)
        finally:
            self.abort_all(subs)
        return resp if resp is not None else Response(status_code=499)  # client is gone; nobody reads this

    async def collect(self, subs, n: int) -> tuple[list[Choice], list[list]]:
        """Non-streaming: run every sub-request to the end; choice index = prompt index * n + sample index.
        Also returns each prompt's prompt-logprob rows (when they were asked for). `respond` aborts what is
        left when it ends."""
        choices = [Choice(i) for i in range(len(subs) * n)]
        prompt_rows: list[list] = [[] for _ in subs]

        async def one(k: int, sub_id: str) -> None:
            async for out in self.engine.stream(sub_id, final_only=True):
                if out.prompt_logprobs:
                    prompt_rows[k].extend(out.prompt_logprobs)
                for c in out.outputs:
                    choices[k * n + c.index].add(c)

        tasks = [asyncio.ensure_future(one(k, s[0])) for k, s in enumerate(subs)]
        try:
            await asyncio.gather(*tasks)
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        except RuntimeError as e:  # the core failed this request's step (and kept serving)
            raise APIError(500, str(e)) from None
        finally:
            for t in tasks:  # when one sub-request fails, gather leaves the others waiting
                t.cancel()
        return choices, prompt_rows

    # -- logprobs ------------------------------------------------------------------------------------------
    def _bytes(self, tok: int, text: str) -> list[int]:
        """The token's own bytes (a piece of a character: its real bytes, not those of U+FFFD)."""
        if self.token_bytes is None:
            return list(text.encode("utf-8", "backslashreplace"))
        return self.token_bytes(tok, text)

    def token_str(self, tok: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else f"token_id:{tok}"

    def completion_logprobs(self, rows, token_ids: list[int] | None, offset: int) -> dict:
        """Legacy format. rows[i] maps token -> Logprob, the sampled (or prompt) token first; a None row
        (the first prompt token, which nothing predicts) needs token_ids[i]."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, row in enumerate(rows):
            if row is None:
                tok = token_ids[i]
                s = self.token_str(tok, None)
                out["tokens"].append(s)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                tok, lp = next(iter(row.items()))
                s = self.token_str(tok, lp)
                out["tokens"].append(s)
                out["token_logprobs"].append(_finite(lp.logprob))
                out["top_logprobs"].append({self.token_str(t, v): _finite(v.logprob) for t, v in row.items()})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def chat_logprobs(self, rows, top_n: int) -> dict:
        content = []
        for row in rows:
            items = list(row.items())
            tok, lp = items[0]
            s = self.token_str(tok, lp)
            top = sorted(items, key=lambda kv: kv[1].rank if kv[1].rank is not None else 0)[:top_n] if top_n else []
            content.append({"token": s, "logprob": _finite(lp.logprob), "bytes": self._bytes(tok, s),
                            "top_logprobs": [{"token": (ts := self.token_str(t, v)), "logprob": _finite(v.logprob),
                                              "bytes": self._bytes(t, ts)} for t, v in top]})
        return {"content": content}


def _finite(logprob: float) -> float:
    """-inf (a token a grammar or bad words ban) as vLLM sends it, -9999.0: JSON has no infinities (it went out
    as null, which OpenAI's clients refuse as a logprob)."""
    return max(logprob, -9999.0)


@contextmanager
def engine_errors(field: str = "prompt", only_field: bool = False, grammar_field: str | None = None):
    """The engine's refusals as HTTP errors: bad input 400 (its field as `param`; the engine's 'prompt' called
    `field`; with `only_field`, every refusal names `field`: the images of 'messages', whose errors quote other
    words; a refused grammar names `grammar_field`, the field it came in), queue full 429, no engine (dead, or
    the server is shutting down) 503."""
    try:
        yield
    except QueueFullError as e:
        raise APIError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    except GrammarError as e:
        raise bad_request(e, grammar_field) from None
    except ValueError as e:
        if "'prompt'" in str(e) or only_field:
            raise bad_request(str(e).replace("'prompt'", f"'{field}'"), field) from None
        raise bad_request(e) from None


def top_of_row(row: dict, top_n: int) -> dict:
    """A logprob row (the chosen or prompt token first, then the top-N by rank) cut to the top `top_n`: a
    request asking for two numbers of entries (echo's logprobs, prompt_logprobs) computes the larger."""
    items = iter(row.items())
    first = next(items)
    return dict([first] + [(t, lp) for t, lp in items if lp.rank is not None and lp.rank <= top_n])


def usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}
