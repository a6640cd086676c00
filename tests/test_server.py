"""The OpenAI-compatible server, end to end: a real `tokenmill serve` subprocess driven by the official
`openai` client (and httpx for raw error cases). One server for the whole module."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from server_fixtures import (CHAT_TEMPLATE, SLOW_MARKER, SLOW_SITECUSTOMIZE, ServerProcess, engine_stats, hook_env,  # noqa: F401
                             tiny_model_dir)

API_KEY = "test-key"
MODEL = "tiny"
ALIAS = "tiny-alias"
PROMPTS = ["To be, or not to be", "All the world's a stage", "Friends, Romans", "Now is the winter"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):  # noqa: F811
    log_dir = tmp_path_factory.mktemp("server")
    # --chat-template: the model's own, plus a variable only chat_template_kwargs set (renders the same without)
    template = log_dir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE + "{% if suffix is defined %}{{ suffix }}{% endif %}"
                        "{% if tools %}[tools: {{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                        "{% for m in messages %}{% for c in m.tool_calls or [] %}[call {{ c.function.name }}"
                        "({{ c.function.arguments.city }})]{% endfor %}{% endfor %}")
    srv = ServerProcess(tiny_model_dir, log_dir / "server.log", "--max-request-body-bytes", "200000",
                        "--max-num-seqs", "64", "--served-model-name", MODEL, ALIAS, "--chat-template",
                        str(template), "--enable-request-id-headers", api_key=API_KEY,
                        env=hook_env(log_dir, SLOW_SITECUSTOMIZE))
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.terminate()
        assert code == 0, f"server exit code {code}:\n{srv.logs()}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):  # noqa: F811
    from tokenmill import LLM

    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory_gb=0.05)


def post(server, path, body=None, headers=None, **kw):
    return httpx.post(server.url + path, json=body, headers={**server.headers, **(headers or {})}, timeout=60, **kw)


# -- basics ---------------------------------------------------------------------------------------------
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    for name in (MODEL, ALIAS):  # OpenAI's "retrieve model"
        card = client.models.retrieve(name)
        assert card.id == name and card.max_model_len == client.models.list().data[0].max_model_len
    _assert_error(httpx.get(server.url + "/v1/models/gpt-17", headers=server.headers), 404, "model")
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_greedy_matches_offline(client, offline):
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = offline.generate(PROMPTS, sp, use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == [w.outputs[0].text for w in want]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    assert resp.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


@pytest.mark.parametrize("continuous", [False, True])
def test_return_token_ids_match_offline(server, offline, continuous):
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole and streamed (prompt ids with the
    first chunk; each chunk's own new ids), on both endpoints; and a required tool call, whose text is held
    back until it is whole, still sends every token id."""
    from tokenmill import SamplingParams

    want = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                            use_tqdm=False)
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = post(server, "/v1/completions", body).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in full["choices"]] == \
        [(w.prompt_token_ids, w.outputs[0].token_ids) for w in want]
    opts = {"include_usage": True, "continuous_usage_stats": continuous}
    chunks = _sse(server, "/v1/completions", {**body, "stream": True, "stream_options": opts})
    for i, w in enumerate(want):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert sum((c["token_ids"] for c in mine), []) == w.outputs[0].token_ids
        assert [c.get("prompt_token_ids") for c in mine] == [w.prompt_token_ids] + [None] * (len(mine) - 1)
    msgs = [{"role": "user", "content": "Who art thou?"}]
    chat_want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)[0]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = post(server, "/v1/chat/completions", chat).json()
    assert r["prompt_token_ids"] == chat_want.prompt_token_ids
    assert r["choices"][0]["token_ids"] == chat_want.outputs[0].token_ids
    chunks = _sse(server, "/v1/chat/completions", {**chat, "stream": True, "stream_options": opts})
    assert all(c["choices"] or c["usage"] for c in chunks)  # (no chunk of its own for the prompt's ids)
    assert [c.get("prompt_token_ids") for c in chunks if "prompt_token_ids" in c] == [chat_want.prompt_token_ids]
    assert "prompt_token_ids" in chunks[0]
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks if c["choices"]), []) == \
        chat_want.outputs[0].token_ids
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3}}, "required": ["a"]}}}]
    forced = {**chat, "max_tokens": 60, "ignore_eos": False, "tools": tools, "tool_choice": "required"}
    whole = post(server, "/v1/chat/completions", forced).json()["choices"][0]
    chunks = _sse(server, "/v1/chat/completions", {**forced, "stream": True})
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks if c["choices"]), []) == whole["token_ids"]


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_bad_words_match_offline(client, offline):
    from tokenmill import SamplingParams

    plain = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    tok, ids = offline.get_tokenizer(), plain[0].outputs[0].token_ids
    banned = offline.llm_engine.input_processor.bad_words_token_ids
    # (the random model's text: a word of it that comes back as one of its tokens)
    words = [next(w for w in (tok.decode([t]).strip() for t in ids) if w and any((t,) in banned([w]) for t in ids))]
    want = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, bad_words=words),
                            use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                     extra_body={"bad_words": words})
    assert [c.text for c in resp.choices] == [w.outputs[0].text for w in want]
    assert want[0].outputs[0].token_ids != ids  # the word was there


def test_streaming_equals_non_streaming_with_usage(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(client, server, chat):
    """stream_options.continuous_usage_stats (vLLM's): every chunk holds one choice and its usage so far (its
    prompt's tokens, its own completion tokens); the last chunk, without choices, the totals."""
    kw = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=1, n=2, extra_body={"ignore_eos": True},
              stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], **kw))
        prompt_len = {0: chunks[-1].usage.prompt_tokens, 1: chunks[-1].usage.prompt_tokens}
    else:
        chunks = list(client.completions.create(prompt=PROMPTS[1:3], **kw))  # choices 0, 1: prompt 1; 2, 3: 2
        lens = [len(post(server, "/tokenize", {"prompt": p}).json()["tokens"]) for p in PROMPTS[1:3]]
        prompt_len = {i: lens[i // 2] for i in range(4)}
    *body, last = chunks
    assert all(len(c.choices) == 1 and c.usage is not None for c in body)
    seen: dict[int, list[int]] = {}
    for c in body:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == prompt_len[i]
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        seen.setdefault(i, []).append(c.usage.completion_tokens)
    assert sorted(seen) == sorted(prompt_len)
    assert all(v == sorted(v) and v[-1] == 6 for v in seen.values())  # each choice's own count, up to 6
    assert last.choices == [] and last.usage.completion_tokens == 6 * len(prompt_len)
    assert last.usage.prompt_tokens == (prompt_len[0] if chat else sum(lens))


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "text_completion"


def test_n_and_seed_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # samples differ from each other
    assert a.usage.completion_tokens == 24
    # streaming n > 1 gives the same texts per index
    parts = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert [parts[i] for i in range(3)] == [c.text for c in a.choices]


def test_streaming_matches_non_streaming_for_every_choice(client):
    """Two prompts x n=2 with echo and logprobs: each streamed choice reassembles into its non-streamed
    twin (text, tokens, offsets), whatever order the four sub-streams interleave in."""
    kw = dict(model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]], n=2, max_tokens=6, temperature=0.8, seed=3,
              echo=True, logprobs=1, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    text, tokens, offsets = {}, {}, {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    assert sorted(text) == [0, 1, 2, 3]
    for c in full.choices:
        assert text[c.index] == c.text and c.text.startswith(PROMPTS[c.index // 2])
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
        offs = c.logprobs.text_offset  # they add up the token strings, prompt tokens first
        assert offs == [sum(len(t) for t in c.logprobs.tokens[:i]) for i in range(len(offs))]

    msgs = [{"role": "user", "content": "Who art thou?"}]
    chat = dict(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True})
    want = client.chat.completions.create(**chat).choices[0].logprobs.content
    got = [t for ch in client.chat.completions.create(stream=True, **chat) if ch.choices and ch.choices[0].logprobs
           for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in got] == \
        [(t.token, t.logprob, len(t.top_logprobs)) for t in want]


def test_logprobs_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0, echo=True,
                                     logprobs=1, extra_body={"ignore_eos": True})
    assert echo.choices[0].text == PROMPTS[2] + resp.choices[0].text
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None and len(elp.tokens) > 5


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(server, client):
    """OpenAI's and vLLM's: the prompt, its logprobs and no completion (evaluation harnesses score prompts this
    way), whole and streamed; max_tokens 0 without echo is a 400 naming it."""
    kw = dict(model=MODEL, prompt=PROMPTS[2], temperature=0, echo=True, logprobs=1)
    with_answer = client.completions.create(**kw, max_tokens=3, extra_body={"ignore_eos": True})
    n_prompt = with_answer.usage.prompt_tokens
    only = client.completions.create(**kw, max_tokens=0, extra_body={"return_token_ids": True})
    ch = only.choices[0]
    assert ch.text == PROMPTS[2] and ch.finish_reason == "length" and only.usage.completion_tokens == 0
    assert ch.logprobs.tokens == with_answer.choices[0].logprobs.tokens[:n_prompt]
    assert ch.logprobs.token_logprobs == with_answer.choices[0].logprobs.token_logprobs[:n_prompt]
    assert ch.model_extra["token_ids"] == []
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == n_prompt
    assert chunks[-1].usage.completion_tokens == 0
    _assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}), 400,
                  "max_tokens")


def test_a_clients_request_id_names_the_response(server):
    """vLLM's X-Request-Id (or the body's request_id): the response's id is cmpl-<id> / chatcmpl-<id>; two requests
    in flight under the same id both run (the engine's own ids stay unique); with --enable-request-id-headers
    every response carries the header, a new id where the request had none."""
    import concurrent.futures as cf

    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: post(server, "/v1/completions", body, {"X-Request-Id": "job-7"}), range(2)))
    assert [r.status_code for r in both] == [200, 200]
    assert [r.json()["id"] for r in both] == ["cmpl-job-7"] * 2
    assert both[0].json()["choices"] == both[1].json()["choices"]
    assert all(r.headers["x-request-id"] == "job-7" for r in both)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "c1"}
    r = post(server, "/v1/chat/completions", chat)
    assert r.json()["id"] == "chatcmpl-c1" and len(r.headers["x-request-id"]) == 32  # (none sent: a new one)
    streamed = post(server, "/v1/chat/completions", {**chat, "stream": True}, {"X-Request-Id": "s9"})
    assert '"id":"chatcmpl-s9"' in streamed.text and streamed.headers["x-request-id"] == "s9"
    _assert_error(post(server, "/v1/completions", {**body, "request_id": ""}), 400, "request_id")
    r = post(server, "/v1/completions", body, {"X-Request-Id": ""})  # (a proxy that always sends the header)
    assert r.status_code == 200 and len(r.json()["id"]) > len("cmpl-") + 8 and len(r.headers["x-request-id"]) == 32
    assert httpx.get(server.url + "/health", timeout=10).headers.get("x-request-id")


def test_vllms_prompt_truncation_and_min_tokens_rules(server):
    """truncate_prompt_tokens -1 keeps what the context holds (vLLM's), above max_model_len it is a 400; a
    min_tokens the context cannot hold is a 400 naming it (it ran and ended by length, short of it)."""
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()
    cut = post(server, "/v1/completions", {**body, "truncate_prompt_tokens": -1}).json()
    assert cut["choices"][0]["text"] == plain["choices"][0]["text"]
    _assert_error(post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 10**6}), 400,
                  "truncate_prompt_tokens")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 10**5}
    _assert_error(post(server, "/v1/chat/completions", chat), 400, "min_tokens")
    many = post(server, "/v1/completions", {**body, "stop": [f"zz{i}" for i in range(100)]})
    assert many.status_code == 200


def test_prompt_logprobs(server, offline):
    """vLLM's prompt_logprobs: per prompt position None (the first) or the prompt token and the top-N, equal to
    the offline engine's; with echo + logprobs asking for fewer, each gets its own number of entries."""
    from tokenmill import SamplingParams

    ids = post(server, "/tokenize", {"prompt": PROMPTS[3]}).json()["tokens"]
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                            use_tqdm=False)[0].prompt_logprobs
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 2, "prompt_logprobs": 3, "echo": True, "logprobs": 1}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None and want[0] is None
    for i in range(1, len(ids)):
        assert str(ids[i]) in got[i] and len(got[i]) <= 4
        assert {int(t): round(v["logprob"], 3) for t, v in got[i].items()} == \
            {t: round(v.logprob, 3) for t, v in want[i].items()}
    assert all(t is None or len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])  # echo's: logprobs=1
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 2,
            "prompt_logprobs": 0}
    r = post(server, "/v1/chat/completions", chat).json()
    assert r["prompt_logprobs"][0] is None and all(len(row) == 1 for row in r["prompt_logprobs"][1:])
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    _assert_error(post(server, "/v1/completions", {**body, "stream": True}), 400, "prompt_logprobs")


def test_token_id_prompts(client, server):
    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == batch.choices[0].text
    assert len(batch.choices) == 2


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    stop = base[6:9]
    assert stop.strip(), f"need a non-blank stop string from {base!r}"
    want = base[: base.index(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_matches_offline(client, offline):
    from tokenmill import SamplingParams

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
    want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want[0].outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids) and r.usage.completion_tokens == 10
    content = r.choices[0].logprobs.content
    assert len(content) == 10 and all(len(t.top_logprobs) == 3 for t in content)
    # each token's own bytes (a piece of a character's too, not U+FFFD's): together, the answer's (this random
    # model writes invalid UTF-8 too, which the answer's text holds as U+FFFD)
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", "replace").startswith(r.choices[0].message.content)
    assert joined.count(b"\xef\xbf\xbd") < r.choices[0].message.content.count("\ufffd")

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 response_format={"type": "text"}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[0].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_chat_continues_the_final_message_and_echoes_it(server, client, offline):
    """vLLM's continue_final_message (the answer continues the assistant's given start, no new turn) with echo
    (the content starts with that start), whole and streamed; /tokenize renders the same prompt; with
    add_generation_prompt left on it is a 400 naming the field."""
    from tokenmill import SamplingParams

    msgs = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "I am"}]
    want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert want.prompt.endswith("<|assistant|>\nI am")
    extra = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={**extra, "echo": True})
    assert r.choices[0].message.content == "I am" + want.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    plain = client.chat.completions.create(**kw, extra_body=extra)
    assert plain.choices[0].message.content == want.outputs[0].text  # without echo: the continuation only
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I am" + want.outputs[0].text
    ids = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                     "continue_final_message": True}).json()["tokens"]
    assert ids == want.prompt_token_ids
    _assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                        "continue_final_message": True}), 400, "continue_final_message")


def test_an_answer_without_a_generation_prompt_has_the_last_messages_role(server, client):
    """vLLM's rule: with add_generation_prompt false the answer continues the last message, so it takes that
    message's role, whole and streamed; with a generation prompt it is --response-role's."""
    import argparse

    from tokenmill.entrypoints.openai.cli_args import add_server_args
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Thou art"}], max_tokens=3, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False})
    assert r.choices[0].message.role == "user"
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"add_generation_prompt": False}))
    assert chunks[0].choices[0].delta.role == "user"
    assert client.chat.completions.create(**kw).choices[0].message.role == "assistant"
    serving = OpenAIServingChat.__new__(OpenAIServingChat)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    serving.response_role = parser.parse_args(["--response-role", "bot"]).response_role
    req = ChatCompletionRequest.model_validate({"messages": kw["messages"]})
    assert serving.role(req) == "bot"
    assert serving.role(req.model_copy(update={"add_generation_prompt": False})) == "user"


def test_a_request_chat_template_needs_the_servers_trust(server):
    """vLLM's rule: a request's own chat_template is refused unless the server runs with
    --trust-request-chat-template (tests/test_tool_parsers.py runs one that does)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages[0].content }}"}
    _assert_error(post(server, "/v1/chat/completions", {"model": MODEL, **body}), 400, "chat_template")
    _assert_error(post(server, "/tokenize", body), 400, "chat_template")


def test_fields_no_schema_knows_are_ignored_and_logged_once(caplog):
    """As vLLM: an unknown request field is ignored, with a warning naming it, once per field (not per request)."""
    import logging

    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = {"messages": [{"role": "user", "content": "x"}], "zz_reasoning_effort": "low", "temperature": 0.5}
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        for _ in range(3):
            req = ChatCompletionRequest.model_validate(body)
        CompletionRequest.model_validate({"prompt": "x", "zz_reasoning_effort": "low"})
        ChatCompletionRequest.model_validate({**body, "zz\nERROR forged line": 1})
    assert req.temperature == 0.5
    logged = [r.getMessage() for r in caplog.records if "zz_reasoning_effort" in r.getMessage()]
    assert len(logged) == 2 and "ChatCompletionRequest" in logged[0] and "CompletionRequest" in logged[1]
    assert not any("\nERROR forged" in r.getMessage() for r in caplog.records)  # names are logged escaped
    assert any("zz\\nERROR forged line" in r.getMessage() for r in caplog.records)


def test_chat_n_seed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Speak"}], max_tokens=6, n=2, seed=7,
              temperature=0.9)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]


def test_chat_streams_one_choice_per_chunk_as_openai_does(client):
    """n = 3, streamed: every chunk carries one choice (clients read choices[0] alone: several choices in one
    chunk lost the others' text), and each choice's chunks join to its non-streamed content."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Speak"}], max_tokens=6, n=3, seed=11,
              temperature=0.9, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert all(len(c.choices) == 1 for c in chunks)
    text: dict[int, str] = {}
    for c in chunks:
        text[c.choices[0].index] = text.get(c.choices[0].index, "") + (c.choices[0].delta.content or "")
    assert text == {c.index: c.message.content for c in whole.choices}
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role) == [0, 1, 2]


def test_chat_text_parts_join_by_lines_and_refusal_parts_read_as_text(server):
    """Text parts go to the template one per line, as vLLM joins them (they ran together: "First.Second."); an
    assistant's refusal part (OpenAI's, an earlier answer replayed) and input_text / output_text read as text."""
    parts = [{"type": "text", "text": "First."}, {"type": "input_text", "text": "Second."}]
    refusal = [{"type": "refusal", "refusal": "No."}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": refusal},
            {"role": "user", "content": "Why?"}]
    as_parts = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    joined = [{"role": "user", "content": "First.\nSecond."}, {"role": "assistant", "content": "No."}, msgs[2]]
    assert as_parts == post(server, "/tokenize", {"messages": joined}).json()["tokens"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"function": {"parameters": {"type": "object"}}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": "no schema"}}]])
@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_malformed_tools_get_400_whatever_the_tool_choice(server, tools, choice):
    """Checked with "required" and named calls only: "none" or no choice sent them to the template as they were."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_logprobs_a_grammar_bans_go_out_as_vllms_minus_9999(server):
    """With a grammar, banned tokens' logprobs are -inf; JSON has none, so they went out as null (which OpenAI's
    clients refuse as a logprob). vLLM sends -9999.0."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 5, "structured_outputs": {"choice": ["yes", "no"]}}
    content = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    values = [t["logprob"] for t in content] + [t["logprob"] for c in content for t in c["top_logprobs"]]
    assert all(isinstance(v, float) and v >= -9999.0 for v in values) and -9999.0 in values, values


def test_unicode_round_trip(server, client):
    text = "你好，世界 🚀🌟 naïve"
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == text
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text.startswith(text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4)
    assert chat.usage.prompt_tokens > len(ids)


# -- errors ------------------------------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int, param: str | None = "any"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err


GOOD = {"model": MODEL, "prompt": "To be", "max_tokens": 2}


@pytest.mark.parametrize("body,param", [
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "seed": 2**63}, "seed"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "max_tokens": "abc"}, "max_tokens"),
    ({**GOOD, "prompt": 123}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "prompt": [999999]}, "prompt"),
    ({**GOOD, "prompt": [5] * 300}, "prompt"),  # longer than max_model_len
    ({**GOOD, "max_tokens": 10_000}, "max_tokens"),
    ({**GOOD, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({**GOOD, "stop": [""]}, "stop"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "", "content": "x"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": 7, "content": "x"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ({**GOOD, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({**GOOD, "guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({**GOOD, "response_format": {"type": "json_object"}, "guided_whitespace_pattern": " *"},
     "guided_whitespace_pattern"),  # (no whitespace regex: with JSON a 400, rather than a pattern ignored)
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>", "schema": {"not": {}}}],
        "triggers": ["<a"]}}, "response_format"),
    ({**GOOD, "response_format": {"type": "structural_tag"}}, "response_format"),
    # a grammar the engine refuses names the field it came in (it named its kind, or a quoted schema keyword)
    ({**GOOD, "response_format": {"type": "structural_tag", "format": {"type": "bogus"}}}, "response_format"),
    ({**GOOD, "structured_outputs": {"json": {"properties": {"a": {"not": {}}}}}}, "structured_outputs"),
    ({**GOOD, "guided_json": {"type": "string", "pattern": "[a", "maxLength": 3}}, "guided_json"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"if": {}}}}}}]}, "tools"),
    ({**GOOD, "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"pattern": "a+"}}, "structured_outputs"),
    ({**GOOD, "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({**GOOD, "allowed_token_ids": []}, "allowed_token_ids"),
    ({**GOOD, "bad_words": [""]}, "bad_words"),
    ({**GOOD, "logit_bias": {"1_0": 1}}, "logit_bias"),
    # wrong types inside structured_outputs once took the engine core down (its message decoder refused them)
    ({**GOOD, "structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"regex": "a", "json_object": 0}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"regex": "a", "grammar": 0}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"regex": "a", "start_after": [2**70]}}, "structured_outputs"),
    ({**GOOD, "structured_outputs": {"regex": "a", "start_after": [10**6]}}, "structured_outputs"),
    ({**GOOD, "bad_words": "x"}, "bad_words"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_values_get_400(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    _assert_error(post(server, path, body), 400, param)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("grammar", [{"json_object": True, "disable_any_whitespace": None},
                                     {"regex": "ab+", "json_object": None, "disable_any_whitespace": False}])
def test_structured_outputs_take_nulls_for_unset_fields(server, grammar):
    r = post(server, "/v1/completions", {**GOOD, "max_tokens": 6, "structured_outputs": grammar})
    assert r.status_code == 200, r.text


def test_openai_edges_as_vllm_answers_them(server):
    """Explicit nulls take the defaults; stream_options without stream is refused; a prompt that leaves no room
    for a completion is refused when max_tokens is left out (it generated past max_model_len); chat's length
    errors name 'messages'; a response names the served alias it was asked for."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {**GOOD, "stream": None, "echo": None, "n": None, "ignore_eos": None,
                                            "skip_special_tokens": None, "stop": None, "seed": None}),
                       ("/v1/chat/completions", {**chat, "stream": None, "n": None, "logprobs": None})):
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
    _assert_error(post(server, "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}), 400,
                  "stream_options")
    _assert_error(post(server, "/v1/completions", {**GOOD, "priority": 3}), 400, "priority")  # fcfs: it is ignored
    limit = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["max_model_len"]
    # max_tokens null: as many as fit
    _assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * limit, "max_tokens": None}), 400,
                  "prompt")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * (limit - 1), "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": " x" * (2 * limit)}]}
    err = post(server, "/v1/chat/completions", long_chat)
    _assert_error(err, 400, "messages")
    assert "'messages'" in err.json()["error"]["message"]
    for name in (MODEL, ALIAS):
        assert post(server, "/v1/completions", {**GOOD, "model": name}).json()["model"] == name
        assert post(server, "/v1/chat/completions", {**chat, "model": name}).json()["model"] == name
    # vLLM's bounds: temperature above OpenAI's 2 and negative (int64) seeds are served; a seed reproduces
    hot = {**GOOD, "max_tokens": 8, "temperature": 5, "seed": -1, "ignore_eos": True}
    texts = [post(server, "/v1/completions", hot).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]
    assert post(server, "/v1/completions", {**hot, "seed": -(2**63)}).status_code == 200
    # vLLM's truncate_prompt_tokens: a prompt past max_model_len, cut to its last 100 tokens
    r = post(server, "/v1/completions", {**GOOD, "prompt": [5] * (limit + 50), "truncate_prompt_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    r = post(server, "/v1/completions", {**GOOD, "prompt": "To be, or not to be. " * 400, "truncate_prompt_tokens": 50})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50  # text past the bytes bound too
    _assert_error(post(server, "/v1/completions", {**GOOD, "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")
    # logit_bias, OpenAI's way (ids as strings, biases clamped to [-100, 100])
    r = post(server, "/v1/completions", {**GOOD, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                         "logit_bias": {"40": 1000}})
    forced = post(server, "/detokenize", {"model": MODEL, "tokens": [40] * 4}).json()["prompt"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == forced and forced
    _assert_error(post(server, "/v1/completions", {**GOOD, "logit_bias": {"x": 1}}), 400, "logit_bias")
    _assert_error(post(server, "/v1/completions", {**GOOD, "logit_bias": {str(10**7): 1}}), 400, "logit_bias")
    # any role, as vLLM: the chat template renders it
    custom = [{"role": "wizard", "content": "x"}]
    r = post(server, "/tokenize", {"model": MODEL, "messages": custom})
    assert r.status_code == 200
    assert "<|wizard|>" in post(server, "/detokenize", {"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]
    assert post(server, "/v1/chat/completions", {**chat, "messages": custom}).status_code == 200
    # --chat-template is the one used, chat_template_kwargs reach it
    r = post(server, "/tokenize", {"model": MODEL, "messages": custom, "chat_template_kwargs": {"suffix": "Zounds"}})
    assert "Zounds" in post(server, "/detokenize", {"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]
    with_kw = post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"suffix": "Zounds"}})
    assert with_kw.json()["usage"]["prompt_tokens"] > post(server, "/v1/chat/completions", chat).json()["usage"][
        "prompt_tokens"]
    # tools: without a tool-call parser "auto" (OpenAI's default with tools) is refused; with "none" (or an
    # explicit null, as vLLM) the tools go to the template (vLLM's default); an agent's history (calls, their
    # JSON arguments parsed, tool answers) goes to the template too. "required" and named functions:
    # test_structured_outputs_and_forced_tool_calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("auto", {"type": "function", "function": {"name": "g"}}):
        _assert_error(post(server, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": choice}), 400,
                      "tool_choice")
    _assert_error(post(server, "/v1/chat/completions", {**chat, "tools": tools}), 400, "tool_choice")  # "auto"
    _assert_error(post(server, "/v1/chat/completions", {**chat, "tool_choice": "none"}), 400, "tool_choice")
    assert post(server, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "none"}).status_code == 200
    assert post(server, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": None}).status_code == 200
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Verona"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert post(server, "/v1/chat/completions", {**chat, "messages": history}).status_code == 200

    def rendered(**body):
        ids = post(server, "/tokenize", {"model": MODEL, **body}).json()["tokens"]
        return post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
    assert "[tools: f]" in rendered(messages=custom, tools=tools)
    assert "[call f(Verona)]" in rendered(messages=history)
    assert not rendered(messages=custom, chat_template_kwargs={"add_generation_prompt": False}).endswith(
        "<|assistant|>\n")  # kwargs may set the template's own variables, as vLLM lets them
    bad = [{**history[1], "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                        "arguments": "{city"}}]}]
    _assert_error(post(server, "/v1/chat/completions", {**chat, "messages": bad}), 400, "messages")


def test_malformed_json_wrong_types_404_401_413(server):
    h = {**server.headers, "content-type": "application/json"}
    _assert_error(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', headers=h), 400)
    _assert_error(httpx.post(server.url + "/v1/completions", content=b'[1, 2]', headers=h), 400)
    _assert_error(post(server, "/v1/completions", {**GOOD, "model": "gpt-17"}), 404, "model")
    _assert_error(httpx.get(server.url + "/v1/nope", headers=server.headers), 404)
    _assert_error(httpx.post(server.url + "/v1/completions", json=GOOD), 401)
    _assert_error(httpx.post(server.url + "/v1/completions", json=GOOD, headers={"Authorization": "Bearer bad"}), 401)
    _assert_error(post(server, "/v1/completions", {**GOOD, "prompt": "x" * 300_000}), 413)
    chunked = httpx.post(server.url + "/v1/completions", headers=h,
                         content=iter([b'{"prompt": "', b"y" * 250_000, b'"}']))
    _assert_error(chunked, 413)
    # and the server keeps serving
    r = post(server, "/v1/completions", GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# -- disconnects, concurrency, metrics ------------------------------------------------------------------------
def _wait_idle(server, timeout=30) -> dict:
    deadline = time.time() + timeout
    while True:
        s = engine_stats(server)
        if (s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0
                and s["num_unfinished_requests"] == 0) or time.time() > deadline:
            return s
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv_blocks(server, stream):
    # the hook makes this prompt's steps take 0.1 s each: the request is surely running when the client leaves
    body = {"model": MODEL, "prompt": SLOW_MARKER, "max_tokens": 200, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
            it = r.iter_lines()
            next(l for l in it if l.startswith("data: "))
            s = engine_stats(server)
            assert s["num_running"] == 1 and s["num_free_kv_blocks"] < s["num_kv_blocks"]
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=0.1)
    s = _wait_idle(server, timeout=8)  # well inside the 20 s the request would run if it were not aborted
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"], s
    assert s["num_running"] == 0 and s["num_unfinished_requests"] == 0, s
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_64_concurrent_streams(server):
    expected = {}
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    for p in PROMPTS:
        expected[p] = sync.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i):
            p = PROMPTS[i % len(PROMPTS)]
            text, finish = "", None
            stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            async for ch in stream:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            return p, text, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 64
    for p, text, finish in results:
        assert text == expected[p] and finish == "length"
    s = _wait_idle(server)
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_metrics(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("tokenmill:time_to_first_token_seconds_count", "tokenmill:inter_token_latency_seconds_count",
                 "tokenmill:e2e_request_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
                 "tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
                 "tokenmill:prefix_cache_hit_rate", "tokenmill:num_preemptions_total",
                 "tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total"):
        assert name in text, name
    ttft = re.search(r'^tokenmill:time_to_first_token_seconds_count\{[^}]*\} (\S+)', text, re.M)
    assert float(ttft.group(1)) > 10
    assert "finished request" in server.logs()


# -- schema fuzzing ----------------------------------------------------------------------------------------
def test_schema_fuzz_no_5xx(server):
    """schemathesis against the server's own OpenAPI document: few examples per operation, no 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, statuses = [], []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in ("/metrics",):
            continue

        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            # keep generations short (2 CPU cores): cap the length and fan-out knobs the fuzzer picks
            if isinstance(case.body, dict) and op.path.startswith("/v1/"):
                for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
                    v = case.body.get(key)
                    if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                        case.body[key] = cap
                if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
                    case.body["max_tokens"] = 4
            r = case.call(headers=server.headers, timeout=60)
            statuses.append(r.status_code)
            if r.status_code >= 500:
                failures.append((op.path, case.body, r.status_code, r.text[:300]))

        check_fn = op.as_strategy()
        from hypothesis import given
        given(check_fn)(check)()
    assert not failures, failures[:5]
    assert len(statuses) > 30 and 400 in statuses and 200 in statuses, statuses
    assert post(server, "/v1/completions", GOOD).status_code == 200


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Verona", "Mantua"]}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "tides", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"port": {"enum": ["Venice"]}}}}}]


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "days"} and args["city"] in ("Verona", "Mantua") and 1 <= args["days"] <= 7


def test_structured_outputs_and_forced_tool_calls(server, client):
    """response_format, vLLM's structured_outputs and guided_* fields constrain the text; tool_choice "required"
    or a named function force calls whose arguments match the tools' schemas, streamed or not."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=120, temperature=0)
    r = client.chat.completions.create(**chat, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "stop" and _weather_ok(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(**chat, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="To be", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="To be", max_tokens=40, temperature=0.8, seed=1,
                                  extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text)
    _assert_error(post(server, "/v1/completions", {**GOOD, "guided_regex": "(unclosed"}), 400, "guided_regex")
    r = post(server, "/v1/completions", {**GOOD, "max_tokens": 240, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"schema": WEATHER}}})  # on completions too, as vLLM
    assert _weather_ok(json.loads(r.json()["choices"][0]["text"]))
    r = post(server, "/v1/completions", {**GOOD, "max_tokens": 240, "temperature": 0, "response_format": {
        "type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "end": "</call>", "content": {
            "type": "json_schema", "json_schema": WEATHER}}}})  # vLLM's structural tags (xgrammar's format)
    text = r.json()["choices"][0]["text"]
    assert text.startswith("<call>") and text.endswith("</call>") and _weather_ok(json.loads(text[6:-7])), text
    the = post(server, "/tokenize", {"model": MODEL, "prompt": " the", "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="To be", max_tokens=3, extra_body={
        "allowed_token_ids": the[-1:], "ignore_eos": True})
    assert r.choices[0].text == post(server, "/detokenize", {"model": MODEL, "tokens": the[-1:] * 3}).json()["prompt"]

    named = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(**chat, tools=TOOLS, tool_choice=named)
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "weather" and _weather_ok(json.loads(call.function.arguments))
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**chat, tools=TOOLS, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for c in calls:
        args = json.loads(c.function.arguments)
        assert _weather_ok(args) if c.function.name == "weather" else args == {"port": "Venice"}
    assert len({c.id for c in calls}) == len(calls)

    for choice in (named, "required"):  # streamed: the same calls, arguments assembled from the deltas
        whole = client.chat.completions.create(**chat, tools=TOOLS, tool_choice=choice).choices[0]
        got, finish = {}, None
        for chunk in client.chat.completions.create(**chat, tools=TOOLS, tool_choice=choice, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    entry = got.setdefault(d.index, {"name": None, "arguments": "", "id": None})
                    entry["id"] = d.id or entry["id"]
                    entry["name"] = (d.function.name if d.function and d.function.name else entry["name"])
                    entry["arguments"] += d.function.arguments or "" if d.function else ""
        assert [(g["name"], json.loads(g["arguments"])) for _, g in sorted(got.items())] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
        assert all(g["id"] for g in got.values()) and finish == whole.finish_reason
