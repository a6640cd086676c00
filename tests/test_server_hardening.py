"""Hostile and malformed input against a real `tokenmill serve` (issue 12): what a request registers is
released whatever fails; unencodable text gets a 400 naming its field; big prompts are refused before they
are tokenized and tokenization never blocks the event loop; which endpoints need the API key; strict types
and precise union errors; OpenAI-shaped errors even for malformed HTTP.

A sitecustomize hook wraps the tokenizer's `encode` in the API process: it records every call with a large
text, and it blocks (without the GIL, as the Rust tokenizer does) on a text carrying BLOCK_MARKER until
the test creates a release file."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from server_fixtures import ServerProcess, engine_stats, hook_env, tiny_model_dir  # noqa: F401  (fixture)

API_KEY = "hardening-key"
BLOCK_MARKER = "BLOCK-TOKENIZER"
BIG = 50_000  # chars: a text this long is worth recording

SITECUSTOMIZE = f'''
import os, time

from tokenmill.engine import input_processor as _ip

_dir = os.environ["TOKENMILL_TEST_SPY_DIR"]
_load = _ip.load_tokenizer


def _spy(encode):
    def wrapped(text, *args, **kwargs):
        if isinstance(text, str) and len(text) > {BIG}:
            with open(os.path.join(_dir, "big-encodes"), "a") as f:
                f.write(f"{{len(text)}}\\n")
        if isinstance(text, str) and {BLOCK_MARKER!r} in text:
            open(os.path.join(_dir, "blocked"), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(_dir, "release")) and time.time() < deadline:
                time.sleep(0.01)
        return encode(text, *args, **kwargs)
    return wrapped


def load_tokenizer(*args, **kwargs):
    tok = _load(*args, **kwargs)
    tok.encode = _spy(tok.encode)
    return tok


_ip.load_tokenizer = load_tokenizer
'''


@pytest.fixture(scope="module")
def spy_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spy")


@pytest.fixture(scope="module")
def server(tiny_model_dir, spy_dir):  # noqa: F811
    env = {**hook_env(spy_dir, SITECUSTOMIZE), "TOKENMILL_TEST_SPY_DIR": str(spy_dir)}
    srv = ServerProcess(tiny_model_dir, spy_dir / "server.log", api_key=API_KEY, env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.terminate() == 0, srv.logs()


def raw_post(server, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    """A body as bytes: JSON escapes such as \\ud800 that no client-side encoder would produce."""
    h = {"content-type": "application/json", **server.headers, **(headers or {})}
    return httpx.post(server.url + path, content=body, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param != "any":
        assert err["param"] == param, err
    return err


def big_encodes(spy_dir) -> list[int]:
    path = spy_dir / "big-encodes"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def wait_idle(server, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while True:
        s = engine_stats(server)
        if (s["num_unfinished_requests"] == 0 and s["num_pending_sequences"] == 0 and s["num_waiting"] == 0
                and s["num_running"] == 0) or time.time() > deadline:
            return s
        time.sleep(0.1)


GOOD = {"model": "tiny", "prompt": "To be", "max_tokens": 2}


# -- 1. a failed submission releases what it registered -------------------------------------------------------
def test_failed_submission_leaves_nothing_pending(server):
    """The probe's request: its stop string cannot be encoded. Before the fix every one left 64 pending
    sequences behind, and after 16 of them every client got 429 for good."""
    body = b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"], "n": 64, "max_tokens": 2}'
    for _ in range(17):
        assert_error(raw_post(server, "/v1/completions", body), 400, "stop")
    s = wait_idle(server)
    assert s["num_pending_sequences"] == 0 and s["num_unfinished_requests"] == 0, s
    r = httpx.post(server.url + "/v1/completions", json={**GOOD, "n": 64}, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text


# -- 2. unencodable text -----------------------------------------------------------------------------------------
MSG = '"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "\\ud800 hi"}', "prompt"),
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "stream": true}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "hi \\udfff"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # a surrogate encoded as raw UTF-8 bytes
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "user": "\\ud800"}', "user"),
    ("/v1/completions", b'{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "stream": true}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{' + MSG.encode() + b', "stop": ["ok", "\\ud800"]}', "stop"),
    ("/tokenize", b'{"prompt": "\\ud800 hi"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', "model"),
])
def test_unencodable_text_gets_400_naming_the_field(server, path, body, param):
    err = assert_error(raw_post(server, path, body), 400, param)
    assert "Unicode" in err["message"], err
    for leak in ("TextEncodeInput", "codec", "Traceback", "TypeError"):
        assert leak not in err["message"], err


# -- 3. big prompts: refused before tokenizing; tokenizing off the event loop; the key -------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "To be, or not to be. " * 50_000}),
    ("/v1/completions", {"model": "tiny", "prompt": ["short", "To be, or not to be. " * 50_000], "stream": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a b " * 300_000}]}),
    ("/tokenize", {"prompt": "x y " * 300_000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "a b " * 300_000}]}),
])
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(server, spy_dir, path, body):
    before = big_encodes(spy_dir)
    err = assert_error(httpx.post(server.url + path, json=body, headers=server.headers, timeout=60), 400)
    assert err["param"] in ("prompt", "messages") and "max_model_len" in err["message"], err
    assert big_encodes(spy_dir) == before, "the big prompt was tokenized before it was refused"


def test_tokenize_refuses_a_prompt_longer_than_the_context(server):
    ids = list(range(10, 10 + 300))
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers).json()["prompt"]
    err = assert_error(httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.headers), 400)
    assert "max_model_len" in err["message"]


def test_detokenize_refuses_ids_outside_the_vocabulary(server):
    r = httpx.post(server.url + "/detokenize", json={"tokens": [5, 10**9]}, headers=server.headers)
    assert_error(r, 400, "tokens")


def test_health_and_token_id_requests_answer_while_a_tokenization_runs(server, spy_dir):
    """A tokenization that takes forever (blocked by the hook) must not block the event loop: /health and a
    request that needs no tokenizer are answered meanwhile. Before the fix neither could answer until the
    tokenization ended, which here is never (the test times out instead)."""
    result = {}

    def slow() -> None:
        body = {"model": "tiny", "prompt": f"{BLOCK_MARKER} To be", "max_tokens": 2}
        result["r"] = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)

    t = threading.Thread(target=slow)
    t.start()
    try:
        deadline = time.time() + 60
        while not (spy_dir / "blocked").exists():
            assert time.time() < deadline, "the tokenizer hook never ran"
            time.sleep(0.02)
        health = httpx.get(server.url + "/health", timeout=15)
        assert health.status_code == 200
        ids = httpx.post(server.url + "/v1/completions", json={**GOOD, "prompt": [5, 6, 7]}, headers=server.headers,
                         timeout=15)
        assert ids.status_code == 200, ids.text
    finally:
        (spy_dir / "release").touch()
        t.join(120)
    assert result["r"].status_code == 200, result["r"].text


def test_several_api_keys_and_vllms_environment_variable(monkeypatch):
    """--api-key takes several keys, as vLLM's does (the second was read as the model); VLLM_API_KEY counts as
    TOKENMILL_API_KEY does (a vLLM deployment's environment left the server open, without a word)."""
    import argparse

    from tokenmill.entrypoints.openai.api_server import api_keys
    from tokenmill.entrypoints.openai.cli_args import add_server_args
    from tokenmill.entrypoints.openai.guard import GuardMiddleware

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args(["--api-key", "k1", "k2"]).api_key == ["k1", "k2"]
    guard = GuardMiddleware(None, ["k1", "k2"], 1 << 20, None)
    assert all(guard._authorized({b"authorization": f"Bearer {k}".encode()}) for k in ("k1", "k2"))
    assert not guard._authorized({b"authorization": b"Bearer k3"}) and not guard._authorized({})
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) is None and api_keys(["k"]) == ["k"]
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_keys(None) == ["from-vllm"]
    monkeypatch.setenv("TOKENMILL_API_KEY", "ours")
    assert api_keys(None) == ["ours"]


def test_api_key_guards_tokenizer_and_debug_endpoints(server):
    for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/debug/engine_stats", None), ("GET", "/v1/models", None)):
        assert_error(httpx.request(method, server.url + path, json=body), 401)
        ok = httpx.request(method, server.url + path, json=body, headers=server.headers)
        assert ok.status_code == 200, (path, ok.text)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path


# -- 8. strict types, union errors, malformed HTTP, /health --------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "echo": 0}, "echo"),
    ({**GOOD, "ignore_eos": 1}, "ignore_eos"),
    ({**GOOD, "n": "2"}, "n"),
    ({**GOOD, "max_tokens": "2"}, "max_tokens"),
    ({**GOOD, "temperature": "0.5"}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": "true"}, "logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_loose_types_are_refused(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(httpx.post(server.url + path, json=body, headers=server.headers), 400, param)


@pytest.mark.parametrize("body,where,what", [
    ({**GOOD, "prompt": [-1]}, "'prompt[0]'", "greater than or equal to 0"),
    ({**GOOD, "prompt": [5, "x"]}, "'prompt[1]'", "valid integer"),
    ({**GOOD, "prompt": [[5, 6], [7, -2]]}, "'prompt[1][1]'", "greater than or equal to 0"),
    ({**GOOD, "prompt": ["a", 5]}, "'prompt[1]'", "valid string"),
    ({**GOOD, "prompt": 123}, "'prompt'", "a list of token ids"),
    ({**GOOD, "prompt": [1.5]}, "'prompt[0]'", "valid integer"),
    ({**GOOD, "stop": [5]}, "'stop[0]'", "valid string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "'messages[0].content'", "string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "'messages[0].content[0].text'", "valid string"),
])
def test_union_errors_name_the_real_problem(server, body, where, what):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_error(httpx.post(server.url + path, json=body, headers=server.headers), 400)
    assert where in err["message"] and what in err["message"], err
    assert ".str" not in err["message"] and "list[" not in err["message"], err


def test_malformed_http_gets_an_openai_style_400(server):
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: abc\r\n\r\n{}")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert httpx.get(server.url + "/health").status_code == 200  # and the server keeps serving


def _raw_exchange(server, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed mid-send
            pass
        raw = b""
        try:
            while chunk := s.recv(65536):
                raw += chunk
        except ConnectionResetError:
            pass
    return raw


def test_an_oversized_request_head_is_a_431_not_a_stall(server):
    """httptools bounded nothing before the body: a 128 MiB header was read whole, at a cost growing with its
    square on the event loop (every stream stalled for seconds). Past 64 KiB the head is a JSON 431 and the
    connection closes; a 32 KiB header, and requests kept alive after it, are served."""
    t = time.perf_counter()
    raw = _raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * (8 << 20) + b"\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), raw[:200]
    assert json.loads(body)["error"]["code"] == 431 and time.perf_counter() - t < 10
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"b" * (32 << 10) + b"\r\n\r\n"
    raw = _raw_exchange(server, ok + ok[:-4] + b"\r\nConnection: close\r\n\r\n")  # two, kept alive
    assert raw.count(b"HTTP/1.1 200") == 2, raw[:300]


def test_health_is_json(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"status": "ok"}


def test_a_template_error_is_a_400_on_the_multimodal_path_too():
    """Any role reaches the template (as vLLM); one the template refuses (raise_exception, an undefined
    variable) is the client's error: 400 naming 'messages', on the multimodal path as on the text one."""
    import types

    import jinja2

    from tokenmill.entrypoints.openai.errors import APIError
    from tokenmill.entrypoints.openai.serving_chat import _render

    def refuse(*a, **k):
        raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant/user/assistant")
    for mm in (None, object()):
        ip = types.SimpleNamespace(mm=mm, chat_prompt=refuse, chat_text=refuse)
        with pytest.raises(APIError) as e:
            _render(types.SimpleNamespace(input_processor=ip), [{"role": "wizard", "content": "x"}], True, None)
        assert e.value.status == 400 and e.value.param == "messages"
