"""`bench serve`'s speculative-decoding figures: parsed from a server's Prometheus counters (tokenmill's own
exposition, and vLLM's names), differenced over a run; and end to end against `tokenmill serve` with n-gram
speculation, where they must equal what the engine counted."""
import asyncio

import pytest

from tokenmill.bench.datasets import SampleRequest, get_tokenizer
from tokenmill.bench.metrics import format_table
from tokenmill.bench.serve_client import run_benchmark
from tokenmill.bench.server_metrics import parse_spec_counters, spec_decode_delta
from tokenmill.engine.core import EngineStats
from tokenmill.engine.metrics import ServerMetrics
from server_fixtures import ServerProcess, engine_stats, tiny_model_dir  # noqa: F401, F811  (fixture)

VLLM_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
"""


def _tokenmill_text(drafts, draft_tokens, accepted, per_pos) -> str:
    m = ServerMetrics("tiny")
    m.set_engine_stats(EngineStats(0, 0, 10, 10, 0.0, 0, 0, 0.0, 0, 0, spec_num_drafts=drafts,
                                   spec_num_draft_tokens=draft_tokens, spec_num_accepted_tokens=accepted,
                                   spec_accepted_per_pos=per_pos, spec_acceptance_rate=0.9))
    return m.render().decode()


def test_counters_from_tokenmill_and_vllm_expositions():
    got = parse_spec_counters(_tokenmill_text(4, 12, 5, [3, 2, 0]))
    assert got == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 5,
                   "per_pos": {0: 3, 1: 2, 2: 0}}
    assert parse_spec_counters(VLLM_TEXT) == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                                              "per_pos": {0: 7, 1: 4, 2: 1}}
    assert parse_spec_counters(_tokenmill_text(0, 0, 0, [])) is None  # speculation off: no counters exported
    assert parse_spec_counters("# TYPE x counter\nx_total 3\n") is None


def test_the_run_is_the_difference_of_two_scrapes():
    before = parse_spec_counters(_tokenmill_text(4, 12, 5, [3, 2, 0]))
    after = parse_spec_counters(_tokenmill_text(14, 42, 17, [10, 6, 1]))
    d = spec_decode_delta(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (10, 30, 12)
    assert d["accepted_per_pos"] == [7, 4, 1]
    assert d["acceptance_rate"] == pytest.approx(0.4) and d["mean_acceptance_length"] == pytest.approx(2.2)
    assert spec_decode_delta(None, after)["num_drafts"] == 14  # counters that appeared during the run
    assert spec_decode_delta(after, after) is None  # no verification step in the run
    assert spec_decode_delta(before, None) is None
    table = format_table({**_table_base(), "spec_decode": d}, [], [50], "t")
    assert "Draft acceptance rate (%):" in table and "40.00" in table


def _table_base() -> dict:
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "max_output_tokens_per_s", "max_concurrent_requests", "total_token_throughput")
    return dict.fromkeys(keys, 1)


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory):
    s = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("spec") / "serve.log", "--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 3}')
    s.wait_ready()
    yield s
    s.terminate()


def test_bench_serve_reports_the_servers_speculation(spec_server, tiny_model_dir):
    """A prompt that repeats itself gives the n-gram proposer matches: the run's figures are the engine's own
    counters (the server was idle before it)."""
    tok = get_tokenizer(tiny_model_dir)
    text = "one two three four one two three four one two three four one two"
    reqs = [SampleRequest(prompt=text, prompt_len=len(tok.encode(text)), expected_output_len=24) for _ in range(3)]
    before = engine_stats(spec_server)
    res = asyncio.run(run_benchmark(reqs, spec_server.url, "tiny", tokenizer=tok, ignore_eos=True,
                                    sampling={"temperature": 0}, disable_tqdm=True))
    after = engine_stats(spec_server)
    assert res["completed"] == 3 and res["failed"] == 0
    spec = res["spec_decode"]
    assert spec["num_drafts"] == after["spec_num_drafts"] - before["spec_num_drafts"] > 0
    assert spec["num_draft_tokens"] == after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert spec["num_accepted_tokens"] == after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]
    assert spec["source"] == "server /metrics"
