"""Structured-output requests wait here while their grammar compiles on a thread (vLLM's WAITING_FOR_FSM):
a large schema takes xgrammar seconds to compile (a deeply nested one, 8 s), and compiled in the step it would
stall every request in the engine. A request joins the scheduler once its grammar is in the runner's compiler
cache, where the worker's matcher then finds it."""
from __future__ import annotations

import concurrent.futures as cf
import logging

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sample.grammar import compile_threads

logger = logging.getLogger("tokenmill")


class GrammarWait:
    def __init__(self, compiler):
        self.compiler = compiler  # sample/grammar.py GrammarCompiler: the runner's own
        self._pool = None
        self.waiting: dict[str, tuple[Request, cf.Future]] = {}

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(compile_threads(), thread_name_prefix="tokenmill-grammar")
        self.waiting[req.request_id] = (req, self._pool.submit(self.compiler.compile, req.sampling_params
                                                               .structured_outputs))

    def ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[Request]]:
        """(the requests whose grammar compiled, those whose grammar failed), in arrival order; with `wait_s`,
        first wait that long for one. A failure here (the front end compiled the same grammar: nothing
        should fail) ends only its own request: in the step, it would fail every request there."""
        if wait_s and self.waiting:
            cf.wait([f for _, f in self.waiting.values()], timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        done = [rid for rid, (_, f) in self.waiting.items() if f.done()]
        ok, failed = [], []
        for rid in done:
            req, future = self.waiting.pop(rid)
            if future.exception() is not None:
                logger.error("request %s: its grammar failed to compile in the engine: %s", rid, future.exception())
                req.status = RequestStatus.FINISHED_ABORTED  # (n > 1: its siblings wait for it while it is not)
                failed.append(req)
            else:
                ok.append(req)
        return ok, failed

    def abort(self, request_ids) -> list[str]:
        """Drop these requests; a compile still queued is cancelled (one running cannot be: xgrammar's C++)."""
        aborted = []
        for rid in request_ids:
            entry = self.waiting.pop(rid, None)
            if entry is not None:
                entry[1].cancel()
                entry[0].status = RequestStatus.FINISHED_ABORTED
                aborted.append(rid)
        return aborted

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
