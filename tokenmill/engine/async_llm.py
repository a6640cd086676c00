"""AsyncLLM: the API process's engine. Tokenizes and detokenizes here; the EngineCore steps in its own
process (core_proc) and talks to us over ZeroMQ. One asyncio task reads core outputs and routes them
into per-request streams; `generate()` is an async iterator of delta RequestOutputs."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import AsyncIterator, Callable, Protocol

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.core import EngineStats
from tokenmill.engine.core_client import CoreClient, EngineDeadError
from tokenmill.engine.detokenizer import append_text
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.messages import (INTERNAL_ERROR_PREFIX, AbortRequests, AddRequest, CoreDead, CoreOutputs,
                                       EngineCoreRequest, FinishRequests, UtilityCall, UtilityResult)
from tokenmill.engine.metrics import ServerMetrics
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.models.loader import load_hf_config
from tokenmill.outputs import RequestOutput
from tokenmill.sample.grammar import compile_threads
from tokenmill.sampling_params import SamplingParams

MEDIA_THREADS = 4  # requests whose media are fetched and decoded at once (each request's parts in turn)

logger = logging.getLogger("tokenmill")


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-waiting-requests allows; the client should retry later."""


class RequestSink(Protocol):
    """Takes a request's outputs synchronously, inside the output loop, instead of a reader task (the
    server's SSE streams: no task wake-up and no async-generator layers per token). Must not block."""

    def put(self, out: RequestOutput) -> None: ...

    def fail(self, err: BaseException) -> None: ...


class _DiscardSink:
    """Replaces a sink that raised: the rest of its request's outputs go nowhere until it is aborted."""

    def put(self, out: RequestOutput) -> None:
        pass

    def fail(self, err: BaseException) -> None:
        pass


class _RequestStream:
    """Holds at most one pending delta: a slow consumer gets the merged deltas, so memory per request
    stays bounded by its own output, never by how far the engine ran ahead. Due deltas wake the reader
    of `get()`, or go straight to `sink` when one is attached."""

    def __init__(self):
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.last_token_time: float | None = None
        # wake the consumer once this many new tokens are pending (0: only when the request finishes)
        self.wake_every = 1
        self.delivered = False
        self.sink: RequestSink | None = None

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else _merge(self.pending, out)
        if out.finished or (self.wake_every and self._due()):
            if self.sink is None:
                self.event.set()
            else:
                self._push()

    def _due(self) -> bool:
        """The first tokens go out at once (time to first token); later ones every `wake_every` tokens of
        each choice (n > 1: the choices step together)."""
        if not self.delivered:
            return True
        return max((len(c.token_ids) for c in self.pending.outputs), default=0) >= self.wake_every

    def _push(self) -> None:
        try:
            self.sink.put(self._take())
        except Exception as e:  # a formatting bug must fail this request, not the output loop
            logger.exception("output sink failed")
            sink, self.sink = self.sink, _DiscardSink()
            sink.fail(RuntimeError(f"internal error: {type(e).__name__}: {e}"))

    def fail(self, err: BaseException) -> None:
        self.error = err
        if self.sink is not None:
            if self.pending is not None:  # tokens held back by --stream-interval go out before the error
                self._push()
            self.sink.fail(err)
        self.event.set()

    def _take(self) -> RequestOutput:
        out, self.pending, self.delivered = self.pending, None, True
        return out

    async def get(self) -> RequestOutput:
        await self.event.wait()
        if self.error is None:
            self.event.clear()  # after a failure it stays set: the next get() raises
        if self.pending is None and self.error is not None:
            raise self.error
        return self._take()


def _needs_tokenizer(prompt) -> bool:
    """Tokenizing, and decoding + preprocessing images, run on the tokenizer thread, off the event loop."""
    return isinstance(prompt, str) or (isinstance(prompt, dict) and ("prompt_token_ids" not in prompt
                                                                     or bool(prompt.get("multi_modal_data"))))


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Fold delta `b` into pending `a`. Lists and the text grow in place (each delta owns fresh slices), so a
    request read only at its end (final_only) costs O(tokens), not O(tokens^2)."""
    pending = {c.index: c for c in a.outputs}
    for cb in b.outputs:  # by index: n > 1 followers start a step after their leader, so deltas differ in choices
        ca = pending.get(cb.index)
        if ca is None:
            a.outputs.append(cb)
            continue
        append_text(ca, "text", cb.text)  # in place: a long non-streaming output merges a delta per step
        ca.token_ids.extend(cb.token_ids)
        if ca.logprobs is not None and cb.logprobs is not None:
            ca.logprobs.extend(cb.logprobs)
        ca.cumulative_logprob = cb.cumulative_logprob
        ca.finish_reason = ca.finish_reason or cb.finish_reason
        ca.stop_reason = ca.stop_reason if ca.stop_reason is not None else cb.stop_reason
    a.outputs.sort(key=lambda c: c.index)
    if a.prompt_logprobs is not None and b.prompt_logprobs is not None:
        a.prompt_logprobs.extend(b.prompt_logprobs)
    a.finished, a.num_cached_tokens = b.finished, b.num_cached_tokens
    return a


class AsyncLLM:
    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024, served_model_name: str | None = None,
                 log_requests: bool = True, log_level: int = logging.INFO, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"'stream_interval' must be >= 1, got {stream_interval}")
        self.config = config
        self.stream_interval = stream_interval
        model_config = ModelConfig.from_hf(load_hf_config(config.model))
        config.resolve(model_config)  # max_model_len etc., the same values the core will compute
        self.model_config = model_config
        self.input_processor = InputProcessor.from_config(config, model_config)
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer, delta=True)
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        self.metrics = ServerMetrics(served_model_name or config.model)
        self.streams: dict[str, _RequestStream] = {}
        self._pending: set[str] = set()  # child ids admitted but without a first token yet
        self._calls: dict[int, asyncio.Future] = {}
        self._call_id = 0
        self.stats: EngineStats | None = None
        self.dead: str | None = None
        self.closing: str | None = None  # set by stop_accepting(): new requests get EngineDeadError(closing)
        self.on_dead: Callable[[str], None] | None = None  # called once the core is gone (the server exits)
        self.num_submitting = 0  # requests between admission and registration (tokenizing)
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer")
        self._grammar_pool = ThreadPoolExecutor(max_workers=compile_threads(), thread_name_prefix="tokenmill-grammar")
        # chat requests' images and video fetched and decoded side by side, off the tokenizer thread
        self._media_pool = ThreadPoolExecutor(max_workers=MEDIA_THREADS, thread_name_prefix="tokenmill-media")
        self.client = CoreClient(config, log_level)
        self._tasks: list[asyncio.Task] = []

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    async def start(self) -> None:
        ready = await self.client.wait_ready()
        logger.info("engine core ready (pid %d): %d KV blocks, max_model_len %d", self.client.proc.pid,
                    ready.num_kv_blocks, ready.max_model_len)
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_core())]

    # -- requests ----------------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_unfinished(self) -> int:
        """Requests whose outputs have not all been read yet."""
        return len(self.streams)

    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, strict_max_tokens: bool = False) -> tuple[str | None, list[int]]:
        """Validate and submit, tokenizing on the caller's thread. Returns (prompt text, prompt token ids).
        Raises ValueError (bad input), QueueFullError (admission) or EngineDeadError. `strict_max_tokens`:
        refuse (as OpenAI does) a max_tokens that cannot fit in the context instead of stopping at
        max_model_len."""
        self._check_open()
        processed = self._process([(request_id, prompt)], params, priority, arrival_time, strict_max_tokens)
        self._submit(processed)
        return processed[0][0], processed[0][1].prompt_token_ids

    async def add_requests(self, prompts: list[tuple[str, object]], params: SamplingParams, priority: int = 0,
                           strict_max_tokens: bool = False) -> list[tuple[str | None, list[int]]]:
        """Submit every (request id, prompt) or none, as add_request does; text prompts are tokenized on
        the tokenizer thread, so a long tokenization never stalls the event loop (other streams, /health)."""
        self._check_open()
        self.num_submitting += 1
        try:
            args = (prompts, params, priority, time.time(), strict_max_tokens)
            if params.structured_outputs is not None:
                await self._check_grammar(params.structured_outputs)
            if (params.structured_outputs is not None or params.bad_words
                    or any(_needs_tokenizer(p) for _, p in prompts)):
                processed = await self.run_tokenizer(self._process, *args)
            else:
                processed = self._process(*args)
            self._check_open()  # the engine may have died or started closing meanwhile
            self._submit(processed)
        finally:
            self.num_submitting -= 1
        return [(text, req.prompt_token_ids) for text, req in processed]

    async def run_media(self, fn, *args):
        """`fn(*args)` on a media thread: fetching and decoding images, which needs no tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._media_pool, fn, *args)

    async def run_tokenizer(self, fn, *args):
        """`fn(*args)` on the tokenizer thread (one thread: Hugging Face tokenizers are not safe to share
        between threads that tokenize at once; its Rust code releases the GIL meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.closing is not None:
            raise EngineDeadError(self.closing)

    async def _check_grammar(self, spec) -> None:
        """Parse (a bad grammar's ValueError reaches the caller; the engine compiles it) on a thread of its own:
        a large schema must not hold up other requests' tokenizing. The first one builds the tokenizer's info
        for xgrammar, which reads the tokenizer: on the tokenizer thread (Hugging Face tokenizers are not safe
        to share between threads)."""
        grammars = self.input_processor.grammars
        if not grammars.made:
            await self.run_tokenizer(grammars.validate, spec)
        else:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.validate, spec)

    def _process(self, prompts, params: SamplingParams, priority: int, arrival_time: float | None,
                 strict_max_tokens: bool) -> list[tuple[str | None, EngineCoreRequest]]:
        """Tokenize and validate; touches no state, so it may run on any thread."""
        out = []
        default_max = self.input_processor.sampling_defaults.get("max_tokens")  # the model's max_new_tokens
        for request_id, prompt in prompts:
            text, req = self.input_processor.process(request_id, prompt, params, arrival_time or time.time(),
                                                     priority)
            n_prompt = len(req.prompt_token_ids)
            if params.max_tokens is None and default_max is not None and n_prompt < self.max_model_len:
                # (a default, not the request's: capped by the context where OpenAI's rule would refuse it)
                # (never below the request's own min_tokens: the client set no max_tokens to conflict with it)
                req.params = replace(req.params, max_tokens=min(max(default_max, params.min_tokens),
                                                                self.max_model_len - n_prompt))
            if params.min_tokens and n_prompt + params.min_tokens > self.max_model_len:
                raise ValueError(f"'min_tokens' ({params.min_tokens}) does not fit: this model's maximum context "
                                 f"length is {self.max_model_len} tokens and the prompt has {n_prompt}")
            if strict_max_tokens and params.max_tokens is None and n_prompt >= self.max_model_len:
                raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                 f"'prompt' is {n_prompt}: it leaves no room for a completion")
            if strict_max_tokens and params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
                raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                 f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                                 f"{params.max_tokens} for the completion). Please reduce 'max_tokens' or the prompt.")
            out.append((text, req))
        return out

    def _submit(self, processed: list[tuple[str | None, EngineCoreRequest]]) -> None:
        """Register and send the requests as one unit. Everything that can refuse them runs before any
        state changes (encoding the messages included: a stop string UTF-8 cannot encode used to fail after
        the request was registered, leaving its sequences pending for good); if anything raises after that,
        whatever was registered is taken down again, and the core told to drop what it was sent."""
        msgs = [self.client.encode(AddRequest(req)) for _, req in processed]
        ids = [req.request_id for _, req in processed]
        if len(set(ids)) < len(ids) or any(rid in self.streams for rid in ids):
            raise ValueError(f"request_id {ids[0]!r} is already in use")
        children = sum(len(req.child_ids) for _, req in processed)
        if len(self._pending) + children > self.max_waiting_requests:
            self.metrics.rejected.inc()
            raise QueueFullError(f"the server is at capacity ({len(self._pending)} requests waiting); retry later")
        registered, sent = [], []
        try:
            for (text, req), msg in zip(processed, msgs):
                registered.append(req)
                self.output_processor.add_request(text, req)
                self.streams[req.request_id] = _RequestStream()
                self._pending.update(req.child_ids)
                self.client.send_encoded(msg)
                sent.append(req)
        except BaseException:
            for req in registered:
                self._forget(req, tell_core=req in sent)
            raise
        self.metrics.observe_arrivals(children)

    def _forget(self, req: EngineCoreRequest, tell_core: bool) -> None:
        """Undo a registration (no metrics: the request never ran)."""
        self.output_processor.abort([req.request_id])
        self.streams.pop(req.request_id, None)
        self._pending.difference_update(req.child_ids)
        if tell_core and self.dead is None:
            self.client.send(AbortRequests(req.child_ids))

    async def stream(self, request_id: str, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Delta outputs of a submitted request, merged `stream_interval` tokens at a time (the last delta
        may be shorter). Closing or cancelling the iterator aborts the request. `final_only`: yield one
        merged output when the request finishes."""
        stream = self.streams[request_id]
        stream.wake_every = 0 if final_only else self.stream_interval
        finished = False
        held: RequestOutput | None = None  # final_only: deltas that woke us before this call set wake_every
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if finished:
                    self.streams.pop(request_id, None)
                if final_only:
                    held = out if held is None else _merge(held, out)
                    if not finished:
                        continue
                    out = held
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def attach_sink(self, request_id: str, sink: RequestSink) -> None:
        """Hand a submitted request's delta outputs (merged `stream_interval` tokens at a time) and its
        failure to `sink` from now on, instead of `stream()`. Call it right after `add_request`, before
        any await. Aborting the request (e.g. when its client leaves) stays the caller's job."""
        stream = self.streams[request_id]
        stream.sink, stream.wake_every = sink, self.stream_interval

    def generate(self, prompt, params: SamplingParams, request_id: str, priority: int = 0
                 ) -> AsyncIterator[RequestOutput]:
        """Submit now (bad input raises here, before any streaming); iterate for the delta outputs."""
        self.add_request(request_id, prompt, params, priority)
        return self.stream(request_id)

    def abort(self, request_id: str, keep_stream: bool = False) -> None:
        st = self.output_processor.states.get(request_id)
        children = self.output_processor.abort([request_id])
        if not keep_stream:
            self.streams.pop(request_id, None)
        if not children:
            return
        self._pending.difference_update(children)
        if self.dead is None:  # the core frees their KV blocks on receipt
            self.client.send(AbortRequests(children))
        if st is not None:
            now = time.time()
            n_gen = sum(len(c.token_ids) for c in st.completions)
            self.metrics.observe_finished(st.metrics, len(st.prompt_token_ids), n_gen, "abort", now)
            self._log_finished(st.request_id, len(st.prompt_token_ids), n_gen, st.metrics, "abort", now)

    # -- the output loop ---------------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                if isinstance(msg, CoreOutputs):
                    self._on_outputs(msg)
                elif isinstance(msg, UtilityResult):
                    fut = self._calls.pop(msg.call_id, None)
                    if fut is not None and not fut.done():
                        if msg.error:
                            fut.set_exception(RuntimeError(msg.error))
                        else:
                            fut.set_result(msg.result)
                elif isinstance(msg, CoreDead):
                    self._fail_all(f"engine core died: {msg.error}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave clients hanging
            logger.exception("output loop failed")
            self._fail_all(f"output loop failed: {e}")

    def _on_outputs(self, msg: CoreOutputs) -> None:
        now = time.time()
        op = self.output_processor
        self.stats = msg.stats
        self.metrics.set_engine_stats(msg.stats)
        for cid, t in msg.first_scheduled.items():
            parent = op.child_to_parent.get(cid)
            if parent is not None:
                m = op.states[parent[0]].metrics
                m.first_scheduled_time = t if m.first_scheduled_time is None else min(m.first_scheduled_time, t)
        for o in msg.outputs:
            if o.new_token_ids:
                self._pending.discard(o.request_id)
                self.metrics.observe_output_tokens(len(o.new_token_ids))
            elif o.finish_reason is not None:  # ended without a token (its grammar failed in the engine)
                self._pending.discard(o.request_id)
        for cid, err in msg.errors.items():
            parent = op.child_to_parent.get(cid)
            if parent is not None:
                stream = self.streams.get(parent[0])
                # a reader takes the error, then drops the stream; a sink takes it at once
                self.abort(parent[0], keep_stream=stream is not None and stream.sink is None)
                if stream is not None:
                    internal = err.startswith(INTERNAL_ERROR_PREFIX)
                    stream.fail(RuntimeError(err) if internal else ValueError(err))
        outs, stopped = op.process(msg.outputs, now)
        if stopped:
            self.client.send(FinishRequests([c for c, _ in stopped], [s for _, s in stopped]))
        for out in outs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if any(c.token_ids for c in out.outputs):
                if stream.last_token_time is not None:
                    self.metrics.observe_itl(now - stream.last_token_time)
                stream.last_token_time = now
            stream.put(out)
            if out.finished:  # a stream read by get() stays until its reader takes the last output
                self._finished(out, now)
                if stream.sink is not None:
                    self.streams.pop(out.request_id, None)

    def _finished(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        n_gen = out.extra.get("num_generated", 0)
        reason = ",".join(sorted({c.finish_reason or "?" for c in out.outputs if c.finish_reason})) or "stop"
        self.metrics.observe_finished(m, len(out.prompt_token_ids), n_gen, reason, now)
        self._log_finished(out.request_id, len(out.prompt_token_ids), n_gen, m, reason, now)

    def _log_finished(self, rid: str, n_prompt: int, n_gen: int, m, reason: str, now: float) -> None:
        if not self.log_requests:
            return
        ttft = f"{m.first_token_time - m.arrival_time:.3f}s" if m.first_token_time else "-"
        logger.info("finished request %s: prompt_tokens=%d generation_tokens=%d ttft=%s latency=%.3fs "
                    "finish_reason=%s", rid, n_prompt, n_gen, ttft, now - m.arrival_time, reason)

    def _fail_all(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.error(why)
        for stream in self.streams.values():
            stream.fail(EngineDeadError(why))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead(why)

    async def _watch_core(self) -> None:
        code = await self.client.watch_process()
        if not self.client.closed:
            self._fail_all(f"engine core process exited unexpectedly (exit code {code})")

    # -- utilities -------------------------------------------------------------------------------------------
    async def call_core(self, method: str, timeout: float = 10.0) -> EngineStats:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._call_id += 1
        call_id = self._call_id  # (its own: a call made while this one waits moves the counter on)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.client.send(UtilityCall(call_id, method))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def get_stats(self) -> EngineStats | None:
        """Fresh stats from the core (it answers between steps); the last snapshot if it is slow."""
        try:
            self.stats = await self.call_core("stats", timeout=5.0)
            self.metrics.set_engine_stats(self.stats)
        except (asyncio.TimeoutError, EngineDeadError, RuntimeError):  # (RuntimeError: the core's call failed)
            pass
        return self.stats

    def stop_accepting(self, why: str) -> None:
        """From now on new requests get EngineDeadError(why) (HTTP 503)."""
        self.closing = why

    def fail_in_flight(self, why: str) -> None:
        """Abort every request and fail its reader or sink with EngineDeadError(why) (HTTP 503): a stream
        ends with an error event and [DONE], a non-streaming request with a JSON error."""
        for rid, stream in list(self.streams.items()):
            self.abort(rid, keep_stream=stream.sink is None)  # a reader takes the error, then drops the stream
            stream.fail(EngineDeadError(why))

    async def shutdown(self) -> None:
        self.stop_accepting("the server is shutting down")
        self.fail_in_flight("the server is shutting down")
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.client.shutdown()
