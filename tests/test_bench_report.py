"""`bench report` renders Markdown + PNGs: CDFs, a request-rate sweep, side by side, and a ladder."""
import json
import subprocess
import sys

import pytest

from tokenmill.bench.metrics import RequestResult, compute_metrics, per_request_fields
from tokenmill.bench.report import LADDER_KIND, ladder_rung, render_report, validate_ladder


def _result(label: str, rate, scale: float) -> dict:
    reqs = [RequestResult(success=True, prompt_len=16, output_tokens=4, ttft=0.1 * scale * (i + 1),
                          itl=[0.02 * scale] * 3, latency=0.1 * scale * (i + 1) + 0.06 * scale, start_time=0.1 * i,
                          output_tokens_source="usage") for i in range(5)]
    d = {"kind": "serve", "label": label, "backend": "openai", "request_rate": rate, "max_concurrency": None}
    d.update(compute_metrics(reqs, 2.0 / scale, [50, 90, 99]))
    d.update(per_request_fields(reqs))
    return d


@pytest.fixture
def files(tmp_path):
    paths = []
    for label, scale in (("tokenmill", 1.0), ("hf", 3.0)):
        for rate in (1.0, 4.0, "inf"):
            p = tmp_path / f"{label}-{rate}.json"
            p.write_text(json.dumps(_result(label, rate, scale if rate != "inf" else scale * 2)))
            paths.append(str(p))
    offline = {**_result("offline", "inf", 0.5), "kind": "offline", "peak_rss_mb": 900.0, "cpu_utilization": 80.0}
    rungs = [ladder_rung("static", "unoptimized baseline", offline),
             ladder_rung("+ continuous batching", "iteration-level scheduling",
                         {**offline, "output_throughput": 2 * offline["output_throughput"]})]
    lad = tmp_path / "ladder.json"
    lad.write_text(json.dumps({"kind": LADDER_KIND, "version": 1, "model": "tiny", "device": "cpu", "rungs": rungs}))
    return paths, str(lad)


def test_render_everything(files, tmp_path):
    paths, lad = files
    out = tmp_path / "report"
    md = render_report(paths + [lad], str(out), title="T")
    text = open(md).read()
    for png in ("latency_cdf.png", "throughput_vs_rate.png", "side_by_side.png", "ladder_ladder.png"):
        assert f"({png})" in text and (out / png).stat().st_size > 5000, png
    assert "tokenmill @ 4 req/s" in text and "hf @ inf req/s" in text  # same label, several rates: named apart
    assert "| static | unoptimized baseline |" in text and "throughput 2.00x" in text
    assert "900" in text  # peak memory in the ladder table


def test_single_result_and_cli(files, tmp_path):
    paths, _ = files
    out = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "bench", "report", paths[0], "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (out / "report.md").read_text()
    assert "latency_cdf.png" in text and "side_by_side.png" not in text  # one file: nothing to compare


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="rungs"):
        validate_ladder({"kind": LADDER_KIND, "rungs": []})
    with pytest.raises(ValueError, match="lacks"):
        validate_ladder({"kind": LADDER_KIND, "rungs": [{"name": "x"}]})
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="neither"):
        render_report([str(p)], str(tmp_path / "o"))


def _ok_ladder() -> dict:
    rung = ladder_rung("static", "baseline", {**_result("x", "inf", 1.0), "peak_rss_mb": 900.0,
                                              "cpu_utilization": 80.0})
    return {"kind": LADDER_KIND, "version": 1, "rungs": [rung]}


@pytest.mark.parametrize("content, message", [
    ("{bad", "not a JSON file"),
    ("[1]", "neither a bench result nor a ladder file (a JSON list"),  # a TypeError
    ("3", "(a JSON int"),
    ({"output_throughput": None}, "['output_throughput'] missing or of the wrong type"),
    ({"completed": "5"}, "['completed'] missing or of the wrong type"),
    ({"request_rate": "fast"}, "['request_rate'] missing"),
    ({"label": ["a"]}, "['label'] missing"),  # unhashable
    ({"p99_ttft_ms": "slow"}, "['p99_ttft_ms'] missing"),
    ({"latencies": [0.1]}, "['ttfts', 'output_lens', 'itls'] are not lists as long as 'latencies'"),
    ({"itls": 3}, "per-request samples ['itls']"),
    ({"ttfts": ["x"] * 5}, "request 0's samples (ttfts, latencies, output_lens, itls) are not numbers"),
    ({"successes": True}, "['successes / errors']"),
    ("LADDER", None),
    ({"rungs": [1]}, "ladder rung 0 is a int, not an object"),  # an AttributeError
    ({"rungs": [{"name": "x"}]}, "lacks"),
    ({"p99_ttft_ms": "slow"}, "ladder rung 0 (static): ['p99_ttft_ms'] of the wrong type"),
    ({"by_length_class": {"long": 3}}, "['by_length_class'] of the wrong type"),
    ({"pending": "soon"}, "the ladder's 'pending' must be a list"),
])
def test_report_names_the_file_and_what_is_wrong(tmp_path, capsys, content, message):
    """Malformed inputs raised AttributeError / TypeError / KeyError; now one line naming the file."""
    from tokenmill.entrypoints.cli import main

    if isinstance(content, dict) and ("rungs" in content or message.startswith(("ladder", "['by_length", "the l"))):
        lad = _ok_ladder()
        if "rungs" in content:
            lad.update(content)
        elif "pending" in content:
            lad["pending"] = content["pending"]
        else:
            lad["rungs"][0].update(content)
        content = json.dumps(lad)
    elif isinstance(content, dict):
        content = json.dumps({**_result("x", 2.0, 1.0), **content})
    elif content == "LADDER":  # the well-formed files still render
        content, message = json.dumps(_ok_ladder()), None
    path = tmp_path / "in.json"
    path.write_text(content)
    code = main(["bench", "report", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and f"error: {path}: " in err and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_p99_is_a_gap_not_the_median_under_a_p99_title(tmp_path, monkeypatch):
    """Runs made with --metric-percentiles 50,90 have no p99: the rate sweep plotted their median as "P99 TTFT",
    and the side-by-side bars drew the missing figure as 0."""
    import math

    import matplotlib.axes

    from tokenmill.bench import report

    runs = []
    for rate in (1.0, 2.0):
        r = _result("x", rate, 1.0)
        runs.append({k: v for k, v in r.items() if not k.startswith("p99_")})
    plotted, bars = [], []
    real_plot, real_bar = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, xs, ys, *a, **k: (
        plotted.append((ax.get_title(), list(ys))), real_plot(ax, xs, ys, *a, **k))[1])
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, xs, hs, *a, **k: (
        bars.append(list(hs)), real_bar(ax, xs, hs, *a, **k))[1])
    assert report.plot_rate_sweep(runs, tmp_path) == "throughput_vs_rate.png"
    assert len(plotted) == 3 and all(math.isnan(y) for _, ys in plotted[1:] for y in ys), plotted
    fig, ax = report._plt().subplots()
    report._bars(ax, ["a", "b"], [None, 3.0], "P99 E2EL")
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["n/a", "3"], labels
