"""The optimization ladder runs end to end on CPU and its report renders."""
import json

from tokenmill.bench.ladder import RUNGS, ladder_configs, run_ladder
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
    ladder = run_ladder(DEFAULT_MODEL, str(out), num_prompts=6, request_rate=50.0, prefix_len=48, suffix_len=8,
                        num_prefixes=2, output_len=6, max_model_len=128, max_num_seqs=4)
    validate_ladder(json.loads(out.read_text()))
    assert [r["name"] for r in ladder["rungs"]] == [n for n, _, _ in RUNGS]
    for r in ladder["rungs"]:
        assert r["failed_requests"] == 0 and r["output_throughput"] > 0 and r["peak_memory_mb"] > 0
    report = render_report([str(out)], str(tmp_path / "report"))
    text = open(report).read() if not report.lstrip().startswith("#") else report
    assert "+ continuous batching" in text and list((tmp_path / "report").glob("*.png"))
