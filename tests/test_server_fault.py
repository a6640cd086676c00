"""A failing engine step takes nothing down: the requests in flight get a 500 error, their KV blocks are
freed, and the server keeps serving. The fault is injected from outside the package: a sitecustomize on
the server's PYTHONPATH (it loads in the engine-core process too) makes ModelRunner.execute raise when a
scheduled sequence carries a marker token sequence (or, for the late marker, once it has output tokens)."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from server_fixtures import (SLOW_MARKER, SLOW_SITECUSTOMIZE, ServerProcess, core_pid, engine_stats,  # noqa: F401
                             hook_env, tiny_model_dir)

MARKER = [7] * 13  # fails on its first step
LATE_MARKER = [8] * 13  # fails once it has generated 5 tokens

SITECUSTOMIZE = f'''
import time

from tokenmill.worker import model_runner

_marker, _late = {MARKER!r}, {LATE_MARKER!r}
_execute = model_runner.ModelRunner.execute


def execute(self, sched):
    for s in sched.seqs:
        state = s.new_request or self.requests[s.request_id]  # the worker's view of the request
        head = list(state.prompt_token_ids[:len(_marker)])
        if head == _marker or (head == _late and len(state.output_token_ids) >= 5):
            raise RuntimeError("injected fault")
    time.sleep(0.02)  # every step: a 200-token stream surely outlasts another request's admission and 5 steps
    return _execute(self, sched)


model_runner.ModelRunner.execute = execute
'''


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dir, tmp_path_factory):  # noqa: F811
    hook_dir = tmp_path_factory.mktemp("fault")
    srv = ServerProcess(tiny_model_dir, hook_dir / "server.log", env=hook_env(hook_dir, SITECUSTOMIZE))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def test_failing_step_fails_in_flight_requests_and_serving_continues(faulty_server):
    url = faulty_server.url + "/v1/completions"
    good = {"model": "tiny", "prompt": "To be", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    before = httpx.post(url, json=good, timeout=60)
    assert before.status_code == 200

    bad = httpx.post(url, json={**good, "prompt": MARKER}, timeout=60)
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["code"] == 500 and "injected fault" in bad.json()["error"]["message"]

    with httpx.stream("POST", url, json={**good, "prompt": MARKER, "stream": True}, timeout=60) as r:
        lines = [l for l in r.iter_lines() if l.startswith("data: ")]
    assert "injected fault" in lines[0] and lines[-1] == "data: [DONE]"

    deadline = time.time() + 30
    while (s := engine_stats(faulty_server))["num_free_kv_blocks"] != s["num_kv_blocks"] and time.time() < deadline:
        time.sleep(0.1)
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_unfinished_requests"] == 0, s
    after = httpx.post(url, json=good, timeout=60)
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert "engine step failed" in faulty_server.logs()


def test_failure_after_output_reaches_waiting_and_streaming_clients(faulty_server):
    """A request that already holds undelivered tokens (non-streaming ones are woken only at the end) must
    still get its error, and so must a chat stream that merely shared the failed step."""
    url = faulty_server.url
    late = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": LATE_MARKER, "max_tokens": 50,
                                                      "ignore_eos": True}, timeout=60)
    assert late.status_code == 500 and "injected fault" in late.json()["error"]["message"]

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Speak"}], "max_tokens": 200, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "ignore_eos": True}, timeout=60) as r:
        it = (l for l in r.iter_lines() if l.startswith("data: "))
        events.append(next(it))  # the chat is generating; now another request's step fails under it
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": LATE_MARKER, "max_tokens": 50,
                                                  "ignore_eos": True}, timeout=60)
        events.extend(it)
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:]) for e in events[:-1] if '"error"' in e]
    assert errors and errors[0]["error"]["code"] == 500 and "injected fault" in errors[0]["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "To be", "max_tokens": 2},
                      timeout=60).status_code == 200


def _kill_core_mid_stream(srv) -> list[str]:
    """Kill -9 the engine core while a stream runs (slowed by the hook to 20 s); the stream's events."""
    body = {"model": "tiny", "prompt": SLOW_MARKER, "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        it = (l for l in r.iter_lines() if l.startswith("data: "))
        events.append(next(it))
        os.kill(core_pid(srv), signal.SIGKILL)
        events.extend(it)
    return events


def test_engine_core_death_ends_the_server_with_an_error_code(tiny_model_dir, tmp_path):  # noqa: F811
    """vLLM's semantics: the requests in flight fail (503 event, [DONE]), then the API process exits non-zero
    so a supervisor restarts it. Before the fix it answered 503 forever and exited 0 when stopped."""
    srv = ServerProcess(tiny_model_dir, tmp_path / "server.log", env=hook_env(tmp_path, SLOW_SITECUSTOMIZE))
    try:
        srv.wait_ready()
        events = _kill_core_mid_stream(srv)
        assert events[-1] == "data: [DONE]" and any('"code":503' in e for e in events), events[-3:]
        code = srv.proc.wait(60)  # a generous bound: it exits within a few seconds
        assert code != 0, srv.logs()
        assert "Exception in ASGI application" not in srv.logs()
    finally:
        srv.terminate()


def test_engine_core_death_with_keep_alive_leaves_the_api_answering(tiny_model_dir, tmp_path):  # noqa: F811
    """--keep-alive-on-engine-death: the stream ends with a 503 event and [DONE], and the API process keeps
    answering (503 on /health and for new work) instead of blocking on a send to the dead core when the
    stream's cleanup aborts its request; stopped, it still reports the failure."""
    srv = ServerProcess(tiny_model_dir, tmp_path / "server.log", "--keep-alive-on-engine-death",
                        env=hook_env(tmp_path, SLOW_SITECUSTOMIZE))
    try:
        srv.wait_ready()
        events = _kill_core_mid_stream(srv)
        assert events[-1] == "data: [DONE]"
        assert any('"code":503' in e for e in events), events[-3:]
        for _ in range(3):  # the stream's cleanup ran; the event loop still serves
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "To be"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
    finally:
        assert srv.terminate() == 1
