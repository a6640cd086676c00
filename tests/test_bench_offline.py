"""`bench offline` drives the in-process engine and returns the same result format as `bench serve`."""
import json
import math
import subprocess
import sys

import pytest

from tokenmill.bench.datasets import RandomDataset, SampleRequest, sample_requests
from tokenmill.bench.offline import build_engine, run_offline
from tokenmill.config import DEFAULT_MODEL

KW = dict(model=DEFAULT_MODEL, dtype="float32", max_model_len=128, kv_cache_memory_gb=0.02, seed=0)


@pytest.fixture(scope="module")
def engine():
    return build_engine(KW)


def _check_consistent(res: dict, n: int) -> None:
    assert res["num_prompts"] == n == len(res["latencies"]) == len(res["ttfts"]) == len(res["itls"])
    ok = [i for i in range(n) if res["successes"][i]]
    assert res["completed"] == len(ok) and res["failed"] == n - len(ok)
    assert res["total_output_tokens"] == sum(res["output_lens"][i] for i in ok)
    assert res["total_input_tokens"] == sum(res["input_lens"][i] for i in ok)
    for i in ok:
        assert 0 < res["ttfts"][i] <= res["latencies"][i]
        # every step that gave a request tokens is one 'chunk': at most one gap per token after the first
        assert len(res["itls"][i]) <= res["output_lens"][i] - 1
        assert res["ttfts"][i] + sum(res["itls"][i]) == pytest.approx(res["latencies"][i])
    for key in ("mean_ttft_ms", "p99_ttft_ms", "p90_tpot_ms", "median_itl_ms", "p99_e2el_ms", "output_throughput"):
        assert math.isfinite(res[key])


def test_throughput_run(engine):
    reqs = sample_requests(RandomDataset(24, 6, 0.3), 6, engine.tokenizer, seed=1)
    res = run_offline(reqs, KW, engine=engine, ignore_eos=True, num_warmups=1, disable_tqdm=True,
                      goodput_slos_ms={"e2el": 1e9})
    _check_consistent(res, 6)
    assert res["kind"] == "offline" and res["request_rate"] == "inf" and res["failed"] == 0
    assert res["output_lens"] == [r.expected_output_len for r in reqs]  # ignore_eos: exactly max_tokens
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["peak_rss_mb"] > 0 and 0 < res["cpu_utilization"] <= 100
    assert res["engine_kwargs"]["max_model_len"] == 128
    json.dumps(res)  # the result file is plain JSON


def test_arrivals_and_a_failed_request(engine):
    reqs = sample_requests(RandomDataset(16, 4), 4, engine.tokenizer, seed=2)
    reqs.append(SampleRequest(list(range(10, 200)), 190, 4, request_id="too-long"))  # > max_model_len
    res = run_offline(reqs, engine=engine, request_rate=40.0, ignore_eos=True, num_warmups=0, disable_tqdm=True)
    _check_consistent(res, 5)
    assert res["failed"] == 1 and not res["successes"][-1] and "max_model_len" in res["errors"][-1]
    assert res["start_times"][:4] == sorted(res["start_times"][:4]) and res["start_times"][3] > 0
    assert not engine.has_unfinished_requests()


def test_cli_writes_result(tmp_path):
    out = tmp_path / "offline.json"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "offline", "--num-prompts", "3", "--input-len", "12",
           "--output-len", "3", "--ignore-eos", "--max-model-len", "64", "--kv-cache-memory-gb", "0.02",
           "--dtype", "float32", "--disable-tqdm", "--result-file", str(out), "--label", "cli"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Offline Benchmark Result" in proc.stdout
    res = json.loads(out.read_text())
    assert res["label"] == "cli" and res["completed"] == 3 and res["total_output_tokens"] == 9
    assert res["dataset"]["dataset_name"] == "random"


def test_engine_counters_cover_the_measured_run_only():
    """The kv_cache and spec_decode blocks are the run's: the warm-up's counts (and an earlier run's, on a passed-in
    engine) stayed in, so every accepted draft of a short run could be the warm-up's, and its missed prompt tokens
    lowered the hit rate. Here a second run on the same engine reports exactly the engine's counters' deltas."""
    from tokenmill.bench.datasets import PrefixRepetitionDataset

    kw = dict(KW, enable_prefix_caching=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    eng = build_engine(kw)
    reqs = sample_requests(PrefixRepetitionDataset(48, 8, 2, 12), 4, eng.tokenizer, seed=0)
    run = dict(engine=eng, ignore_eos=True, sampling={"temperature": 0.0}, disable_tqdm=True)
    run_offline(reqs, kw, num_warmups=1, **run)
    a = eng.get_stats()
    res = run_offline(reqs, kw, num_warmups=0, **run)
    b = eng.get_stats()
    spec = res["spec_decode"]
    assert spec["num_drafts"] == b.spec_num_drafts - a.spec_num_drafts > 0
    assert spec["num_accepted_tokens"] == b.spec_num_accepted_tokens - a.spec_num_accepted_tokens
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]
    hits, queries = b.prefix_cache_hits - a.prefix_cache_hits, b.prefix_cache_queries - a.prefix_cache_queries
    assert res["kv_cache"]["prefix_cache_hit_rate"] == pytest.approx(hits / queries) and queries > 0
