"""SSEStream without a server: events pushed by synchronous writes reach the ASGI send in order, also when
send suspends (a slow client under uvicorn's flow control), and every way a stream ends calls on_close."""
from __future__ import annotations

import asyncio

from tokenmill.entrypoints.openai.streaming import SSE_DONE, SSEStream


class _Client:
    """An ASGI send/receive pair. `hold` makes the next body sends wait on a future (flow control);
    `yield_once` makes them suspend on a bare yield, as asyncio.sleep(0) does."""

    def __init__(self):
        self.bodies: list[tuple[bytes, bool]] = []
        self.hold: asyncio.Future | None = None
        self.yield_once = False
        self.fail_with: BaseException | None = None
        self.gone = asyncio.Event()

    async def send(self, msg: dict) -> None:
        if msg["type"] == "http.response.body":
            if self.fail_with is not None:
                raise self.fail_with
            if self.hold is not None:
                await self.hold
            if self.yield_once:
                await asyncio.sleep(0)
            self.bodies.append((msg["body"], msg["more_body"]))

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _ordered_through_suspended_sends() -> None:
    client, closed = _Client(), []
    stream = SSEStream(on_close=lambda: closed.append(True))
    stream.write(b"a")  # before the response starts: queued
    task = asyncio.ensure_future(stream({"type": "http"}, client.receive, client.send))
    await _settle()
    assert client.bodies == [(b"a", True)]

    client.hold = asyncio.get_running_loop().create_future()
    stream.write(b"b")
    await _settle()  # "b" is stuck in send; later events queue behind it
    stream.write(b"c")
    stream.write(b"d")
    await _settle()
    assert client.bodies == [(b"a", True)]
    hold, client.hold = client.hold, None
    hold.set_result(None)
    await _settle()
    assert client.bodies == [(b"a", True), (b"b", True), (b"cd", True)]

    client.yield_once = True
    stream.write(b"e")
    stream.close()
    await asyncio.wait_for(task, 5)
    assert client.bodies[3:] == [(b"e" + SSE_DONE, False)] and closed == [True]
    stream.write(b"late")  # ignored after the end
    assert len(client.bodies) == 4


async def _disconnect_and_failed_send_end_the_stream() -> None:
    client, closed = _Client(), []
    stream = SSEStream(on_close=lambda: closed.append("left"))
    task = asyncio.ensure_future(stream({"type": "http"}, client.receive, client.send))
    stream.write(b"a")
    await _settle()
    client.gone.set()  # the client leaves mid-stream
    await asyncio.wait_for(task, 5)
    assert closed == ["left"] and client.bodies == [(b"a", True)]

    client = _Client()
    client.fail_with = OSError("broken pipe")
    stream = SSEStream(on_close=lambda: closed.append("broken"))
    task = asyncio.ensure_future(stream({"type": "http"}, client.receive, client.send))
    stream.write(b"a")
    await asyncio.wait_for(task, 5)  # returns quietly
    assert closed == ["left", "broken"]


def test_events_stay_ordered_when_send_suspends():
    asyncio.run(_ordered_through_suspended_sends())


def test_disconnect_or_failed_send_ends_the_stream_and_calls_on_close():
    asyncio.run(_disconnect_and_failed_send_end_the_stream())
