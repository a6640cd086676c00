"""`tokenmill tune`: a tiny real search on the shipped model writes its JSON, command line and report, and
its winner meets the SLO when re-measured; bad SLO strings and unknown settings get clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.tune.search import best_trial, objective_value
from tokenmill.tune.slo import parse_slos, per_request_slos, violation
from tokenmill.tune.space import SPACE, fixed_settings, normalize, searched, to_flags


def test_a_tiny_search_writes_its_outputs_and_its_winner_meets_the_slo(tmp_path):
    out = tmp_path / "tune"
    r = subprocess.run([sys.executable, "-m", "tokenmill", "tune", "--slo", "ttft_p99=5000ms,tpot_p99=2s",
                        "--max-trials", "2", "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
                        "--max-concurrency", "4", "--search", "max_num_seqs,enable_prefix_caching",
                        "--max-model-len", "256", "--output-dir", str(out), "--disable-tqdm"],
                       capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "tune.json").read_text())
    assert len(doc["trials"]) == 2 and all(not t["failed"] for t in doc["trials"])
    assert set(doc["space"]) == {"max_num_seqs", "enable_prefix_caching"}
    assert doc["fixed"] == {"max_model_len": 256}  # given on the command line: fixed, not searched
    best = doc["best"]
    assert best["meets_slo"] and best["result"]["request_goodput"] > 0
    assert doc["best_command"].startswith("tokenmill serve --model ") and "--max-model-len 256" in doc["best_command"]
    assert (out / "best_command.sh").read_text().strip() == doc["best_command"]
    assert doc["remeasure"]["best"]["meets_slo"] and doc["remeasure"]["defaults"]["result"]["request_goodput"] > 0
    report = (out / "report.md").read_text()
    assert "Re-measured side by side" in report and "![pareto.png](pareto.png)" in report
    for png in ("goodput.png", "p99.png", "pareto.png"):
        assert (out / png).stat().st_size > 5000


@pytest.mark.parametrize("text,message", [
    ("", "at least one target"),
    ("ttft=500ms", "write METRIC_pPCT=VALUE"),
    ("latency_p99=500ms", "must be one of ttft, tpot, itl, e2el"),
    ("ttft_p100=5ms", "in \\(0, 100\\)"),
    ("ttft_p99=0ms", "positive"),
    ("ttft_p99=500ms,ttft_p99=1s", "twice"),
])
def test_bad_slo_strings_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slos(text)


def test_slo_parsing_and_scoring():
    slos = parse_slos("ttft_p99=0.5s, tpot_p90=50ms")
    assert [(s.key, s.ms) for s in slos] == [("p99_ttft_ms", 500.0), ("p90_tpot_ms", 50.0)]
    assert per_request_slos(slos) == {"ttft": 500.0, "tpot": 50.0}
    good = {"p99_ttft_ms": 400.0, "p90_tpot_ms": 40.0, "request_goodput": 3.0}
    bad = {"p99_ttft_ms": 750.0, "p90_tpot_ms": 40.0, "request_goodput": 9.0}
    assert violation(good, slos) == 0 and violation(bad, slos) == pytest.approx(0.5)
    assert objective_value(good, slos) == 3.0 and objective_value(bad, slos) < 0  # a miss never beats a hit


def test_the_space_leaves_fixed_settings_alone():
    fixed = fixed_settings({"max_num_seqs": 8, "block_size": 16, "model": "m"})
    assert fixed == {"max_num_seqs": 8, "model": "m"}
    assert "max_num_seqs" not in searched(None, fixed) and "block_size" in searched(None, fixed)
    assert normalize({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}) == {"enable_chunked_prefill": False}
    # one long prefill at a time needs a threshold that says which prompts are long
    assert normalize({"long_prefill_token_threshold": 0, "max_long_partial_prefills": 1})["max_long_partial_prefills"] == 0
    assert normalize({"long_prefill_token_threshold": 512, "max_long_partial_prefills": 1,
                      "max_num_batched_tokens": 2048})["max_long_partial_prefills"] == 1
    assert "max_long_partial_prefills" not in searched(["max_long_partial_prefills"], {})
    assert "max_long_partial_prefills" in searched(["max_long_partial_prefills"], {"long_prefill_token_threshold": 256})
    assert to_flags({"enable_prefix_caching": False, "max_num_seqs": 8, "quantization": None}) == [
        "--no-enable-prefix-caching", "--max-num-seqs", "8"]
    with pytest.raises(ValueError, match="unknown setting\\(s\\) to search: foo; searchable: max_num_seqs"):
        searched(["max_num_seqs", "foo"], {})


def test_precision_and_parallelism_are_searched_only_where_checkpoint_and_machine_leave_a_choice():
    import copy

    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.models.loader import load_hf_config
    from tokenmill.tune.space import constraints

    f32 = load_hf_config(DEFAULT_MODEL)  # float32; 4 heads, 2 KV heads, 6 layers
    bf16, awq = copy.deepcopy(f32), copy.deepcopy(f32)
    bf16.dtype = "bfloat16"
    awq.dtype, awq.quantization_config = "float16", {"quant_method": "awq", "bits": 4, "group_size": 128}
    space = searched(None, {}, constraints(f32, max_ranks=8))
    assert space["dtype"] == [None, "bfloat16"] and space["quantization"] == [None, "int8", "w8a8"]
    assert space["tensor_parallel_size"] == [1, 2, 4]  # 8 does not divide 4 attention heads
    assert space["pipeline_parallel_size"] == [1, 2, 4]
    assert searched(None, {}, constraints(f32, max_ranks=2))["tensor_parallel_size"] == [1, 2]
    assert "tensor_parallel_size" not in searched(None, {}, constraints(f32, max_ranks=1))  # one choice is none
    assert "dtype" not in searched(None, {}, constraints(bf16, 8))  # bfloat16 is what auto gives
    assert "quantization" in searched(None, {}, constraints(bf16, 8))
    space = searched(["quantization", "dtype", "max_num_seqs"], {}, constraints(awq, 8))
    assert list(space) == ["max_num_seqs"]  # an AWQ checkpoint keeps its format
    assert to_flags({"dtype": "bfloat16", "quantization": "w8a8"}) == ["--dtype", "bfloat16", "--quantization", "w8a8"]
    # combinations the engine would refuse are turned into ones it runs
    assert normalize({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, max_ranks=2)["pipeline_parallel_size"] == 1
    assert normalize({"tensor_parallel_size": 2, "kv_host_cache_gb": 1.0})["kv_host_cache_gb"] == 0.0
    assert normalize({"pipeline_parallel_size": 2, "speculative_config": "{}"})["speculative_config"] is None
    # every searched value becomes flags that `tokenmill serve` parses back to the same engine setting
    import argparse

    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name, values in SPACE.items():
        for value in values:
            parsed = engine_kwargs(parser.parse_args(to_flags({name: value})))
            assert value is None or parsed[name] == value, (name, value, parsed[name])


def test_the_search_measures_each_combination_once_and_ends_when_the_space_runs_out(monkeypatch):
    import tokenmill.tune.search as search_mod

    runs = []

    def fake_trial(settings, base_flags, load, keep_going=lambda first: True):
        runs.append(dict(settings))
        goodput = 2.0 if settings.get("quantization") == "w8a8" else 1.0
        result = {"request_goodput": goodput, "p99_ttft_ms": 100.0}
        assert keep_going(result)  # every fake result meets the SLO, so no trial is pruned
        return result

    monkeypatch.setattr(search_mod, "run_trial", fake_trial)
    slos = parse_slos("ttft_p99=500ms")
    trials = search_mod.search({"quantization": [None, "int8", "w8a8"]}, [], None, slos, max_trials=6,
                               budget_minutes=None, show_progress=False)
    measured = sorted(str(r["quantization"]) for r in runs)
    assert measured == ["None", "int8", "w8a8"]  # three combinations, each run once, then the search stops
    assert [t["number"] for t in trials] == [0, 1, 2]
    assert best_trial(trials)["settings"] == {"quantization": "w8a8"}
