"""`tokenmill tune`: a tiny real search on the shipped model writes its JSON, command line and report, and
its winner meets the SLO when re-measured; bad SLO strings and unknown settings get clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.tune.search import best_trial, objective_value
from tokenmill.tune.slo import parse_slos, per_request_slos, violation
from tokenmill.tune.space import fixed_settings, normalize, searched, to_flags


def test_a_tiny_search_writes_its_outputs_and_its_winner_meets_the_slo(tmp_path):
    out = tmp_path / "tune"
    r = subprocess.run([sys.executable, "-m", "tokenmill", "tune", "--slo", "ttft_p99=5000ms,tpot_p99=2s",
                        "--max-trials", "2", "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
                        "--max-concurrency", "4", "--search", "max_num_seqs,enable_prefix_caching",
                        "--max-model-len", "256", "--output-dir", str(out), "--disable-tqdm"],
                       capture_output=True, text=True, timeout=600)
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


def test_precision_is_searched_only_where_the_checkpoint_leaves_a_choice():
    from types import SimpleNamespace

    from tokenmill.tune.space import model_constraints

    f32, bf16 = SimpleNamespace(dtype="float32"), SimpleNamespace(torch_dtype="bfloat16")
    awq = SimpleNamespace(dtype="float16", quantization_config={"quant_method": "awq", "bits": 4})
    assert searched(None, {}, model_constraints(f32))["dtype"] == [None, "bfloat16"]
    assert searched(None, {}, model_constraints(f32))["quantization"] == [None, "int8", "w8a8"]
    assert "dtype" not in searched(None, {}, model_constraints(bf16))  # bfloat16 is what auto gives
    assert "quantization" in searched(None, {}, model_constraints(bf16))
    space = searched(["quantization", "dtype", "max_num_seqs"], {}, model_constraints(awq))
    assert list(space) == ["max_num_seqs"]  # an AWQ checkpoint keeps its format
    assert to_flags({"dtype": "bfloat16", "quantization": "w8a8"}) == ["--dtype", "bfloat16", "--quantization", "w8a8"]


def test_the_cli_reports_bad_input_clearly():
    r = subprocess.run([sys.executable, "-m", "tokenmill", "tune", "--slo", "ttft_p99=fast", "--max-trials", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: bad SLO 'ttft_p99=fast'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tokenmill", "tune", "--slo", "ttft_p99=1s", "--search", "warp_drive"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown setting(s) to search: warp_drive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tokenmill", "tune", "--slo", "ttft_p99=1s", "--max-model-len", "99999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exceeds the model's limit" in r.stderr  # before any trial starts a server


def test_when_no_trial_meets_the_slo_the_closest_is_named(tmp_path):
    from tokenmill.tune.report import write_outputs
    from tokenmill.tune.search import closest_trial
    from tokenmill.tune.slo import misses

    slos = parse_slos("ttft_p99=100ms,tpot_p99=20ms")

    def trial(n, ttft, tpot, pruned=False):
        result = {"p99_ttft_ms": ttft, "p99_tpot_ms": tpot, "request_goodput": 1.0, "output_throughput": 50.0}
        return {"number": n, "settings": {"max_num_seqs": 8 * (n + 1)}, "value": objective_value(result, slos),
                "meets_slo": violation(result, slos) <= 0, "pruned": pruned, "failed": 0, "result": result}

    trials = [trial(0, 400, 10), trial(1, 150, 25), trial(2, 101, 10, pruned=True)]
    assert best_trial(trials) is None
    closest = closest_trial(trials)
    assert closest["number"] == 1  # misses TTFT by 50 %; trial 0 by 300 %; trial 2 was stopped early
    assert misses(closest["result"], slos) == ["ttft_p99=100ms: 150 ms", "tpot_p99=20ms: 25 ms"]
    doc = {"slos": [str(s) for s in slos], "trials": trials, "best": None, "best_command": None,
           "closest": closest, "closest_command": "tokenmill serve --max-num-seqs 16",
           "closest_misses": misses(closest["result"], slos)}
    paths = write_outputs(str(tmp_path), doc, slos)
    assert "Closest (trial 1, misses ttft_p99=100ms: 150 ms" in open(paths["report"]).read()
    assert open(paths["command"]).read().splitlines()[-1] == "tokenmill serve --max-num-seqs 16"


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
