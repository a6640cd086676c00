"""A request that fails while it is being submitted releases everything it registered (issue 12, item 1).

Every stage of AsyncLLM's submission is made to fail in turn (tokenizing, encoding the message for the
core, the output processor, the request's stream, the pending set, the send, and the second prompt of a
two-prompt request), and so is building the response that takes the submitted requests over; after each,
nothing is left behind: no stream, no pending sequence, no output state, nothing in the core, and the next
request runs."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine import async_llm
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai import serving_chat, serving_completion
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=2, n=3, ignore_eos=True)


class Injected(RuntimeError):
    pass


def boom(*args, **kwargs):
    raise Injected("injected failure")


class _RaisingSet(set):
    def update(self, *args):
        raise Injected("injected failure")


class _FailingEncoder:
    """Stands in for the client's msgspec encoder: fails on AddRequest number `nth` (1-based)."""

    def __init__(self, real, nth: int = 1):
        self.real, self.nth, self.seen = real, nth, 0

    def encode(self, msg):
        if type(msg).__name__ == "AddRequest":
            self.seen += 1
            if self.seen == self.nth:
                raise Injected("injected failure")
        return self.real.encode(msg)


class _FailingSocket:
    """Stands in for the client's input socket: a send fails on the AddRequest number `nth`."""

    def __init__(self, real, nth: int = 1):
        self.real, self.nth, self.seen = real, nth, 0

    def send(self, data, *args, **kwargs):
        if b"\xa3add" in bytes(data[:16]):  # msgpack of the AddRequest tag
            self.seen += 1
            if self.seen == self.nth:
                raise zmq.ZMQError(zmq.EFSM, "injected failure")
        return self.real.send(data, *args, **kwargs)


def _stages(engine: AsyncLLM):
    """(name, how to break that stage, how many prompts the request has)."""
    client = engine.client
    return [
        ("tokenize", lambda mp: mp.setattr(engine.input_processor, "process", boom), 1),
        ("encode", lambda mp: mp.setattr(client, "_enc", _FailingEncoder(client._enc)), 1),
        ("output processor", lambda mp: mp.setattr(engine.output_processor, "add_request", boom), 1),
        ("stream", lambda mp: mp.setattr(async_llm, "_RequestStream", boom), 1),
        ("pending set", lambda mp: mp.setattr(engine, "_pending", _RaisingSet()), 1),
        ("send", lambda mp: mp.setattr(client, "_input", _FailingSocket(client._input)), 1),
        ("encode, second prompt", lambda mp: mp.setattr(client, "_enc", _FailingEncoder(client._enc, 2)), 2),
        ("send, second prompt", lambda mp: mp.setattr(client, "_input", _FailingSocket(client._input, 2)), 2),
    ]


def _left_behind(engine: AsyncLLM) -> dict:
    op = engine.output_processor
    held = {"streams": list(engine.streams), "pending": sorted(engine._pending), "states": list(op.states),
            "children": list(op.child_to_parent), "submitting": getattr(engine, "num_submitting", 0)}
    return {k: v for k, v in held.items() if v}


async def _core_idle(engine: AsyncLLM) -> bool:
    for _ in range(500):
        s = await engine.call_core("stats")
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


async def _response_building_fails(engine: AsyncLLM) -> None:
    """After submission, until a response owns the requests: a failure there aborts them."""
    completion, chat = OpenAIServingCompletion(engine, ["m"]), OpenAIServingChat(engine, ["m"])
    cases = [(completion, serving_completion, "_CompletionEvents",
              CompletionRequest(prompt=["ROMEO:", "JULIET:"], n=2, max_tokens=2, stream=True)),
             (chat, serving_chat, "_ChatEvents",
              ChatCompletionRequest(messages=[{"role": "user", "content": "Speak"}], max_tokens=2, stream=True))]
    for serving, module, events, req in cases:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, events, boom)
            with pytest.raises(Injected):
                await serving.create(req, None)
        assert not _left_behind(engine), f"{events}: {_left_behind(engine)}"
        assert await _core_idle(engine), f"{events}: the core still holds the request"


async def _scenario() -> None:
    engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128, max_num_seqs=8),
                      log_requests=False, max_waiting_requests=8)
    await engine.start()
    try:
        for i, (stage, inject, num_prompts) in enumerate(_stages(engine)):
            prompts = [(f"r{i}-{k}", "ROMEO:") for k in range(num_prompts)]
            with pytest.MonkeyPatch.context() as mp:
                inject(mp)
                with pytest.raises((Injected, zmq.ZMQError)):
                    await engine.add_requests(prompts, PARAMS)
            assert not _left_behind(engine), f"{stage}: {_left_behind(engine)}"
            assert await _core_idle(engine), f"{stage}: the core still holds the request"
        await _response_building_fails(engine)
        # 8 stages x 3 sequences, past max_waiting_requests=8 if any had leaked: the queue is free
        await engine.add_requests([("after", "ROMEO:"), ("after-2", [5, 6, 7])], PARAMS)
        for rid in ("after", "after-2"):
            outs = [o async for o in engine.stream(rid, final_only=True)]
            assert outs[-1].finished and all(len(c.token_ids) == 2 for c in outs[-1].outputs)
        assert not _left_behind(engine)
        await engine.call_core("check_invariants")
    finally:
        await engine.shutdown()


def test_every_failing_stage_of_submission_releases_the_request():
    asyncio.run(_scenario())
