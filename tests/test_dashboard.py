"""/dashboard in a real browser (Debian's chromium, driven by Playwright): under load the page loads, its
charts fill with points and their values move, and the console shows no errors. The data endpoint's
numbers are checked against the load that produced them."""
from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from server_fixtures import ServerProcess, tiny_model_dir  # noqa: F401  (fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("dash") / "serve.log", api_key="sekrit")
    s.wait_ready()
    yield s
    s.terminate()


def load(server, stop: threading.Event, done: list) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        while not stop.is_set():
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "To be, or not", "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            done.append(r.json()["usage"]["completion_tokens"])


def test_dashboard_updates_under_load_without_console_errors(server, tmp_path):
    from playwright.sync_api import sync_playwright

    stop, done = threading.Event(), []
    workers = [threading.Thread(target=load, args=(server, stop, done)) for _ in range(2)]
    for w in workers:
        w.start()
    errors = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1240, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/dashboard")  # no API key: the page and its data are open, as /metrics is
            page.wait_for_function("window.__dash && window.__dash.points >= 6", timeout=60_000)
            first = page.evaluate("window.__dash.last.output_tokens_total")
            page.wait_for_function(f"window.__dash.last.output_tokens_total > {first}", timeout=30_000)
            tps = page.evaluate("window.__dash.ys.tokens[0].filter(v => v > 0).length")
            drawn = page.evaluate("document.querySelectorAll('.chart canvas').length")
            ttft = page.text_content("#tile-ttft")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors, errors
    assert drawn == 6 and tps > 0
    assert ttft not in ("-", "") and float(ttft) > 0
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_dashboard_data_reflects_the_load(server):
    before = httpx.get(server.url + "/dashboard/data").json()
    n = 3
    for _ in range(n):
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    after = httpx.get(server.url + "/dashboard/data").json()
    assert after["output_tokens_total"] - before["output_tokens_total"] == n * 5
    w = after["window"]
    assert w["ttft_p50_ms"] > 0 and w["ttft_p99_ms"] >= w["ttft_p50_ms"] and w["request_rate"] > 0
    assert 0 <= after["engine"]["kv_cache_usage"] <= 1 and after["cpu_percent"] is not None
    assert httpx.get(server.url + "/dashboard/static/uPlot.iife.min.js").status_code == 200
    assert httpx.get(server.url + "/dashboard/static/config.py").status_code in (401, 404)  # only the two files
    assert httpx.post(server.url + "/v1/completions", json={}).status_code == 401  # the API still needs the key


def test_gpu_meter_reads_the_gpu_cuda_sees_as_its_first(monkeypatch):
    """NVML numbers every GPU of the machine and ignores CUDA_VISIBLE_DEVICES: the engine's cuda:0 is the first
    visible entry, by index or by UUID."""
    from tokenmill.nvml import device_handle

    class FakeNvml:
        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return ("index", i)

        @staticmethod
        def nvmlDeviceGetHandleByUUID(u):
            return ("uuid", u)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_handle(FakeNvml) == ("index", 0) and device_handle(FakeNvml, 2) == ("index", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert device_handle(FakeNvml) == ("index", 3) and device_handle(FakeNvml, 1) == ("index", 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a")
    assert device_handle(FakeNvml) == ("uuid", "GPU-8f2a")
