"""--reasoning-parser (entrypoints/openai/reasoning_parsers.py): a thinking model's <think>...</think> split from its
answer, the same whole or streamed in any chunks; the server puts it in the message's reasoning_content."""
from __future__ import annotations

import json

import httpx
import pytest

from server_fixtures import ServerProcess, tiny_model_dir  # noqa: F401  (fixture)
from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, Reasoning

CASES = [  # (parser, text, reasoning, content)
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),  # <think> was in the prompt
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("deepseek_r1", "<think>a</think>", "a", None),
    ("deepseek_r1", "a < b and <thin", "a < b and <thin", None),
    ("qwen3", "<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "\n\nYes."),
    ("qwen3", "Yes, without thinking.", None, "Yes, without thinking."),
    ("qwen3", "  <think>x</think>y", "x", "y"),
    ("qwen3", "<thinking is not a tag", None, "<thinking is not a tag"),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "", None, ""),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_whole_and_every_streamed_chunking_split_alike(parser, text, reasoning, content):
    assert REASONING_PARSERS[parser]().extract(text) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            r = Reasoning(parser)
            parts = [r.stream(0, chunk, k == 2) for k, chunk in enumerate([text[:i], text[i:j], text[j:]])]
            got_r, got_c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
            assert got_r == (reasoning or "") and got_c == (content or ""), (i, j, parts)


def test_the_server_puts_reasoning_in_its_own_field(tiny_model_dir, tmp_path):  # noqa: F811
    """The random model never writes </think>: with deepseek_r1 its whole answer is reasoning, streamed or not,
    and a grammar (which starts after the reasoning) never starts."""
    srv = ServerProcess(tiny_model_dir, tmp_path / "server.log", "--reasoning-parser", "deepseek_r1")
    try:
        srv.wait_ready()
        body = {"messages": [{"role": "user", "content": "Think."}], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": httpx.post(srv.url + "/tokenize", json={"messages": body["messages"]}).json()["tokens"],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
        message = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert message["reasoning_content"] == plain and message["content"] is None
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == plain
        assert "".join(d.get("content") or "" for d in deltas) == ""
        # a grammar waits for the end of the reasoning, which this model never writes: the answer is free
        held = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            **body, "structured_outputs": {"choice": ["It is 4."]}}).json()["choices"][0]["message"]
        assert held["reasoning_content"] == plain and held["content"] is None
        # a named tool call cut off in the reasoning: no call (an empty one would not be JSON), content null
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        named = {**body, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
        message = httpx.post(srv.url + "/v1/chat/completions", json=named, timeout=60).json()["choices"][0]["message"]
        assert message["reasoning_content"] == plain and message["content"] is None and not message.get("tool_calls")
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**named, "stream": True}, timeout=60) as s:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert not any(d.get("tool_calls") for d in deltas)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == plain
    finally:
        assert srv.terminate() == 0, srv.logs()


def test_the_cli_offers_every_parser():
    import argparse

    from tokenmill.entrypoints.openai.cli_args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "reasoning_parser")
    assert sorted(choices) == sorted(REASONING_PARSERS)


@pytest.mark.parametrize("parser, prompt, waits", [
    ("deepseek_r1", "<|User|>2+2?<|Assistant|><think>\n", True),
    ("qwen3", "<|im_start|>assistant\n", True),  # enable_thinking: the model opens <think> itself
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking off
])
def test_a_grammar_starts_after_the_reasoning_where_the_model_thinks_first(parser, prompt, waits):
    from types import SimpleNamespace

    from tokenmill import SamplingParams
    from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat

    serving = OpenAIServingChat.__new__(OpenAIServingChat)
    serving.reasoning_parser = parser
    serving.engine = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: [7, 9]))
    params = SamplingParams(structured_outputs={"regex": "a+"})
    split = serving._reasoning(params, prompt)
    assert (split is not None) == waits
    assert params.structured_outputs.start_after == ((7, 9) if waits else ())
    assert serving._reasoning(SamplingParams(), prompt) is not None  # no grammar: always split
