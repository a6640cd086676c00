"""Streaming with speculation: a step that accepts several drafts hands them out in one delta, and the
deltas add up to plain decoding's output, stop strings inside an accepted run included (AsyncLLM, the
server's streaming path)."""
from __future__ import annotations

import asyncio
import json

from tokenmill import LLM
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.sampling_params import SamplingParams

PROMPT = "ROMEO:\nBut soft, what light"
# the target as its own draft: every draft is accepted, so steps emit several tokens
SPEC = json.dumps({"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 3, "adaptive": False})


async def _stream_all(params: list[SamplingParams]) -> list[list[tuple[list[int], str, str | None]]]:
    engine = AsyncLLM(EngineConfig(model=DEFAULT_MODEL, dtype="float32", max_model_len=128, max_num_seqs=4,
                                   speculative_config=SPEC), log_requests=False)
    await engine.start()
    try:
        out = []
        for i, sp in enumerate(params):
            deltas = []
            async for o in engine.generate(PROMPT, sp, str(i)):
                c = o.outputs[0]
                deltas.append((list(c.token_ids), c.text, c.finish_reason))
            out.append(deltas)
        return out
    finally:
        await engine.shutdown()


def test_streamed_deltas_of_accepted_runs_add_up_to_plain_decoding():
    plain = LLM(DEFAULT_MODEL, dtype="float32", max_model_len=128)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([PROMPT], base, use_tqdm=False)[0].outputs[0]
    stops = [want.text[i:i + 4] for i in (9, 17, 26) if want.text[i:i + 4].strip()]
    params = [base] + [SamplingParams(temperature=0, max_tokens=40, stop=[s]) for s in stops]
    streams = asyncio.run(_stream_all(params))
    for sp, deltas in zip(params, streams):
        ref = plain.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
        assert [t for d in deltas for t in d[0]] == list(ref.token_ids)
        assert "".join(d[1] for d in deltas) == ref.text
        assert deltas[-1][2] == ref.finish_reason and all(d[2] is None for d in deltas[:-1])
    assert max(len(d[0]) for d in streams[0]) > 1  # accepted drafts reached the stream as one delta
    assert any(deltas[-1][2] == "stop" for deltas in streams[1:])
