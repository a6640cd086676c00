"""The optimization ladders (playbook and long-text) run end to end on CPU, every rung gives the baseline's
greedy text, and the reports render."""
import json

import pytest

from tokenmill.bench.ladder import RUNGS, SCENARIOS, ladder_configs, long_text_rungs, run_ladder
from tokenmill.bench.report import render_report, validate_ladder
from tokenmill.config import DEFAULT_MODEL


def test_rungs_add_one_optimization_each():
    cfgs = [c for _, _, c in ladder_configs({"model": "m"})]
    assert cfgs[0]["batching"] == "static" and cfgs[0]["kv_layout"] == "contiguous"
    assert cfgs[0]["attention_impl"] == "eager" and cfgs[0]["cpu_linear_kernel"] == "torch"
    for before, after, (_, _, delta) in zip(cfgs, cfgs[1:], RUNGS[1:]):
        changed = {k for k in after if after[k] != before.get(k)}
        assert changed and changed <= set(delta)
    last = cfgs[-1]
    assert (last["batching"], last["kv_layout"], last["attention_impl"]) == ("continuous", "paged", "fused")
    assert last["enable_prefix_caching"]


def test_ladder_end_to_end_and_report(tmp_path):
    out = tmp_path / "ladder.json"
    ladder = run_ladder(DEFAULT_MODEL, str(out), workload=dict(num_prompts=6, request_rate=50.0, prefix_len=48,
                        suffix_len=8, num_prefixes=2, output_len=6), max_model_len=128, max_num_seqs=4)
    validate_ladder(json.loads(out.read_text()))
    assert [r["name"] for r in ladder["rungs"]] == [n for n, _, _ in RUNGS]
    for r in ladder["rungs"]:
        assert r["failed_requests"] == 0 and r["output_throughput"] > 0 and r["peak_memory_mb"] > 0
        if r["lossy"]:  # int8 weights may flip a near-tie: most requests, not all, must agree
            assert sum(r["same_greedy_text_by_request"]) * 2 >= len(r["same_greedy_text_by_request"]), r["name"]
        else:
            assert r["same_greedy_text_as_baseline"], r["name"]
    lossy = [r["lossy"] for r in ladder["rungs"]]
    assert ladder["rungs"][lossy.index(True)]["name"] == "+ int8 weights"  # rungs are cumulative from there on
    report = render_report([str(out)], str(tmp_path / "report"))
    text = open(report).read() if not report.lstrip().startswith("#") else report
    assert "+ continuous batching" in text and list((tmp_path / "report").glob("*.png"))


def test_long_text_ladder_switches_the_levers_on_in_turn(tmp_path):
    out = tmp_path / "long.json"
    rungs = long_text_rungs((128, 32), host_cache_gb=0.01)
    cfgs = [c for _, _, c in ladder_configs({"model": "m"}, SCENARIOS["long-text"], rungs)]
    assert not cfgs[0]["enable_chunked_prefill"] and not cfgs[0]["enable_prefix_caching"]
    assert [c["max_num_batched_tokens"] for c in cfgs[1:5]] == [128, 128, 128, 32]
    assert [c.get("long_prefill_token_threshold", 0) for c in cfgs[1:5]] == [0, 64, 64, 16]
    assert [c.get("max_long_partial_prefills", 0) for c in cfgs[1:5]] == [0, 0, 1, 1]
    assert cfgs[-1]["enable_prefix_caching"] and cfgs[-1]["kv_host_cache_gb"] == 0.01 and cfgs[-1]["speculative_config"]
    ladder = run_ladder(DEFAULT_MODEL, str(out), "long-text", dict(
        num_prompts=8, request_rate=50.0, long_doc_len=256, short_len=16, question_len=8, questions_per_doc=2,
        long_fraction=0.5, output_len=4), max_model_len=None, max_num_seqs=4, rungs=rungs)
    assert ladder["engine"]["max_model_len"] == 256 + 8 + 4
    by_name = {r["name"]: r for r in ladder["rungs"]}
    for r in ladder["rungs"]:
        assert r["failed_requests"] == 0 and r["same_greedy_text_as_baseline"], r["name"]
        assert set(r["by_length_class"]) == {"long", "short"} and r["long_short_p99_ttft_ratio"] > 0
    assert by_name["chunk budget 32"]["kv_cache"]["prefix_cache_hit_rate"] == 0
    assert by_name["+ prefix caching"]["kv_cache"]["prefix_cache_hit_rate"] > 0
    assert by_name["+ tiered KV cache"]["kv_cache"]["tiers"]["host"]["blocks_stored"] > 0
    report = open(render_report([str(out)], str(tmp_path / "report"))).read()
    assert "By prompt length class" in report and (tmp_path / "report" / "ladder_long_classes.png").exists()
    with pytest.raises(ValueError, match="no workload setting"):
        run_ladder(DEFAULT_MODEL, str(out), "long-text", dict(prefix_len=4))
