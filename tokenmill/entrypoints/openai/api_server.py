"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This process does HTTP, tokenization and detokenization; the engine core steps in a process of its own
(engine/core_proc.py), reached through AsyncLLM over ZeroMQ."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import time

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import tokenmill
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.errors import APIError, error_response
from tokenmill.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                   CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                   ErrorResponse, ModelList, TokenizeRequest, TokenizeResponse,
                                                   VersionResponse)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("tokenmill")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): refuses work while draining (503),
    checks the API key on /v1/* (401), and caps the request body (413) before any handler parses it."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, state):
        self.app, self.api_key, self.max_body, self.state = app, api_key, max_body_bytes, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.state.draining and path not in ("/health", "/metrics"):
            return await error_response(503, "the server is shutting down")(scope, receive, send)
        if self.api_key and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                return await error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                            code="invalid_api_key")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"request body exceeds {self.max_body} bytes", code="request_too_large")
        try:
            if int(headers.get(b"content-length", b"0")) > self.max_body:
                return await too_big(scope, receive, send)
        except ValueError:
            return await error_response(400, "bad Content-Length header")(scope, receive, send)
        # read the (bounded) body up front, then replay it; later receive() calls still see disconnects
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await too_big(scope, receive, send)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ServerState:
    def __init__(self, engine: AsyncLLM, served_names: list[str]):
        self.engine = engine
        self.served_names = served_names
        self.draining = False
        self.completion = OpenAIServingCompletion(engine, served_names)
        self.chat = OpenAIServingChat(engine, served_names)
        self.created = int(time.time())


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    # unions report the failing branch (e.g. prompt.str); the field is the first named element
    param = loc[0] if loc else None
    where = ".".join(loc)
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return f"invalid value for '{where or 'body'}': {e.get('msg')}{more}", param


def build_app(state: ServerState, api_key: str | None = None, max_body_bytes: int = 8 << 20) -> FastAPI:
    engine = state.engine
    app = FastAPI(title="tokenmill OpenAI-compatible server", version=tokenmill.__version__)
    app.state.tm = state

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, raw: Request):
        return await state.completion.create(body, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await state.chat.create(body, raw)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
             "root": engine.config.model, "max_model_len": engine.max_model_len} for name in state.served_names]}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.dead is not None:
            return error_response(503, engine.dead)
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        await engine.get_stats()  # fresh engine numbers (KV blocks free etc.) at scrape time
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/engine_stats")
    async def engine_stats():
        s = await engine.get_stats()
        return JSONResponse({} if s is None else msgspec.to_builtins(s)
                            | {"num_unfinished_requests": engine.num_unfinished,
                               "num_pending_sequences": engine.num_pending})

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        state.completion.check_model(body.model)
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "the server runs without a tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            ids = render_chat(tok, body.messages, body.add_generation_prompt)["prompt_token_ids"]
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        state.completion.check_model(body.model)
        vocab = engine.model_config.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        if engine.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, state=state)
    return app


class _Server(uvicorn.Server):
    """SIGTERM/SIGINT: stop admitting (503), let uvicorn finish in-flight requests (aborting what is left
    after --shutdown-timeout), then exit 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.tm_state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.tm_state.draining:
            logger.info("received signal %d: draining %d in-flight requests", sig, self.tm_state.engine.num_unfinished)
        self.tm_state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


async def serve(args) -> int:
    from tokenmill.engine.arg_utils import engine_kwargs

    config = EngineConfig(**engine_kwargs(args))
    # like vLLM, the model argument is the default name; the shipped model gets its short name
    default = os.path.basename(DEFAULT_MODEL) if os.path.abspath(args.model) == DEFAULT_MODEL else args.model
    names = args.served_model_name or [default]
    engine = AsyncLLM(config, max_waiting_requests=args.max_waiting_requests, served_model_name=names[0],
                      log_requests=not args.disable_log_requests, stream_interval=args.stream_interval)
    try:
        await engine.start()
        state = ServerState(engine, names)
        api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
        app = build_app(state, api_key, args.max_request_body_bytes)
        cfg = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                             access_log=not args.disable_uvicorn_access_log,
                             timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5,
                             lifespan="off")
        server = _Server(cfg, state)
        # Startup left ~350k objects (transformers, tokenizer, FastAPI) that never die; a full collection
        # rescans them all, stalling every stream for ~200 ms every few seconds under load. Freeze them.
        gc.collect()
        gc.freeze()
        logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
        await server.serve()
        if server.started is False:
            return 1  # e.g. the port was taken
        return 0
    finally:
        await engine.shutdown()


def run_server(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # uvloop's event loop costs about half of asyncio's per streamed chunk; uvicorn uses httptools itself
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))
