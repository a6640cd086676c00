"""`tokenmill bench ...` (and tune's output directory): bad input gets one line on stderr and exit code 2 before
any benchmark runs, never a traceback; a run whose every request failed says why."""
import asyncio
import shutil
import threading

import pytest
from aiohttp import web

from tokenmill.config import DEFAULT_MODEL
from tokenmill.entrypoints.cli import main


@pytest.fixture(scope="module")
def fake_server():
    """One loopback server, several behaviours by path prefix: /404 and /401 refuse /v1/models; /fail lists a
    model but answers every completion with HTTP 500; /ok streams a two-chunk completion."""
    async def models(request):
        kind = request.match_info["kind"]
        if kind in ("404", "401"):
            return web.Response(status=int(kind), text="nope")
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request):
        if request.match_info["kind"] == "fail":
            return web.Response(status=500, text="boom\ninside")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("hi", " there"):
            await resp.write(b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n' % text.encode())
        if request.match_info["kind"] == "zero":  # a server whose usage says no tokens came
            await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 0}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/{kind}/v1/models", models)
    app.router.add_post("/{kind}/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


SERVE = ["bench", "serve", "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--disable-tqdm"]


@pytest.mark.parametrize("flags, message", [
    (["--base-url", "URL/404"], "URL/404/v1/models answered HTTP 404"),  # an aiohttp traceback
    (["--base-url", "URL/401"], "answered HTTP 401 Unauthorized; pass --api-key"),
    (["--extra-body", "[1]"], "--extra-body: must be a JSON object"),  # a TypeError per request
    (["--extra-body", "3"], "--extra-body: must be a JSON object"),
    (["--extra-body", "{bad"], "--extra-body: not valid JSON"),
    (["--metadata", "novalue"], "--metadata: must be KEY=VALUE"),  # failed after the run
    (["--metric-percentiles", "150"], "--metric-percentiles: must be numbers in (0, 100]"),
    (["--metric-percentiles", "0"], "--metric-percentiles: must be numbers in (0, 100]"),
    (["--metric-percentiles", "50,-1"], "--metric-percentiles: must be numbers in (0, 100]"),
    (["--metric-percentiles", "p99"], "--metric-percentiles: must be numbers in (0, 100]"),
    (["--result-file", "/proc/x"], "--result-file /proc/x: cannot write there"),  # failed after the run
    (["--result-file", "FILE/x.json"], "cannot write there"),  # its directory cannot be made
    (["--result-file", "TMP"], "cannot write there (Is a directory)"),
    (["--tokenizer", "/missing"], "--tokenizer /missing: no such directory"),  # ignored with a note
])
def test_bench_serve_refuses_bad_input_before_the_run(fake_server, tmp_path, capsys, flags, message):
    (tmp_path / "file").write_text("")  # FILE/x.json: a file where a directory would have to be
    for name, value in (("URL", fake_server), ("FILE", str(tmp_path / "file")), ("TMP", str(tmp_path))):
        flags, message = [f.replace(name, value) for f in flags], message.replace(name, value)
    if "--base-url" not in flags:
        flags = ["--base-url", fake_server + "/ok", *flags]
    code, out, err = _run([*SERVE, *flags], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert "Benchmark Result" not in out  # refused before the run, not after it


def test_bench_serve_runs_with_good_flags(fake_server, tmp_path, capsys):
    """The checks above pass good values through (and leave no file behind where the run writes none)."""
    res = tmp_path / "sub" / "r.json"
    code, out, err = _run([*SERVE, "--base-url", fake_server + "/ok", "--extra-body", '{"seed": 1}', "--metadata",
                           "a=b=c", "--metric-percentiles", "50,100", "--result-file", str(res)], capsys)
    assert code == 0 and "P100 TTFT" in out and res.exists(), err


def test_bench_serve_counts_tokens_itself_where_usage_says_none(fake_server, tmp_path, capsys):
    """A usage chunk with completion_tokens 0 (or null) under text that came: the tokens are counted from the text
    (as vLLM does), not reported as 0 from "usage"."""
    import json

    res = tmp_path / "r.json"
    code, out, err = _run([*SERVE, "--base-url", fake_server + "/zero", "--result-file", str(res)], capsys)
    data = json.loads(res.read_text())
    assert code == 0 and all(n > 0 for n in data["output_lens"]) and "usage" not in data["output_lens_source"], data


def test_bench_serve_says_why_every_request_failed(fake_server, capsys):
    code, out, err = _run([*SERVE, "--base-url", fake_server + "/fail"], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "all 2 requests failed; the first: HTTP 500: boom inside" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["bench", "comm", "--node-rank", "5"], "--node-rank must be in [0, 0]"),  # hung, then a traceback
    (["bench", "comm", "--node-rank", "-1"], "--node-rank must be in [0, 0]"),
    (["bench", "comm", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in [0, 1]"),
    (["bench", "ladder", "--model", "/missing"], "--model /missing: no such directory"),  # two tracebacks
    (["bench", "ladder", "--limit-mm-per-prompt", "{bad"], "limit_mm_per_prompt is not a JSON object"),
    (["bench", "ladder", "--limit-mm-per-prompt", "[1]"], "limit_mm_per_prompt must map"),  # failed in each rung
    (["bench", "ladder", "--result-file", "/proc/x"], "--result-file /proc/x: cannot write there"),
    (["bench", "ladder", "--scenario", "long-text", "--chunk-budgets", "x"], "must be positive token counts"),
    (["bench", "ladder", "--num-prompts", "0"], "must be >= 1"),
    (["bench", "offline", "--limit-mm-per-prompt", "{bad"], "limit_mm_per_prompt is not a JSON object"),
    (["bench", "offline", "--result-file", "/proc/x"], "--result-file /proc/x: cannot write there"),
    (["bench", "comm", "--result-file", "/proc/x"], "--result-file /proc/x: cannot write there"),
    (["tune", "--slo", "ttft_p99=500ms", "--output-dir", "/proc/x/y"], "--output-dir /proc/x/y: cannot write"),
])
def test_bench_modes_refuse_bad_input_before_anything_runs(capsys, argv, message):
    if argv[:2] in (["bench", "ladder"], ["bench", "offline"]) and "--model" not in argv or argv[0] == "tune":
        argv = [*argv, "--model", DEFAULT_MODEL]
    code, out, err = _run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert "[ladder] rung" not in out and "Benchmark Result" not in out


def test_bench_offline_names_a_bad_dataset_before_loading_the_model(capsys, tmp_path, monkeypatch):
    import tokenmill.bench.offline as offline

    def no_load(kwargs):
        raise AssertionError("the model was loaded before the dataset was read")

    monkeypatch.setattr(offline, "build_engine", no_load)
    bad = tmp_path / "sharegpt.json"
    bad.write_text('{"conversations": []}')
    code, out, err = _run(["bench", "offline", "--model", DEFAULT_MODEL, "--dataset-name", "sharegpt",
                           "--dataset-path", str(bad), "--num-prompts", "2"], capsys)
    assert code == 2 and "a ShareGPT file is a JSON list of conversations" in err and "Traceback" not in err, err
    broken = tmp_path / "model"  # and a bad config.json is named as such, not as the tokenizer's failure
    shutil.copytree(DEFAULT_MODEL, broken)
    (broken / "config.json").write_text('{"model_type": ')
    code, out, err = _run(["bench", "offline", "--model", str(broken), "--num-prompts", "2"], capsys)
    assert code == 2 and "config.json" in err and "tokenizer" not in err and "Traceback" not in err, err


def test_bench_comm_kills_a_child_rank_that_outlives_its_timeout():
    """Rank 0 failed (its peers wait for it for ever): the child ranks are killed, not left running."""
    import subprocess
    import sys

    from tokenmill.bench.comm import _wait_or_kill

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert _wait_or_kill(child, 0.2) != 0
    assert child.poll() is not None
