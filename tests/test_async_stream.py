"""AsyncLLM.stream(final_only=True) returns the whole request even when its first tokens arrived (and woke
the stream) before the caller started reading it."""
from __future__ import annotations

import asyncio

from server_fixtures import SLOW_MARKER, SLOW_SITECUSTOMIZE, hook_env
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.sampling_params import SamplingParams


async def _scenario() -> None:  # the engine core runs SLOW_SITECUSTOMIZE: 0.1 s per step of this prompt
    engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128, max_num_seqs=4),
                      log_requests=False)
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True)
        await engine.add_requests([("late", SLOW_MARKER)], params)
        stream = engine.streams["late"]
        while not stream.event.is_set():  # the first tokens wake the stream before anyone reads it
            await asyncio.sleep(0)
        assert not stream.pending.finished
        outs = [o async for o in engine.stream("late", final_only=True)]
        assert len(outs) == 1 and outs[0].finished
        assert [len(c.token_ids) for c in outs[0].outputs] == [20, 20]
        assert [c.index for c in outs[0].outputs] == [0, 1]
    finally:
        await engine.shutdown()


def test_final_only_merges_deltas_that_arrived_before_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", hook_env(tmp_path, SLOW_SITECUSTOMIZE)["PYTHONPATH"])
    asyncio.run(_scenario())
