"""Benchmark metric math against hand-computed cases (vLLM's definitions), and arrival times."""
import math
import random

import numpy as np
import pytest

from tokenmill.bench.arrivals import arrival_times
from tokenmill.bench.metrics import (RequestResult, compute_metrics, format_table, meets_slos, parse_goodput,
                                     peak_concurrency, peak_output_tokens_per_s, per_request_fields,
                                     percentile_word, results_from_json, summarize, tpot)


def _r(prompt, out, ttft, itl, latency, start, ok=True):
    return RequestResult(success=ok, prompt_len=prompt, output_tokens=out, ttft=ttft, itl=itl, latency=latency,
                         start_time=start)


@pytest.fixture
def runs():
    return [
        _r(10, 5, 0.1, [0.05, 0.05, 0.1, 0.1], 0.4, 0.0),  # TPOT (0.4-0.1)/4 = 75 ms
        _r(20, 1, 0.2, [], 0.2, 0.5),                        # one token: no TPOT sample
        _r(99, 0, 0.0, [], 0.0, 0.2, ok=False),             # failed: counts only in 'failed'
        _r(30, 3, 0.3, [0.2, 0.2], 0.7, 0.1),                # TPOT (0.7-0.3)/2 = 200 ms
    ]


def test_tpot_definition(runs):
    assert tpot(runs[0]) == pytest.approx(0.075)
    assert tpot(runs[1]) is None
    assert tpot(runs[3]) == pytest.approx(0.2)


def test_aggregates_hand_computed(runs):
    m = compute_metrics(runs, duration_s=2.0, percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["request_goodput"] is None
    # TTFT samples 100, 200, 300 ms; numpy linear interpolation: p90 at index 1.8 -> 280
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)
    assert m["p99_ttft_ms"] == pytest.approx(298)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    # TPOT samples 75, 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(137.5)
    assert m["p90_tpot_ms"] == pytest.approx(187.5)
    assert m["p99_tpot_ms"] == pytest.approx(198.75)
    # ITL: all gaps pooled: 50 50 100 100 200 200
    assert m["mean_itl_ms"] == pytest.approx(700 / 6)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p90_itl_ms"] == pytest.approx(200)
    # E2EL 200, 400, 700: p90 at index 1.8 -> 640
    assert m["mean_e2el_ms"] == pytest.approx(1300 / 3)
    assert m["p90_e2el_ms"] == pytest.approx(640)
    assert m["p99_e2el_ms"] == pytest.approx(694)


def test_goodput(runs):
    # ttft<=250 and tpot<=100: request 1 (100 ms, 75 ms) and 2 (200 ms, one token -> TPOT 0) pass; 4 fails on TTFT
    m = compute_metrics(runs, 2.0, [99], {"ttft": 250, "tpot": 100})
    assert m["request_goodput"] == pytest.approx(1.0)
    m = compute_metrics(runs, 2.0, [99], {"e2el": 300})
    assert m["request_goodput"] == pytest.approx(0.5)
    assert meets_slos(runs[0], {"ttft": 100})  # SLO is inclusive (value <= SLO)
    assert not meets_slos(runs[0], {"tpot": 74.9})


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "TPOT:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft=5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peak_concurrency_half_open():
    assert peak_concurrency([_r(1, 1, 0, [], 1.0, 0.0), _r(1, 1, 0, [], 1.0, 1.0)]) == 1  # back to back
    assert peak_concurrency([_r(1, 1, 0, [], 1.0, 0.0), _r(1, 1, 0, [], 1.0, 0.5)]) == 2
    runs = [_r(1, 1, 0, [], 0.4, 0.0), _r(1, 1, 0, [], 0.2, 0.5), _r(1, 1, 0, [], 0.7, 0.1),
            _r(1, 1, 0, [], 9.0, 0.0, ok=False)]
    assert peak_concurrency(runs) == 2


def test_peak_output_tokens_per_s():
    # chunks at 0.5, 1.2, 1.4, 1.9 (request a) and 1.1 (request b): bucket [1, 2) holds 4
    runs = [_r(1, 4, 0.5, [0.7, 0.2, 0.5], 1.9, 0.0), _r(1, 1, 0.1, [], 0.1, 1.0)]
    assert peak_output_tokens_per_s(runs) == 4
    assert peak_output_tokens_per_s([]) == 0


def test_empty_and_percentile_words():
    m = compute_metrics([_r(1, 0, 0, [], 0, 0, ok=False)], 1.0, [99.9])
    assert m["completed"] == 0 and m["failed"] == 1 and m["p99.9_ttft_ms"] == 0.0
    assert percentile_word(99) == "99" and percentile_word(99.9) == "99.9" and percentile_word(50.0) == "50"
    s = summarize([0.001, 0.003], [50])
    assert s == {"mean": pytest.approx(2.0), "median": pytest.approx(2.0), "std": pytest.approx(1.0),
                 "p50": pytest.approx(2.0)}


def test_round_trip_and_table(runs):
    d = {**compute_metrics(runs, 2.0, [50, 99]), **per_request_fields(runs)}
    back = results_from_json(d)
    assert [r.success for r in back] == [True, True, False, True]
    assert compute_metrics(back, 2.0, [50, 99]) == compute_metrics(runs, 2.0, [50, 99])
    table = format_table(d, ["ttft", "tpot"], [50, 99], "T")
    assert "P99 TTFT (ms):" in table and "Median TPOT (ms):" in table and "ITL" not in table


def test_arrival_times():
    assert arrival_times(4, math.inf) == [0.0] * 4
    t = arrival_times(50, 10.0, 1.0, seed=1)
    assert t == sorted(t) and t[-1] == pytest.approx(5.0)  # rescaled: last arrival at n / rate
    assert t == arrival_times(50, 10.0, 1.0, seed=1)
    assert np.diff([0.0] + arrival_times(5, 2.0, math.inf)) == pytest.approx([0.5] * 5)

    def cv(b):  # coefficient of variation of the gaps: 1 for Poisson, lower when more uniform
        g = np.diff([0.0] + arrival_times(4000, 10.0, b, seed=0))
        return g.std() / g.mean()

    assert cv(0.25) > 1.5 > cv(1.0) > 0.8 > cv(4.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


def test_metrics_by_length_class():
    rng = random.Random(0)
    results = [RequestResult(success=True, prompt_len=10, output_tokens=4, ttft=0.01 * (i + 1), latency=0.1,
                             length_class="short") for i in range(10)]
    results += [RequestResult(success=True, prompt_len=9000, output_tokens=4, ttft=rng.uniform(0.5, 0.6) if i else 2.0,
                              latency=2.5, length_class="long") for i in range(5)]
    results.append(RequestResult(success=False, length_class="long", error="x"))
    m = compute_metrics(results, 10.0)
    by = m["by_length_class"]
    assert by["short"]["completed"] == 10 and by["long"]["completed"] == 5 and by["long"]["failed"] == 1
    assert by["short"]["median_ttft_ms"] == pytest.approx(55.0)
    assert by["long"]["p99_ttft_ms"] > 1900  # the one cold document dominates the long P99
    assert m["long_short_p99_ttft_ratio"] == pytest.approx(by["long"]["p99_ttft_ms"] / by["short"]["p99_ttft_ms"])
    assert "by_length_class" not in compute_metrics([RequestResult(success=True, ttft=0.1, latency=0.2)], 1.0)
