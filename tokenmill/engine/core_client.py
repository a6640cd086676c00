"""API-process side of the engine core: spawns core_proc, sends CoreInput messages, receives CoreMessages.

Input goes over a plain (sync) PUSH socket: sends are tiny and never wait, so they are safe to call
from synchronous cleanup code such as an aborted stream's `finally`. Output is read by an asyncio loop."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile

import msgspec
import zmq
import zmq.asyncio

from tokenmill.child_process import spawn_child
from tokenmill.config import EngineConfig
from tokenmill.engine.messages import CoreDead, CoreMessage, Ready, Shutdown

logger = logging.getLogger("tokenmill")


class EngineDeadError(RuntimeError):
    pass


class CoreClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO):
        self._dir = tempfile.mkdtemp(prefix="tokenmill-ipc-")
        in_addr, out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # no queue limit: a send can only fail for want of a peer
        self._input.bind(in_addr)
        self._actx = zmq.asyncio.Context()
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(out_addr)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreMessage)
        self.proc = spawn_child("tokenmill.engine.core_proc", (config, in_addr, out_addr, log_level))
        self.closed = False

    async def wait_ready(self, timeout: float = 600.0) -> Ready:
        """The core's first message: Ready, or CoreDead when loading the model failed."""
        recv = asyncio.ensure_future(self._output.recv())
        died = asyncio.ensure_future(self.watch_process())
        done, _ = await asyncio.wait({recv, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if recv not in done:
            recv.cancel()
            raise EngineDeadError(f"engine core failed to start (exit code {self.proc.poll()})")
        msg = self._dec.decode(recv.result())
        if isinstance(msg, CoreDead):
            raise EngineDeadError(msg.error)
        return msg

    def encode(self, msg) -> bytes:
        """A message as it goes to the core; raises (e.g. on text UTF-8 cannot encode) without sending."""
        return self._enc.encode(msg)

    def send(self, msg) -> None:
        self.send_encoded(self.encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """Never blocks: a blocking PUSH with no core at the other end (it died) would freeze the API
        process's event loop for good. Without a core, the message is dropped; watch_process fails the
        requests."""
        if self.closed:
            return
        try:
            self._input.send(data, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("engine core is not connected; dropped a %d-byte message", len(data))

    async def recv(self):
        return self._dec.decode(await self._output.recv(copy=False))

    async def watch_process(self) -> int | None:
        """Completes when the core process exits (without polling: waits on its sentinel)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        pidfd = os.pidfd_open(self.proc.pid)
        loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return self.proc.wait()

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        try:
            self.send(Shutdown())
        except zmq.ZMQError:
            pass
        self.closed = True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:  # stuck in a step (it ignores SIGTERM): its workers die with it
                self.proc.kill()
                self.proc.wait()
        self._input.close(0)
        self._output.close(0)
        self._sync_ctx.term()
        self._actx.term()
        self.proc.stdin.close()
        shutil.rmtree(self._dir, ignore_errors=True)
