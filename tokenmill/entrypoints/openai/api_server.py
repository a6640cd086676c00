"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This process does HTTP, tokenization and detokenization; the engine core steps in a process of its own
(engine/core_proc.py), reached through AsyncLLM over ZeroMQ."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import tokenmill
from tokenmill.engine.input_processor import compile_chat_template
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.entrypoints.openai.dashboard import add_dashboard_routes
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.errors import APIError, error_response, validation_message
from tokenmill.entrypoints.openai.guard import GuardMiddleware, RequestIdHeader
from tokenmill.entrypoints.openai.http_protocol import http_protocol
from tokenmill.entrypoints.openai.lifecycle import FLUSH_TIMEOUT_S, Server
from tokenmill.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                   CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                   ErrorResponse, ModelCard, ModelList, TokenizeRequest,
                                                   TokenizeResponse, UNION_TAGS, VersionResponse)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat, request_chat_template
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import engine_errors

logger = logging.getLogger("tokenmill")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class ServerState:
    def __init__(self, engine: AsyncLLM, served_names: list[str]):
        self.engine = engine
        self.served_names = served_names
        self.draining = False
        self.in_flight = 0  # requests GuardMiddleware let through that have not ended yet
        self.completion = OpenAIServingCompletion(engine, served_names)
        self.chat = OpenAIServingChat(engine, served_names)
        self.created = int(time.time())


def api_keys(given: list[str] | None) -> list[str] | None:
    """--api-key's keys, else TOKENMILL_API_KEY, else vLLM's VLLM_API_KEY (a vLLM deployment's environment
    must not leave the server open); None: no key needed."""
    env = os.environ.get("TOKENMILL_API_KEY") or os.environ.get("VLLM_API_KEY")
    return given or ([env] if env else None)


def build_app(state: ServerState, api_key: str | list[str] | None = None, max_body_bytes: int = 8 << 20,
              request_id_headers: bool = False) -> FastAPI:
    engine = state.engine
    app = FastAPI(title="tokenmill OpenAI-compatible server", version=tokenmill.__version__)
    app.state.tm = state

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        msg, param = validation_message(exc.errors(), UNION_TAGS)
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

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": engine.config.model, "max_model_len": engine.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.served_names]}

    @app.get("/v1/models/{name:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(name: str):  # OpenAI's "retrieve model"; served names may hold slashes (org/model)
        state.completion.check_model(name)
        return model_card(name)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.dead is not None:
            return error_response(503, engine.dead)
        if state.draining:
            return error_response(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        await engine.get_stats()  # fresh engine numbers (KV blocks free etc.) at scrape time
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_dashboard_routes(app, engine)

    @app.get("/debug/engine_stats")
    async def engine_stats():
        s = await engine.get_stats()
        return JSONResponse({} if s is None else msgspec.to_builtins(s)
                            | {"num_unfinished_requests": engine.num_unfinished,
                               "num_pending_sequences": engine.num_pending})

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        state.completion.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        field = "prompt" if body.messages is None else "messages"
        if body.messages is not None:
            template = request_chat_template(body.chat_template, state.chat.trust_request_chat_template)
            rendered = await render_chat(engine, body.messages, body.add_generation_prompt,
                                         body.chat_template_kwargs, body.tools, body.continue_final_message, template)
            ids = rendered["prompt_token_ids"]
            if rendered.get("multi_modal_data"):  # each image as the tokens the engine runs for it
                mm = engine.input_processor.mm
                with engine_errors("messages", only_field=True):
                    _, media = await engine.run_tokenizer(mm.prepare, rendered, rendered["multi_modal_data"])
                    ids, _ = mm.expand_ids(ids, len(media))
        else:
            with engine_errors():  # a prompt that cannot fit is refused before it is tokenized
                ids = await engine.run_tokenizer(engine.input_processor.encode, body.prompt, body.add_special_tokens)
        if len(ids) > engine.max_model_len:
            raise APIError(400, f"'{field}' is {len(ids)} tokens, longer than max_model_len ({engine.max_model_len})",
                           field)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        state.completion.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        return {"prompt": await engine.run_tokenizer(_detokenize, engine, body.tokens)}

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, state=state)
    if request_id_headers:  # (outermost: refusals get the header too)
        app.add_middleware(RequestIdHeader)
    return app


def load_chat_template(value: str) -> str:
    """--chat-template: a Jinja file, or the template itself (vLLM's rule: a value without any of '{', '}' or a
    newline must be a file; one given inline has its '\\n' escapes decoded). It is compiled here, so a broken
    one stops the server at startup rather than failing every chat request."""
    import jinja2
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template: no such file {value!r}")
    else:
        value = value.replace("\\n", "\n")
    try:
        compile_chat_template(value)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return value


def _detokenize(engine: AsyncLLM, tokens: list[int]) -> str:
    """On the tokenizer thread: up to a million ids take a while to check and decode."""
    vocab = engine.model_config.vocab_size
    if tokens and max(tokens) >= vocab:
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    tok = engine.tokenizer
    # decode() first converts every id in Python, holding the GIL (and so the event loop) ~0.1 s per million
    # ids; _decode hands the list straight to the Rust tokenizer, which releases the GIL while it works
    return (getattr(tok, "_decode", None) or tok.decode)(tokens)


def _check_listen_address(host: str, port: int) -> None:
    """ValueError where the server could not listen: a host that does not resolve, a port taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def serve(args) -> int:
    from tokenmill.engine.arg_utils import engine_kwargs

    config = EngineConfig(**engine_kwargs(args))
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, pythonic or "
                         "mistral)")
    # like vLLM, the model argument is the default name; the shipped model gets its short name
    default = os.path.basename(DEFAULT_MODEL) if os.path.abspath(args.model) == DEFAULT_MODEL else args.model
    names = args.served_model_name or [default]
    _check_listen_address(args.host, args.port)  # before minutes of loading
    engine = AsyncLLM(config, max_waiting_requests=args.max_waiting_requests, served_model_name=names[0],
                      log_requests=not args.disable_log_requests, stream_interval=args.stream_interval)
    try:
        try:
            await engine.start()
        except EngineDeadError as e:  # a bad model or setting the core found: one line, not its traceback
            raise ValueError(f"the engine did not start: {e}") from None
        engine.input_processor.chat_template = chat_template
        state = ServerState(engine, names)
        state.chat.tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        state.chat.reasoning_parser = args.reasoning_parser
        state.chat.trust_request_chat_template = args.trust_request_chat_template
        state.chat.response_role = args.response_role
        app = build_app(state, api_keys(args.api_key), args.max_request_body_bytes, args.enable_request_id_headers)
        # our drain (lifecycle.py) ends requests past --shutdown-timeout itself; uvicorn's timeout, which
        # cancels request tasks, is only a backstop behind it
        cfg = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                             access_log=not args.disable_uvicorn_access_log, http=http_protocol(),
                             timeout_graceful_shutdown=FLUSH_TIMEOUT_S, timeout_keep_alive=5, lifespan="off")
        server = Server(cfg, state, args.shutdown_timeout, exit_on_engine_death=not args.keep_alive_on_engine_death)
        # Startup left ~350k objects (transformers, tokenizer, FastAPI) that never die; a full collection
        # rescans them all, stalling every stream for ~200 ms every few seconds under load. Freeze them.
        gc.collect()
        gc.freeze()
        logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
        await server.serve()
        if server.started is False:
            return 1  # e.g. the port was taken
        return 1 if engine.dead is not None else server.exit_code
    finally:
        await engine.shutdown()


def run_server(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # uvloop's event loop costs about half of asyncio's per streamed chunk; uvicorn uses httptools itself
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))
