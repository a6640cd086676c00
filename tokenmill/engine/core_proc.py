"""The engine-core process: EngineCore's step loop behind two ZeroMQ sockets, no HTTP work.

    API process --PUSH--> [input]  core_proc  [output] --PUSH--> API process

Loop: drain every queued input message, run one step, send that step's outputs as one message.
When there is nothing to run it blocks on the input socket (and on a pipe that reaches EOF when the
parent dies, so an orphaned core exits instead of holding memory)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.distributed.executor import WorkerFailure
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import (INTERNAL_ERROR_PREFIX, AbortRequests, AddRequest, CoreDead, CoreInput, CoreOutputs, FinishRequests,
                                       Ready, Shutdown, UtilityCall, UtilityResult)
from tokenmill.engine.request import Request, RequestStatus

logger = logging.getLogger("tokenmill")


class CoreProc:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, parent_alive_fd: int | None):
        self.ctx = zmq.Context(io_threads=1)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.connect(input_addr)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(output_addr)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(CoreInput)
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        self.parent_fd = parent_alive_fd
        if parent_alive_fd is not None:
            self.poller.register(parent_alive_fd, zmq.POLLIN)
        try:
            self.core = EngineCore(config)
        except BaseException as e:
            self.out.send(self.enc.encode(CoreDead(f"{type(e).__name__}: {e}")))
            raise
        self._failure_fd = None
        if self.core.executor is not None:  # a worker that dies while we idle wakes the poller
            self._failure_fd, wake = os.pipe()
            self.poller.register(self._failure_fd, zmq.POLLIN)
            self.core.executor.on_failure = lambda why: os.write(wake, b"x")
        # Request objects we created, until their first output: queue-time metrics need first_scheduled_time.
        self.unreported: dict[str, Request] = {}
        self.running = True
        self.out.send(self.enc.encode(Ready(self.core.kv.pool.num_blocks, config.max_model_len)))

    def run(self) -> None:
        while self.running:
            self._wait_and_drain(block=not self.core.has_unfinished())
            if self.running and self.core.has_unfinished():
                self._step()

    def _wait_and_drain(self, block: bool) -> None:
        if block:
            events = dict(self.poller.poll())  # idle: sleep until a message (or parent death)
            if self.parent_fd is not None and self.parent_fd in events:
                logger.warning("engine core: API process is gone; exiting")
                self.running = False
                return
            if self._failure_fd is not None and self._failure_fd in events:
                raise WorkerFailure(self.core.executor.failure)
        while self.running:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.dec.decode(frame.buffer)
            except msgspec.ValidationError as e:  # a field of a type the API side let through: that request fails,
                self._refuse_undecodable(frame.buffer, e)  # not the engine
                continue
            self._handle(msg)

    def _refuse_undecodable(self, buf, error: Exception) -> None:
        """A request the core cannot decode is refused under its ids (read from the untyped message), so its
        caller gets an error instead of waiting forever; anything else undecodable is logged and dropped."""
        logger.error("engine core: a message it cannot decode: %s", error)
        try:
            raw = msgspec.msgpack.decode(buf)
            child_ids = [str(c) for c in raw["request"][1]] if raw.get("type") == "add" else []
        except Exception:  # (the message is malformed beyond its types: nothing to answer)
            return
        if child_ids:
            msg = f"{INTERNAL_ERROR_PREFIX}the engine could not read the request: {error}"
            self._send(CoreOutputs([], self.core.stats(), errors={c: msg for c in child_ids}))

    def _handle(self, msg) -> None:
        core = self.core
        if isinstance(msg, AddRequest):
            errors = {}
            for req in msg.request.to_requests():
                try:
                    core.add_request(req)
                    self.unreported[req.request_id] = req
                except ValueError as e:
                    errors[req.request_id] = str(e)
            if errors:
                self._send(CoreOutputs([], core.stats(), errors=errors))
        elif isinstance(msg, AbortRequests):
            core.abort(msg.child_ids)  # frees their KV blocks now
            for cid in msg.child_ids:
                self.unreported.pop(cid, None)
        elif isinstance(msg, FinishRequests):
            for cid, stop in zip(msg.child_ids, msg.stop_reasons):
                core.finish_request(cid, RequestStatus.FINISHED_STOPPED, stop)
                self.unreported.pop(cid, None)
        elif isinstance(msg, UtilityCall):
            self._send(self._call(msg))
        elif isinstance(msg, Shutdown):
            core.abort(list(core.scheduler.requests) + list(core.grammar_wait.waiting))
            self.running = False

    def _call(self, msg: UtilityCall) -> UtilityResult:
        try:
            if msg.method == "stats":
                return UtilityResult(msg.call_id, self.core.stats())
            if msg.method == "check_invariants":
                self.core.check_invariants()
            elif msg.method == "reset_prefix_cache":
                self.core.kv.reset_prefix_cache()
            else:
                return UtilityResult(msg.call_id, error=f"unknown method {msg.method!r}")
            return UtilityResult(msg.call_id, self.core.stats())
        except Exception as e:  # an integrity failure is reported, not fatal
            return UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except WorkerFailure:
            raise  # a rank is gone: no step can run again; the core dies and the server exits with the reason
        except Exception as e:  # a bug must not take the server down: fail what was in flight, keep serving
            logger.error("engine step failed; aborting in-flight requests:\n%s", traceback.format_exc())
            ids = list(self.core.scheduler.requests)
            self.core.abort(ids)
            for rid in ids:
                self.unreported.pop(rid, None)
            msg = f"{INTERNAL_ERROR_PREFIX}{type(e).__name__}: {e}"
            self._send(CoreOutputs([], self.core.stats(), errors={rid: msg for rid in ids}))
            return
        if not outputs:
            return
        first = {}
        for o in outputs:
            req = self.unreported.pop(o.request_id, None)
            if req is not None and req.first_scheduled_time is not None:
                first[o.request_id] = req.first_scheduled_time
        self._send(CoreOutputs(outputs, self.core.stats(), first))

    def _send(self, msg) -> None:
        self.out.send(self.enc.encode(msg), copy=False)

    def close(self) -> None:
        try:
            self.core.close()  # KV tiers: write the pool's cached blocks down, stop the transfer threads
        except Exception:
            logger.exception("engine core: closing the KV tiers failed")
        self.inp.close(linger=0)
        self.out.close()
        self.ctx.term()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_alive_fd: int | None = None,
                    log_level: int = logging.INFO) -> None:
    """`parent_alive_fd` is the read end of a pipe whose write end only the parent holds: it becomes
    readable (EOF) when the parent dies."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(message)s")
    # The API process owns shutdown: a signal sent to all its processes (systemd's control-group stop, `pkill`)
    # must not kill in-flight requests; the core exits on the API's Shutdown message or when the API is gone.
    # (Terminal signals do not reach it: child_process.py gives it a process group of its own.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proc = None
    try:
        proc = CoreProc(config, input_addr, output_addr, parent_alive_fd)
        # the model and imports (~300k objects) live as long as this process: keep full collections, which
        # otherwise rescan them all and stall the step loop for ~130 ms every few seconds, off them
        gc.collect()
        gc.freeze()
        proc.run()
    except BaseException as e:
        if proc is None and isinstance(e, ValueError):  # a bad model or setting found at startup: the parent
            logger.debug("engine core did not start:\n%s", traceback.format_exc())  # prints it as one line
            time.sleep(0.1)  # (CoreDead, sent by CoreProc, on its way)
            raise SystemExit(1) from None
        logger.error("engine core died:\n%s", traceback.format_exc())
        if proc is not None:
            try:  # the reason without the traceback: clients see it (the log has the rest)
                proc._send(CoreDead(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
                time.sleep(0.1)
            except Exception:
                pass
        raise
    finally:
        if proc is not None:
            proc.close()


def main() -> None:
    """`python -m tokenmill.engine.core_proc`: the parent writes one pickled (config, input_addr,
    output_addr, log_level) to our stdin and keeps it open; stdin's EOF means the parent died.
    (A subprocess, not multiprocessing: spawn would re-run the parent's __main__, e.g. `python -m tokenmill`.)"""
    from tokenmill.child_process import read_payload

    config, input_addr, output_addr, log_level = read_payload()
    run_engine_core(config, input_addr, output_addr, sys.stdin.fileno(), log_level)


if __name__ == "__main__":
    main()
