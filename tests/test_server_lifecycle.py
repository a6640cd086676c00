"""Server admission (429 + Retry-After past --max-waiting-requests) and graceful SIGTERM shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from server_fixtures import (SLOW_MARKER, SLOW_SITECUSTOMIZE, ServerProcess, engine_stats, hook_env,  # noqa: F401
                             tiny_model_dir)

BODY = {"model": "tiny", "prompt": "To be, or not to be", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):  # noqa: F811
    log_dir = tmp_path_factory.mktemp("server")
    srv = ServerProcess(tiny_model_dir, log_dir / "server.log", "--max-num-seqs", "1", "--max-waiting-requests",
                        "2", "--shutdown-timeout", "60", env=hook_env(log_dir, SLOW_SITECUSTOMIZE))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def test_queue_full_gets_429_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=BODY) for _ in range(12)))

    rs = asyncio.run(run())
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes, codes
    assert set(codes) <= {200, 429}
    for r in rs:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        else:
            assert len(r.json()["choices"][0]["text"]) > 0
    # capacity comes back
    assert httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60).status_code == 200


def test_sigterm_drains_and_exits_zero(server):
    # the hook slows this prompt to 0.1 s a step: the request is surely in flight through the whole drain
    body = {**BODY, "prompt": SLOW_MARKER, "max_tokens": 20, "stream": True}
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        it = r.iter_lines()
        lines.append(next(l for l in it if l.startswith("data: ")))
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:  # draining has begun
            assert time.time() < deadline, "the server never started draining"
            time.sleep(0.05)
        # no new work is admitted while draining
        try:
            refused = httpx.post(server.url + "/v1/completions", json=BODY, timeout=10).status_code
        except httpx.TransportError:
            refused = "closed"
        assert refused in (503, "closed")
        lines.extend(l for l in it if l.startswith("data: "))
    assert lines[-1] == "data: [DONE]"  # the in-flight request finished
    assert '"finish_reason":"length"' in lines[-2]
    assert server.proc.wait(60) == 0
    assert "draining" in server.logs()


@pytest.fixture(scope="module")
def interval_server(tiny_model_dir, tmp_path_factory):  # noqa: F811
    srv = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("server") / "server.log", "--stream-interval", "4")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def test_stream_interval_groups_tokens_per_chunk(interval_server):
    body = {"model": "tiny", "prompt": "To be, or not to be", "max_tokens": 10, "ignore_eos": True,
            "temperature": 0, "logprobs": 0}
    full = httpx.post(interval_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    per_chunk, text = [], ""
    with httpx.stream("POST", interval_server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"] is not None and choice["logprobs"]["tokens"]:
                    per_chunk.append(len(choice["logprobs"]["tokens"]))
                text += choice["text"]
    assert sum(per_chunk) == 10
    # the first token goes out at once; after it, chunks of at least 4 (the last may be shorter)
    assert all(n >= 4 for n in per_chunk[1:-1]) and len(per_chunk) <= 4, per_chunk
    assert text == full["text"]

    # n > 1: the interval counts each choice's tokens, not the request's
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    with httpx.stream("POST", interval_server.url + "/v1/completions",
                      json={**body, "n": 2, "temperature": 0.8, "seed": 1, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["logprobs"] is not None and choice["logprobs"]["tokens"]:
                        per_choice[choice["index"]].append(len(choice["logprobs"]["tokens"]))
    for counts in per_choice.values():
        assert sum(counts) == 10 and all(n >= 4 for n in counts[1:-1]) and len(counts) <= 4, per_choice


def test_shutdown_past_the_timeout_ends_every_request_cleanly(tiny_model_dir, tmp_path):  # noqa: F811
    """SIGTERM with two requests that outlast --shutdown-timeout (slowed by the hook to ~20 s): while
    draining the server still accepts connections and answers 503 (and /health 503); at the timeout the
    stream gets an error event and [DONE], the non-streaming request a JSON 503; no ASGI exception; exit 0.
    Before the fix new connections were refused at once, and at the timeout uvicorn cancelled the
    requests (a cut stream, a plain-text 500)."""
    srv = ServerProcess(tiny_model_dir, tmp_path / "server.log", "--shutdown-timeout", "5",
                        env=hook_env(tmp_path, SLOW_SITECUSTOMIZE))
    body = {"model": "tiny", "prompt": SLOW_MARKER, "max_tokens": 200, "ignore_eos": True}
    got: dict = {"events": []}

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            got["events"].extend(l for l in r.iter_lines() if l.startswith("data: "))

    def full() -> None:
        got["full"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

    try:
        srv.wait_ready()
        threads = [threading.Thread(target=stream), threading.Thread(target=full)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while engine_stats(srv)["num_running"] < 2:
            assert time.time() < deadline, "the slow requests never started"
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while (health := httpx.get(srv.url + "/health", timeout=10)).status_code == 200:
            assert time.time() < deadline, "never started draining"
            time.sleep(0.02)
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        refused = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
        for t in threads:
            t.join(120)
        events = got["events"]
        assert events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        assert got["full"].status_code == 503, got["full"].text
        assert got["full"].json()["error"]["code"] == 503
        assert srv.proc.wait(60) == 0
        assert "Exception in ASGI application" not in srv.logs()
    finally:
        srv.terminate()


def test_shutdown_kills_an_engine_core_stuck_in_a_step(tmp_path):
    """The core ignores SIGTERM (the API process owns shutdown) and only notices its parent is gone while idle:
    one stuck in a step (a hung worker) outlived the server. Past terminate's wait, shutdown kills it."""
    import subprocess
    import sys
    import types

    from tokenmill.engine.core_client import CoreClient
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert stuck.stdout.readline().strip() == b"up"  # its SIGTERM handler is in place
    closable = types.SimpleNamespace(close=lambda linger=None: None, term=lambda: None)
    client = types.SimpleNamespace(closed=False, send=lambda msg: None, proc=stuck, _input=closable,
                                   _output=closable, _sync_ctx=closable, _actx=closable, _dir=str(tmp_path / "x"))
    t0 = time.time()
    CoreClient.shutdown(client, timeout=0.5)
    assert stuck.poll() == -signal.SIGKILL and time.time() - t0 < 10
