"""AsyncLLM (the API process's engine) without HTTP: outputs and errors reach a reader that arrives late,
or a sink in the output loop; a request nobody reads is freed by abort."""
from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, _RequestStream
from tokenmill.engine.messages import INTERNAL_ERROR_PREFIX, CoreOutputs
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def _until(cond, timeout: float = 60.0, what: str = "timed out") -> None:
    """Poll `cond` (a function returning a bool or an awaitable bool) until it holds."""
    deadline = time.monotonic() + timeout
    while not (await ok if inspect.isawaitable(ok := cond()) else ok):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _read_all(engine: AsyncLLM, rid: str) -> tuple[str, list[int]]:
    text, ids = "", []
    async for out in engine.stream(rid):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
    return text, ids


class _Sink:
    """A RequestSink that records what it is handed; `explode` makes put() raise (a formatting bug)."""

    def __init__(self, explode: bool = False):
        self.text, self.ids, self.finished, self.errors, self.explode = "", [], False, [], explode

    def put(self, out) -> None:
        if self.explode:
            raise KeyError("bug in a formatter")
        self.text += out.outputs[0].text
        self.ids += out.outputs[0].token_ids
        self.finished = out.finished

    def fail(self, err: BaseException) -> None:
        self.errors.append(err)


async def _scenario() -> None:
    engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128, max_num_seqs=8),
                      log_requests=False)
    await engine.start()
    try:
        # the reference: a request read as it runs
        engine.add_request("read-now", "ROMEO:", GREEDY)
        expected = await _read_all(engine, "read-now")
        assert len(expected[1]) == 8

        # a request that finishes before its reader starts (a loaded server can get there) still
        # delivers everything, and its stream is gone once read
        engine.add_request("read-late", "ROMEO:", GREEDY)
        await _until(lambda: "read-late" not in engine.output_processor.states)
        assert await _read_all(engine, "read-late") == expected
        assert "read-late" not in engine.streams

        # a request the core fails before anyone reads it: its reader gets the error, not a KeyError
        engine.add_request("fails-before-read", "ROMEO:", SamplingParams(temperature=0, max_tokens=100,
                                                                          ignore_eos=True))
        engine._on_outputs(CoreOutputs([], engine.stats, errors={
            "fails-before-read": f"{INTERNAL_ERROR_PREFIX}injected step failure"}))
        with pytest.raises(RuntimeError, match="injected step failure"):
            await _read_all(engine, "fails-before-read")
        assert "fails-before-read" not in engine.streams

        # a request the core cannot decode (a field of the wrong type got past validation) fails alone, with an
        # internal error, and the engine serves on
        broken = SamplingParams(temperature=0, max_tokens=4)
        broken.ignore_eos = "yes"
        engine.add_request("undecodable", "ROMEO:", broken)
        with pytest.raises(RuntimeError, match="could not read the request"):
            await _read_all(engine, "undecodable")
        engine.add_request("after-undecodable", "ROMEO:", GREEDY)
        assert await _read_all(engine, "after-undecodable") == expected

        # a sink gets the same outputs from the output loop, and the stream is dropped when it finishes
        engine.add_request("sink", "ROMEO:", GREEDY)
        engine.attach_sink("sink", sink := _Sink())
        await _until(lambda: sink.finished)
        assert (sink.text, sink.ids) == expected and not sink.errors
        assert "sink" not in engine.streams

        # a sink that raises fails its own request (the loop carries on); a core error reaches a sink too
        engine.add_request("sink-bug", "ROMEO:", GREEDY)
        engine.attach_sink("sink-bug", bug := _Sink(explode=True))
        await _until(lambda: bug.errors)
        await asyncio.sleep(0.2)  # more steps ran: the broken sink is not called again
        assert len(bug.errors) == 1 and "internal error: KeyError" in str(bug.errors[0])
        engine.abort("sink-bug")  # what the server's response does when it closes
        engine.add_request("sink-fails", "ROMEO:", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        engine.attach_sink("sink-fails", failed := _Sink())
        engine._on_outputs(CoreOutputs([], engine.stats, errors={"sink-fails": "prompt rejected"}))
        assert isinstance(failed.errors[0], ValueError) and "sink-fails" not in engine.streams

        # a request nobody ever reads (the client left before its handler read anything) is freed by abort,
        # finished or not
        engine.add_request("never-read-done", "ROMEO:", GREEDY)
        await _until(lambda: "never-read-done" not in engine.output_processor.states)
        engine.add_request("never-read-running", "ROMEO:", SamplingParams(temperature=0, max_tokens=100,
                                                                           ignore_eos=True))
        engine.abort("never-read-done")
        engine.abort("never-read-running")
        assert engine.num_unfinished == 0

        async def idle() -> bool:
            stats = await engine.call_core("stats")
            return stats.num_running == 0 and stats.num_waiting == 0 and \
                stats.num_free_kv_blocks == stats.num_kv_blocks

        await _until(idle, what="the aborted request's blocks were never freed")
        await engine.call_core("check_invariants")
    finally:
        await engine.shutdown()


def test_late_reader_gets_everything_and_unread_requests_are_freed():
    asyncio.run(_scenario())


def test_sink_gets_held_back_tokens_before_a_failure():
    """With --stream-interval 4, tokens not yet due still reach the sink when the request fails, then the
    error; n = 2 choices count their tokens separately."""
    async def run() -> None:
        stream, sink = _RequestStream(), _Sink()
        stream.sink, stream.wake_every = sink, 4

        def delta(tok: int) -> RequestOutput:
            return RequestOutput("r", None, [1], [CompletionOutput(0, f"<{tok}>", [tok]),
                                                  CompletionOutput(1, "", [tok + 100])], False)

        for tok in range(1, 7):  # the first token goes out at once, then 4 per choice: 1, 4, and 1 held
            stream.put(delta(tok))
        assert sink.ids == [1, 2, 3, 4, 5] and not sink.errors
        stream.fail(RuntimeError("step failed"))
        assert sink.ids == [1, 2, 3, 4, 5, 6] and sink.text.endswith("<6>") and len(sink.errors) == 1

    asyncio.run(run())


def test_merging_deltas_matches_choices_by_index():
    """n > 1 followers start a step after their leader: a pending delta holding only choice 0 must take the
    next delta's choices 0, 1 and 2 each into its own place (it used to zip them, dropping 1 and 2)."""
    from tokenmill.engine.async_llm import _merge
    from tokenmill.outputs import CompletionOutput, RequestOutput

    def delta(*choices):
        outs = [CompletionOutput(index=i, text="t" * len(ids), token_ids=list(ids), cumulative_logprob=None,
                                 logprobs=None, finish_reason=None) for i, ids in choices]
        return RequestOutput("r", None, [1], outs, False)

    merged = _merge(delta((0, [5])), delta((0, [6]), (1, [7]), (2, [8])))
    merged = _merge(merged, delta((2, [9]), (1, [10])))
    assert [(c.index, c.token_ids, c.text) for c in merged.outputs] == [(0, [5, 6], "tt"), (1, [7, 10], "tt"),
                                                                        (2, [8, 9], "tt")]


def test_a_child_that_ends_without_a_token_leaves_the_admission_count():
    """The admission cap (max_waiting_requests) counts children without a first token; one the core ends with
    none (its grammar failed to compile in the engine: an abort output with no ids) must leave the count, or
    each such request shrank the server's capacity for good."""
    from tokenmill.engine.core import EngineCoreOutput, EngineStats

    engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128), log_requests=False)
    engine._pending.update({"x#0", "x#1", "y"})
    engine._on_outputs(CoreOutputs([EngineCoreOutput("x#0", [], "abort"), EngineCoreOutput("x#1", [7]),
                                    EngineCoreOutput("y", [])], EngineStats(0, 0, 1, 1, 0.0, 0, 0, 0.0, 0, 0)))
    assert engine.num_pending == 1 and engine._pending == {"y"}


def test_concurrent_calls_to_the_core_each_get_their_answer():
    """/metrics, the dashboard and /debug/engine_stats ask the core for stats at once: each call must wait on its
    own id (a call that finished dropped the newest call's future, which then timed out on a stale snapshot)."""
    from types import SimpleNamespace

    async def run() -> None:
        engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128), log_requests=False)
        sent = []
        engine.client = SimpleNamespace(send=sent.append)
        first = asyncio.ensure_future(engine.call_core("stats", timeout=5.0))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(engine.call_core("stats", timeout=5.0))
        await asyncio.sleep(0)
        assert [c.call_id for c in sent] == [1, 2]
        engine._calls.pop(1).set_result("one")  # as the output loop answers: the first call's result lands
        assert await first == "one"
        engine._calls.pop(2).set_result("two")  # (the first call's cleanup had dropped this one's future)
        assert await second == "two" and not engine._calls

    asyncio.run(run())
