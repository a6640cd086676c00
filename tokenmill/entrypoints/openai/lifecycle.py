"""How `tokenmill serve` ends: draining on SIGTERM/SIGINT, and exiting when the engine core dies.

Drain (first signal):
  1. `draining`: new requests get 503 (with `Connection: close`) and /health says 503, but the server keeps
     accepting connections, so a load balancer sees the drain instead of refused connections;
  2. in-flight requests run to their end, for up to --shutdown-timeout seconds;
  3. past that, every request still in flight is ended by the engine (a stream gets an error event and
     [DONE], a non-streaming request a JSON 503), and those answers go out;
  4. only then uvicorn stops (closes the listening socket and the idle connections); exit code 0.
A second signal skips the wait of step 2.

uvicorn's own graceful-shutdown timeout, which cancels request tasks (a plain-text 500 and "Exception in
ASGI application" in the log), is only a backstop behind this.

Engine core death: the engine fails the requests in flight (503); unless --keep-alive-on-engine-death, the
server then ends the same way (their answers go out, uvicorn stops) and exits 1, so a supervisor restarts
it. With the flag it keeps answering 503 (and /health 503) until stopped, and still exits 1."""
from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("tokenmill")

FLUSH_TIMEOUT_S = 5.0  # for ended requests' last bytes to go out
_POLL_S = 0.02


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float, exit_on_engine_death: bool = True):
        super().__init__(config)
        self.tm_state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ending: asyncio.Task | None = None
        self._hurry = asyncio.Event()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.tm_state.engine.on_dead = self._engine_died
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # a signal handler runs between any two bytecodes of the loop: hand the work to the loop itself
        # (and do not record the signal: uvicorn would re-raise it after serving instead of exiting 0)
        if self._loop is None:
            return super().handle_exit(sig, frame)
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._ending is None:
            logger.info("received signal %d: draining %d in-flight requests", sig,
                        self.tm_state.engine.num_unfinished)
            self._ending = asyncio.ensure_future(self._drain())
        else:
            logger.info("received signal %d again: ending in-flight requests now", sig)
            self._hurry.set()

    def _busy(self) -> bool:
        engine = self.tm_state.engine
        return bool(self.tm_state.in_flight or engine.num_unfinished or engine.num_submitting)

    async def _until_idle(self, timeout: float) -> None:
        deadline = self._loop.time() + timeout
        while self._busy() and self._loop.time() < deadline and not self._hurry.is_set():
            await asyncio.sleep(_POLL_S)

    async def _drain(self) -> None:
        state, engine = self.tm_state, self.tm_state.engine
        state.draining = True
        await self._until_idle(self.shutdown_timeout)
        if self._busy():
            why = "the server is shutting down (in-flight requests ran past its shutdown timeout)"
            logger.warning("shutdown timeout: ending %d in-flight requests", engine.num_unfinished)
            engine.stop_accepting(why)
            engine.fail_in_flight(why)
            self._hurry.clear()
            await self._until_idle(FLUSH_TIMEOUT_S)
        self.should_exit = True

    def _engine_died(self, why: str) -> None:
        self.exit_code = 1
        if not self.exit_on_engine_death:
            logger.error("engine core is gone; answering 503 until stopped (--keep-alive-on-engine-death)")
            return
        logger.error("engine core is gone: shutting down (exit code 1)")
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._end_after_death())

    async def _end_after_death(self) -> None:
        self.tm_state.draining = True
        self._hurry.clear()
        await self._until_idle(FLUSH_TIMEOUT_S)  # the failed requests' answers go out first
        self.should_exit = True
