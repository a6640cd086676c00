"""Tuned against default settings, in the same run: `tokenmill tune` on a workload, then its own
side-by-side re-measurement of the winner and the defaults (tune.json "remeasure").

    python benchmarks/bench_tune.py --label chat --slo ttft_p99=500ms,tpot_p99=25ms \
        --tune-args "--dataset-name random --input-len 512 --output-len 64 --num-prompts 60 --request-rate 16"

Writes benchmarks/results/tune_<label>/ (tune.json, report.md, plots, best_command.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--slo", required=True)
    ap.add_argument("--tune-args", default="", help="workload and engine flags for tokenmill tune")
    ap.add_argument("--max-trials", type=int, default=8)
    ap.add_argument("--budget-minutes", type=float, default=20)
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results" / f"tune_{args.label}"
    cmd = [sys.executable, "-m", "tokenmill", "tune", "--slo", args.slo, "--max-trials", str(args.max_trials),
           "--budget-minutes", str(args.budget_minutes), "--output-dir", str(out), "--disable-tqdm",
           *shlex.split(args.tune_args)]
    subprocess.run(cmd, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    doc = json.loads((out / "tune.json").read_text())
    rem = doc.get("remeasure") or {}
    print(json.dumps({"best_command": doc.get("best_command"), "goodput_ratio": rem.get("goodput_ratio"),
                      "best": rem.get("best"), "defaults": rem.get("defaults")}, indent=1))


if __name__ == "__main__":
    main()
