"""SSE responses, pushed by the engine's output loop, that abort their requests the moment the client goes
away; a helper that does the same for non-streaming handlers."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_encode = msgspec.json.encode


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEStream(Response):
    """An SSE response whose events are pushed synchronously (`write`, `close`) by the engine's output loop
    through a RequestSink, instead of pulled through async generators.

    Sending: the first write after a flush schedules one `_flush` callback; the output loop formats a
    whole step's outputs first, so the flushes of all streams then run back to back. That matters more
    than it looks: on loopback a write that finds the client asleep pays for waking it (11-14 us instead
    of ~7 us per write here), and writes spaced by per-stream task switches found it asleep every time.
    `_flush` drives the ASGI send coroutine by hand; it completes without suspending unless the client is
    slow (uvicorn's flow control), and then a task finishes it while later events queue up behind it and
    go out together.

    It listens for http.disconnect (whatever the ASGI spec version) and, when the client leaves or the
    stream ends, calls `on_close` (which aborts the engine requests) at once, even if the client left
    before any event."""

    media_type = "text/event-stream"

    def __init__(self, on_close: Callable[[], None] | None = None):  # a Response, so FastAPI passes it through
        self.status_code, self.background = 200, None
        # Starlette's `headers` property reads these, so header-editing middleware still works
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.on_close = on_close
        self._parts: list[bytes] = []
        self._ended = False  # close() was called, or the client left: nothing more is accepted
        self._send: Send | None = None  # set once the headers are out
        self._busy = False  # a flush is scheduled or a send is in flight
        self._done: asyncio.Future | None = None  # resolved when the last body went out or sending failed
        self._error: BaseException | None = None  # why sending failed

    def write(self, data: bytes) -> None:
        if not self._ended:
            self._parts.append(data)
            self._schedule()

    def close(self, data: bytes = SSE_DONE) -> None:
        """Send `data` (by default the [DONE] event) after what is queued, then end the response."""
        if not self._ended:
            self._parts.append(data)
            self._ended = True
            self._schedule()

    def _schedule(self) -> None:
        if not self._busy and self._send is not None:
            self._busy = True
            self._done.get_loop().call_soon(self._flush)

    def _flush(self) -> None:
        last = self._ended
        body, self._parts = b"".join(self._parts), []
        coro = self._send({"type": "http.response.body", "body": body, "more_body": not last})
        try:
            suspended_on = coro.send(None)
        except StopIteration:
            self._sent(last)
            return
        except Exception as e:
            self._finish(e)
            return
        task = asyncio.ensure_future(_finish_started(coro, suspended_on))
        task.add_done_callback(lambda t: self._after_send_task(t, last))

    def _after_send_task(self, task: asyncio.Task, last: bool) -> None:
        if task.cancelled():  # the loop is shutting down
            self._finish(None)
        elif task.exception() is not None:
            self._finish(task.exception())
        else:
            self._sent(last)

    def _sent(self, last: bool) -> None:
        self._busy = False
        if last:
            self._finish(None)
        elif self._parts:
            self._schedule()

    def _finish(self, err: BaseException | None) -> None:
        self._ended = True
        if self._error is None:
            self._error = err
        if not self._done.done():
            self._done.set_result(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def listen_for_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        self._done = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(listen_for_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            self._send = send
            if self._parts:
                self._schedule()
            await asyncio.wait({watch, self._done}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not watch.cancelled():
                watch.exception()  # a failing receive() ends the stream as a disconnect does
            if self._error is not None and not isinstance(self._error, OSError):
                raise self._error
        except OSError:
            pass  # client went away mid-write
        finally:
            watch.cancel()
            self._ended = True
            if self.on_close is not None:
                self.on_close()
        if self.background is not None:
            await self.background()


async def _finish_started(coro, suspended_on) -> None:
    """Run to its end a coroutine that was started by hand (`coro.send(None)`) and suspended on
    `suspended_on`: the asyncio future it awaits, or None for a bare yield (asyncio.sleep(0))."""
    while True:
        try:
            if suspended_on is None:
                await asyncio.sleep(0)
            else:
                suspended_on._asyncio_future_blocking = False  # as Task.__step does before it waits
                await suspended_on
        except asyncio.CancelledError:
            if suspended_on is None or not suspended_on.cancelled():
                coro.close()  # this task was cancelled (loop shutdown): unwind the coroutine
                raise
        except BaseException:
            pass  # the coroutine sees the future's exception when it resumes
        try:
            suspended_on = coro.send(None)
        except StopIteration:
            return


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
