"""The ASGI middleware in front of every route: draining, the API key, the request-body cap, and the count of
requests in flight that shutdown waits for; optionally, X-Request-Id on every response."""
from __future__ import annotations

import secrets
import uuid

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import error_response

# open without the API key (probes, scrapers, the API's own documentation); everything else needs it
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json", "/dashboard", "/dashboard/data", "/dashboard/static/uPlot.iife.min.js",
                          "/dashboard/static/uPlot.min.css"})
# still answered while draining (/health then says 503), and not counted as work in flight
PROBE_PATHS = frozenset({"/health", "/metrics"})


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): refuses work while draining (503, and
    the connection closes, so a load balancer moves on), checks the API key (401), and caps the request body
    (413) before any handler parses it. `state.in_flight` counts the requests it let through."""

    def __init__(self, app: ASGIApp, api_key: str | list[str] | None, max_body_bytes: int, state):
        # any of several keys (vLLM's --api-key takes a list)
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = [k.encode() for k in keys if k]
        self.app, self.max_body, self.state = app, max_body_bytes, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.state.draining and path not in PROBE_PATHS:
            return await error_response(503, "the server is shutting down",
                                        headers={"connection": "close"})(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys and path not in PUBLIC_PATHS and not self._authorized(headers):
            return await error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                        code="invalid_api_key")(scope, receive, send)
        counted = path not in PROBE_PATHS
        self.state.in_flight += counted
        try:
            await self._call(scope, receive, send, headers)
        finally:
            self.state.in_flight -= counted

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        token = token.encode()
        return sum(secrets.compare_digest(token, key) for key in self.api_keys) > 0  # (every key compared)

    async def _call(self, scope: Scope, receive: Receive, send: Send, headers: dict) -> None:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"request body exceeds {self.max_body} bytes", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.max_body:
                    return await too_big(scope, receive, send)
            except ValueError:
                return await error_response(400, "bad Content-Length header")(scope, receive, send)
            # the HTTP parser delivers exactly Content-Length bytes: pass them through, with no copy of the body
            return await self.app(scope, receive, send)
        # chunked: read the (bounded) body up front, then replay it; later receive() calls still see disconnects
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


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own or a new one
    (pure ASGI, as GuardMiddleware: streams pass through)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)
        await self.app(scope, receive, send_with_id)
