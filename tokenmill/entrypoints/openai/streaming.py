"""SSE responses that abort their requests the moment the client goes away, and a helper that does the
same for non-streaming handlers."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

_encode = msgspec.json.encode


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """Streams `body_iterator` while listening for http.disconnect (whatever the ASGI spec version), then
    closes the iterator and calls `on_close` (which aborts the engine requests) at once, even when the
    client left before the first chunk and the iterator never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run_then_cancel(fn):
                    await fn()
                    tg.cancel_scope.cancel()

                tg.start_soon(run_then_cancel, lambda: self.stream_response(send))
                await run_then_cancel(lambda: self.listen_for_disconnect(receive))
        except OSError:
            pass  # client went away mid-write
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


async def cancel_on_disconnect(request: Request, handler: Callable[[], Awaitable]):
    """Run `handler` unless the client disconnects first; then cancel it (its cleanup aborts the request).
    The body has already been read, so `receive()` just waits for http.disconnect."""
    async def wait_disconnect():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    work = asyncio.ensure_future(handler())
    watch = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        return None
    return work.result()
